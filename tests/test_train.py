"""train/train.py on a tiny random Llama: learning, resumption, Medusa-2, multi-process launch, named errors."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from medusa import MedusaModel
from medusa.config import WEIGHTS_NAME, MedusaConfig
from medusa.heads import MedusaHeads, following_tokens
from medusa.train import train as train_mod
from medusa.train import trainer as trainer_mod
from medusa.train.batches import Conversation, load_conversations, split_eval
from medusa.train.config import Config, load_config
from medusa.train.hidden_cache import HiddenCache, span_start
from medusa.train.trainer import build_heads
from tests.conftest import HIDDEN, VOCAB, make_tiny_model

REPO = Path(__file__).resolve().parent.parent

CYCLE = [11, 23, 37, 42, 58, 64, 79]  # the learnable pattern: every response walks this cycle


def reset_accelerate() -> None:
    """Each in-process run builds its own Accelerator; accelerate keeps process-wide singletons between them."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    reset_accelerate()
    yield
    reset_accelerate()


def run(raw: dict, **kwargs):
    reset_accelerate()
    return train_mod.train(build(raw), **kwargs)


def save_tiny_base(directory: Path) -> Path:
    """A tiny random Llama plus a word-level tokenizer (t0..t95), loadable by medusa.loading.load_base."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = make_tiny_model("llama")
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", unk_token="t1"
    )
    tokenizer.save_pretrained(directory)
    return directory


def write_shards(directory: Path, n: int = 48, response_len: int = 40, seed: int = 0, shards: int = 2) -> Path:
    """Self-distillation-shaped shards: a random prompt, then a response that repeats CYCLE from a random phase."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 9))]
        phase = rng.randrange(len(CYCLE))
        response = [CYCLE[(phase + i) % len(CYCLE)] for i in range(response_len)]
        rows.append(
            {"input_ids": prompt + response, "response_start": len(prompt), "source": "synthetic", "greedy": True}
        )
    per = (n + shards - 1) // shards
    for s in range(shards):
        Dataset.from_list(rows[s * per : (s + 1) * per]).save_to_disk(str(directory / f"shard-{s:05d}"))
    return directory


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("tiny-data"))


def sections(tmp: Path, base: Path, data: Path, heads: dict | None = None, **training) -> dict:
    raw = {
        "model": {"base": str(base), "dtype": "float32"},
        "data": {"out_dir": str(data)},
        "heads": {"num_heads": 3, "num_layers": 1, "projection": "shared", **(heads or {})},
        "training": {
            "output_dir": str(tmp / "heads"),
            "checkpoint_dir": str(tmp / "ckpt"),
            "cache_dir": str(tmp / "cache"),
            "lr": 1e-2,
            "batch_size": 4,
            "max_steps": 8,
            "eval_every": 0,
            "eval_conversations": 8,
            "log_every": 2,
            "save_every": 0,
            "mixed_precision": "no",
            "chunk_tokens": 64,
            **training,
        },
    }
    return raw


def build(raw: dict) -> Config:
    path = Path(raw["training"]["output_dir"]).parent / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path))


def top1(metrics: dict, head: int) -> float:
    return metrics[f"eval/head{head}/top1"]


# --------------------------------------------------------------------------- learning
def test_heads_learn_a_repeating_pattern(tmp_path, tiny_base, tiny_data):
    result = run(sections(tmp_path, tiny_base, tiny_data, max_steps=40, eval_every=20))
    first, last = result.eval_history[0], result.eval_history[-1]
    assert [h["step"] for h in result.eval_history] == [0, 20, 40]
    for k in range(3):
        assert last[f"eval/head{k}/ce"] < first[f"eval/head{k}/ce"] - 1.0, (k, first, last)
        assert top1(last, k) > 0.9 and top1(last, k) > top1(first, k) + 0.5, (k, first, last)
        assert last[f"eval/head{k}/top5"] >= top1(last, k)
    # The output directory is a complete heads directory with provenance.
    loaded = MedusaModel.from_pretrained(result.output_dir)
    assert loaded.config.num_heads == 3 and loaded.config.base_model_name_or_path == str(tiny_base)
    extra = loaded.config.extra
    assert extra["training"]["steps"] == 40 and extra["training"]["method"] == "medusa-1"
    assert extra["training"]["train_conversations"] == 40 and extra["training"]["eval_conversations"] == 8
    assert extra["eval"]["head0"]["top1"] == pytest.approx(top1(last, 0), abs=1e-4)
    assert not (result.output_dir / "adapter_config.json").exists()
    # The trained heads predict the cycle on a fresh sequence.
    ids = torch.tensor([[5, 9] + CYCLE * 2])
    with torch.no_grad():
        hidden = loaded.base(ids, output_hidden_states=True).hidden_states[-1]
        guesses = loaded.heads(hidden, loaded.base.get_output_embeddings()).argmax(-1)  # (K, 1, T)
    t = 2 + 3  # reads CYCLE[3]; head k predicts CYCLE[3 + k + 2]
    assert [int(guesses[k, 0, t]) for k in range(3)] == [CYCLE[(3 + k + 2) % len(CYCLE)] for k in range(3)]


def test_bf16_tokens_batches_and_own_projection_learn(tmp_path, tiny_base, tiny_data):
    raw = sections(
        tmp_path,
        tiny_base,
        tiny_data,
        heads={"projection": "own"},
        max_steps=30,
        batch_unit="tokens",
        batch_size=160,
        mixed_precision="bf16",
        lr=5e-3,
    )
    result = run(raw)
    first, last = result.eval_history[0], result.eval_history[-1]
    for k in range(3):
        assert top1(last, k) > top1(first, k) + 0.3, (k, first, last)
    state = load_file(str(result.output_dir / WEIGHTS_NAME))
    assert state["projections.0.weight"].shape == (VOCAB, HIDDEN)


def test_precomputed_and_live_hidden_states_train_alike(tmp_path, tiny_base, tiny_data):
    """The cached spans hold exactly what the heads read: same losses as running the base every step."""
    results = {}
    for precompute in (True, False):
        raw = sections(tmp_path / str(precompute), tiny_base, tiny_data, max_steps=4, precompute_hidden=precompute)
        (tmp_path / str(precompute)).mkdir()
        results[precompute] = run(raw).eval_history
    for a, b in zip(results[True], results[False]):
        for key in a:
            assert a[key] == pytest.approx(b[key], abs=2e-2), key  # the cache stores bf16 hidden states


def test_hidden_cache_is_reused_and_keyed_by_data(tmp_path, tiny_base, tiny_data, capsys):
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=2)
    run(raw)
    caches = list((tmp_path / "cache").glob("hidden-*.safetensors"))
    assert len(caches) == 1
    mtime = caches[0].stat().st_mtime_ns

    raw["training"]["output_dir"] = str(tmp_path / "heads2")
    raw["training"]["checkpoint_dir"] = str(tmp_path / "ckpt2")
    capsys.readouterr()
    run(raw)
    assert "reusing precomputed hidden states" in capsys.readouterr().out
    assert caches[0].stat().st_mtime_ns == mtime
    # Other data: another key, another file (a stale cache is never read for new data).
    other = write_shards(tmp_path / "other-data", n=30, seed=5, shards=1)
    raw["data"]["out_dir"] = str(other)
    raw["training"]["output_dir"] = str(tmp_path / "heads3")
    raw["training"]["checkpoint_dir"] = str(tmp_path / "ckpt3")
    run(raw)
    assert len(list((tmp_path / "cache").glob("hidden-*.safetensors"))) == 2


def test_corrupt_hidden_cache_is_named_and_rebuilt(tmp_path, tiny_base, tiny_data, capsys):
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=2)
    first = load_file(str(run(raw).output_dir / WEIGHTS_NAME))
    (cache,) = (tmp_path / "cache").glob("hidden-*.safetensors")
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])  # truncated, as by a full disk
    with pytest.raises(ValueError, match=f"hidden-state cache {cache} is unreadable .*: delete it"):
        HiddenCache.load(cache, "any key")
    capsys.readouterr()
    again = load_file(str(run(raw).output_dir / WEIGHTS_NAME))
    assert f"warning: hidden-state cache {cache} is unreadable" in capsys.readouterr().out
    assert HiddenCache.load(cache, "not its key") is None  # readable again
    for name in first:
        torch.testing.assert_close(first[name], again[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("trigger", ["PROGRESS_SECONDS", "PROGRESS_BYTES"])
def test_an_interrupted_hidden_state_precompute_resumes_where_it_stopped(tmp_path, monkeypatch, trigger):
    """Killed after three batches, a rerun computes only the rest, and its cache equals an uninterrupted one's
    (progress chunks written on time or on held bytes)."""
    from accelerate import Accelerator

    import medusa.train.hidden_cache as hc

    base, rng = make_tiny_model("llama"), random.Random(0)
    convs = [Conversation([rng.randrange(1, VOCAB) for _ in range(rng.randrange(12, 40))], 6) for _ in range(12)]
    accelerator, logs = Accelerator(cpu=True), []

    def build(path):
        return hc.build_hidden_cache(accelerator, base, convs, 4, path, "key", 100, logs.append)

    reference = build(tmp_path / "reference.safetensors")
    real, rows_run = hc.last_hidden, []

    def counted(model, input_ids, attention_mask, feature_layers=()):
        if len(rows_run) == 3 and interrupt:
            raise KeyboardInterrupt  # as a kill mid-way
        rows_run.append(input_ids.shape[0])
        return real(model, input_ids, attention_mask, feature_layers)

    monkeypatch.setattr(hc, "last_hidden", counted)
    monkeypatch.setattr(hc, trigger, 0)  # a progress chunk after every batch
    path, interrupt = tmp_path / "hidden-key.safetensors", True
    with pytest.raises(KeyboardInterrupt):
        build(path)
    assert not path.exists() and len(list(hc.progress_dir(path).glob("*.safetensors"))) == 3
    done, rows_run[:], interrupt = sum(rows_run), [], False
    resumed = build(path)
    assert 0 < done < len(convs) and sum(rows_run) == len(convs) - done
    assert f"resuming the precompute of {path.name}: {done} conversations already done" in " ".join(logs)
    assert torch.equal(resumed.hidden[:], reference.hidden[:])
    for name in ("ids", "offsets", "response_start"):
        assert torch.equal(getattr(resumed, name), getattr(reference, name)), name
    assert not hc.progress_dir(path).exists()  # removed once the cache is written
    # progress saved for another key (other data or base) is never read
    hc._save_spans(hc.progress_dir(path) / "stale.safetensors", {0: reference.hidden[:3]}, "other key", HIDDEN)
    assert hc._saved_progress(hc.progress_dir(path), "key", logs.append) == {}


class FakeBase:
    """A base whose hidden state at a position is a fixed function of its token and position, whatever the batch:
    a cache built in any batches, by any number of processes, equals the spans computed one conversation at a time."""

    def __init__(self, width: int):
        self.width = width
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=width))

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., T) token ids -> (..., T, width)."""
        position = torch.arange(ids.shape[-1])[:, None]
        return torch.sin(ids[..., None] * 0.37 + position * 0.11 + torch.arange(self.width) * 0.013)


def fake_last_hidden(model, input_ids, attention_mask, feature_layers=()):
    return model.hidden(input_ids)


class RankAccelerator:
    """What build_hidden_cache uses of an Accelerator, for process `rank` of `barrier.parties` (each run as a thread
    of this process; waiting for everyone is the shared barrier)."""

    device = torch.device("cpu")

    def __init__(self, rank: int = 0, barrier: threading.Barrier | None = None):
        self.process_index, self.num_processes = rank, barrier.parties if barrier else 1
        self.is_main_process = self.is_local_main_process = rank == 0
        self.barrier = barrier

    def wait_for_everyone(self):
        if self.barrier:
            self.barrier.wait()

    def autocast(self):
        return contextlib.nullcontext()


def fake_conversations(count: int, length: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    return [
        Conversation([rng.randrange(1, VOCAB) for _ in range(rng.randrange(length // 2, length))], rng.randrange(1, 9))
        for _ in range(count)
    ]


def test_a_built_hidden_cache_equals_the_spans_assembled_in_memory(tmp_path, monkeypatch):
    """Written chunk by chunk and copied span by span into the cache file, the hidden states are the ones an
    in-memory assembly of every conversation's span holds: every tensor and every batch equal, bit for bit."""
    import medusa.train.hidden_cache as hc

    monkeypatch.setattr(hc, "last_hidden", fake_last_hidden)
    monkeypatch.setattr(hc, "PROGRESS_BYTES", 4096)  # several chunks
    base, convs = FakeBase(24), fake_conversations(30, 40)
    built = hc.build_hidden_cache(RankAccelerator(), base, convs, 3, tmp_path / "h.safetensors", "k", 120, print)
    spans = {r: base.hidden(torch.tensor(c.ids))[span_start(c, 3) :].to(torch.bfloat16) for r, c in enumerate(convs)}
    in_memory = HiddenCache.assemble(convs, spans, 3)
    assert isinstance(built.hidden, hc.HiddenRows)  # read from the file
    assert torch.equal(built.hidden[:], in_memory.hidden)
    for name in ("ids", "offsets", "response_start"):
        assert torch.equal(getattr(built, name), getattr(in_memory, name)), name
    for rows in ([0], [29, 3, 17], list(range(30))):
        for name, value in in_memory.batch(rows).items():
            assert torch.equal(built.batch(rows)[name], value), name


def test_two_processes_build_the_cache_one_process_builds(tmp_path, monkeypatch):
    """Two ranks (threads with a barrier) each compute their share into chunks; the main one copies every chunk's
    spans into the cache, which both then read: the same file, byte for byte, as one process writes."""
    import medusa.train.hidden_cache as hc

    monkeypatch.setattr(hc, "PROGRESS_SECONDS", 0)  # a chunk per batch
    base, rng = make_tiny_model("llama"), random.Random(0)
    convs = [Conversation([rng.randrange(1, VOCAB) for _ in range(rng.randrange(12, 40))], 6) for _ in range(12)]

    def build(accelerator, path):
        return hc.build_hidden_cache(accelerator, base, convs, 4, path, "key", 100, print)

    one = build(RankAccelerator(), tmp_path / "one.safetensors")
    barrier = threading.Barrier(2, timeout=120)
    with ThreadPoolExecutor(2) as pool:
        ranks = [pool.submit(build, RankAccelerator(rank, barrier), tmp_path / "two.safetensors") for rank in (0, 1)]
        two = [rank.result() for rank in ranks]
    assert (tmp_path / "two.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    for cache in two:
        for rows in ([0, 5], list(range(12))):
            for name, value in one.batch(rows).items():
                assert torch.equal(cache.batch(rows)[name], value), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors", "two.safetensors"]  # chunks removed


def test_a_build_killed_while_writing_the_cache_leaves_none_and_resumes_without_computing(tmp_path, monkeypatch):
    import medusa.train.hidden_cache as hc

    calls = []
    monkeypatch.setattr(hc, "last_hidden", lambda *args: calls.append(1) or fake_last_hidden(*args))
    base, convs, path = FakeBase(8), fake_conversations(10, 30), tmp_path / "h.safetensors"
    real = hc._write_safetensors

    def killed_halfway(file, key, index, shape, spans):
        def some_then_kill():
            for r, span in enumerate(spans):
                if r == 5 and file == path:
                    raise KeyboardInterrupt  # as a kill while the cache is being written
                yield span

        real(file, key, index, shape, some_then_kill())

    monkeypatch.setattr(hc, "_write_safetensors", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        hc.build_hidden_cache(RankAccelerator(), base, convs, 3, path, "k", 60, print)
    assert [p.name for p in tmp_path.iterdir()] == [hc.progress_dir(path).name]  # no cache, not even half of one
    computed, calls[:] = len(calls), []
    monkeypatch.setattr(hc, "_write_safetensors", real)
    cache = hc.build_hidden_cache(RankAccelerator(), base, convs, 3, path, "k", 60, print)
    assert computed > 1 and calls == []  # every span came from the progress chunks
    spans = {r: base.hidden(torch.tensor(c.ids))[span_start(c, 3) :].to(torch.bfloat16) for r, c in enumerate(convs)}
    assert torch.equal(cache.hidden[:], HiddenCache.assemble(convs, spans, 3).hidden)


def status_mb(field: str) -> float:
    """A memory field of this process's /proc/self/status (VmRSS: resident now, VmHWM: its peak), in MB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(field)).split()[1]) / 1024


def measure_build(directory: str) -> None:
    """Build a large cache with FakeBase in this (fresh) process; print its size and the growth of this process's
    peak resident memory while building, in MB (test_building_the_hidden_cache_holds_a_bounded_part_of_it)."""
    import medusa.train.hidden_cache as hc

    hc.last_hidden = fake_last_hidden
    hc.PROGRESS_BYTES = 4 << 20
    convs = fake_conversations(560, 200)
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident memory
    before = status_mb("VmRSS")
    cache = hc.build_hidden_cache(
        RankAccelerator(), FakeBase(1024), convs, 0, Path(directory) / "h.safetensors", "k", 1024, print
    )
    growth = status_mb("VmHWM") - before
    size = cache.hidden.shape[0] * cache.hidden.shape[1] * 2 / 2**20
    print(json.dumps({"cache_mb": size, "peak_growth_mb": growth}))


def test_building_the_hidden_cache_holds_a_bounded_part_of_it(tmp_path):
    """Building a cache (in a fresh process: its peak resident memory is the build's) holds about one progress
    chunk and one batch of hidden states at a time, however large the cache."""
    if not Path("/proc/self/clear_refs").is_file():
        pytest.skip("reads peak resident memory from /proc")
    code = f"from tests.test_train import measure_build; measure_build({str(tmp_path)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.splitlines()[-1])
    assert result["cache_mb"] > 150
    # chunks of 4 MB, batches of 1024 tokens (4 MB in float32): 20-30 MB measured alone, 49 beside the rest of the
    # suite; holding every span and concatenating them, as the build did before, grew by 420 MB
    assert result["peak_growth_mb"] < result["cache_mb"] / 2, result


def test_extra_data_dirs_are_read_after_out_dir(tmp_path, tiny_base, tiny_data):
    more = write_shards(tmp_path / "more-data", n=16, seed=7, shards=1)
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=2)
    raw["data"]["extra_dirs"] = [str(more)]
    extra = MedusaModel.from_pretrained(run(raw).output_dir).config.extra["training"]
    assert extra["train_conversations"] + extra["eval_conversations"] == 48 + 16
    assert extra["data_dirs"] == [str(tiny_data), str(more)]
    raw["data"]["extra_dirs"] = [str(tmp_path / "missing")]
    raw["training"]["output_dir"] = str(tmp_path / "heads2")
    with pytest.raises(FileNotFoundError, match="no data shards in .*missing"):
        run(raw)


def test_an_added_data_dir_computes_only_its_own_hidden_states(tmp_path, tiny_base, tiny_data, capsys):
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=2)
    run(raw)
    (first,) = (tmp_path / "cache").glob("hidden-*.safetensors")
    stamp = first.stat().st_mtime_ns
    raw["data"]["extra_dirs"] = [str(write_shards(tmp_path / "more-data", n=16, seed=7, shards=1))]
    raw["training"]["output_dir"], raw["training"]["checkpoint_dir"] = str(tmp_path / "h2"), str(tmp_path / "c2")
    capsys.readouterr()
    run(raw)
    out = capsys.readouterr().out
    assert out.count("reusing precomputed hidden states") == 1 and out.count("precomputed hidden states of") == 1
    assert first.stat().st_mtime_ns == stamp and len(list((tmp_path / "cache").glob("hidden-*.safetensors"))) == 2


def test_concatenated_part_caches_equal_one_cache_over_everything():
    torch.manual_seed(0)
    convs = [
        Conversation(ids=torch.randint(0, 96, (n,)).tolist(), response_start=r)
        for n, r in [(9, 3), (5, 1), (12, 8), (7, 2)]
    ]
    spans = {i: torch.randn(len(c.ids) - span_start(c, 3), 4).to(torch.bfloat16) for i, c in enumerate(convs)}
    whole = HiddenCache.assemble(convs, spans, 3)
    parts = [
        HiddenCache.assemble(convs[:1], {0: spans[0]}, 3),
        HiddenCache.assemble(convs[1:], {i - 1: spans[i] for i in range(1, 4)}, 3),
    ]
    joined = HiddenCache.concat(parts)
    assert torch.equal(joined.hidden[:], whole.hidden) and torch.equal(joined.hidden[4:13], whole.hidden[4:13])
    for name in ("ids", "offsets", "response_start"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    rows = [3, 0, 2]
    for key, value in whole.batch(rows).items():
        assert torch.equal(joined.batch(rows)[key], value), key


# --------------------------------------------------------------------------- resumption
RESUME_MODES = {
    "precomputed": dict(precompute_hidden=True),
    "live-base": dict(precompute_hidden=False),
    # LoRA dropout draws random numbers every step: resumption must restore the RNG too.
    "medusa2": dict(precompute_hidden=False, medusa2=True, lora_r=4, lora_alpha=8, lora_dropout=0.2, lora_lr=1e-2),
}


@pytest.mark.parametrize("mode", sorted(RESUME_MODES))
def test_resume_equals_uninterrupted(tmp_path, tiny_base, tiny_data, mode):
    common = dict(max_steps=12, warmup_steps=3, save_every=6, grad_accum=2, weight_decay=0.01, **RESUME_MODES[mode])
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole_dir.mkdir(), split_dir.mkdir()
    whole = run(sections(whole_dir, tiny_base, tiny_data, **common))
    stopped = run(sections(split_dir, tiny_base, tiny_data, **common), stop_after_steps=6)
    assert stopped.output_dir is None and stopped.steps == 6
    state = split_dir / "ckpt" / "checkpoints" / "checkpoint_0" / "trainer_state.json"  # accelerate's naming
    assert state.is_file() and json.loads(state.read_text())["step"] == 6
    resumed = run(sections(split_dir, tiny_base, tiny_data, **common), resume=True)

    a, b = load_file(str(whole.output_dir / WEIGHTS_NAME)), load_file(str(resumed.output_dir / WEIGHTS_NAME))
    assert set(a) == set(b)
    assert any(a[k].abs().max() > 0 for k in a)  # the heads moved away from their zero initialisation
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    if mode == "medusa2":
        a, b = (load_file(str(r.output_dir / "adapter_model.safetensors")) for r in (whole, resumed))
        assert set(a) == set(b) and a
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert whole.eval_history[-1] == pytest.approx(resumed.eval_history[-1], abs=1e-6)
    assert (
        MedusaConfig.load(resumed.output_dir).extra["training"]["tokens_seen"]
        == MedusaConfig.load(whole.output_dir).extra["training"]["tokens_seen"]
    )


def test_sigkill_during_training_then_resume_equals_uninterrupted(tmp_path, tiny_base, tiny_data):
    """A real SIGKILL (no cleanup, maybe mid-save) of `python train/train.py`: --resume continues from the newest
    complete checkpoint and ends with the uninterrupted run's weights."""
    common = dict(max_steps=60, warmup_steps=3, save_every=4, keep_checkpoints=2, precompute_hidden=False)
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole_dir.mkdir(), split_dir.mkdir()
    raw = sections(split_dir, tiny_base, tiny_data, **common)
    config = split_dir / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train" / "train.py"), "--config", str(config)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = split_dir / "ckpt" / "checkpoints" / "checkpoint_0" / "trainer_state.json"
    deadline = time.time() + 120
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{stderr[-2000:]}"
    assert not (split_dir / "heads").exists()
    interrupted_save = split_dir / "ckpt" / "checkpoints" / "checkpoint_99"  # a kill mid-save leaves no state file
    interrupted_save.mkdir()
    resumed = run(raw, resume=True)
    assert not interrupted_save.exists()
    whole = run(sections(whole_dir, tiny_base, tiny_data, **common))
    a, b = load_file(str(whole.output_dir / WEIGHTS_NAME)), load_file(str(resumed.output_dir / WEIGHTS_NAME))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_grad_accumulation_equals_one_large_batch(tmp_path, tiny_base, tiny_data):
    """Losses are normalised by the positions of the whole optimizer step, so the split does not matter (prompts of
    3..8 tokens give the heads unequal position counts per conversation: a mean of means would differ)."""
    outputs = []
    for name, batch, accum in (("large", 4, 1), ("split", 1, 4)):
        (tmp_path / name).mkdir()
        outputs.append(
            run(
                sections(tmp_path / name, tiny_base, tiny_data, max_steps=6, batch_size=batch, grad_accum=accum)
            ).output_dir
        )
    a, b = (load_file(str(out / WEIGHTS_NAME)) for out in outputs)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_resume_refuses_a_changed_run_and_fresh_run_refuses_old_checkpoints(tmp_path, tiny_base, tiny_data):

    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=6, save_every=2)
    run(raw, stop_after_steps=2)
    with pytest.raises(FileExistsError, match="--resume"):
        run(raw)
    raw["training"]["lr"] = 0.5
    with pytest.raises(ValueError, match=r"training\.lr: 0\.01 -> 0\.5"):
        run(raw, resume=True)
    raw["training"]["checkpoint_dir"] = str(tmp_path / "none-here")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(raw, resume=True)


def test_wandb_logs_offline_without_an_account(tmp_path, tiny_base, tiny_data, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        run(sections(tmp_path, tiny_base, tiny_data, max_steps=2, report_to="wandb", run_name="tiny"))
        assert os.environ["WANDB_MODE"] == "offline"
    finally:
        os.environ.pop("WANDB_MODE", None)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


# --------------------------------------------------------------------------- Medusa-2
@pytest.mark.parametrize(
    "heads",
    [
        {},
        {"condition_on_next_token": True, "context_window": 4},
        {"condition_on_next_token": True, "context_window": 4, "feature_layers": [0, 1]},
    ],
    ids=["plain", "context", "fused"],
)
def test_medusa2_trains_adapter_and_heads_and_loads_merged(tmp_path, tiny_base, tiny_data, heads):
    raw = sections(
        tmp_path,
        tiny_base,
        tiny_data,
        heads=heads,
        max_steps=10,
        medusa2=True,
        precompute_hidden=False,
        lora_r=4,
        lora_alpha=8,
        lora_lr=1e-2,
        lora_dropout=0.0,
        kl_weight=1.0,
    )
    result = run(raw)
    out = result.output_dir
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    card = (out / "README.md").read_text()  # ours, not peft's placeholder template
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "medusa" and "medusa-2" in front["tags"]
    assert "base_model" not in front and "| head0 |" in card  # a local directory is no Hub id the Hub could link
    assert "eval/kl" in result.eval_history[-1] and result.eval_history[0]["eval/kl"] == pytest.approx(0, abs=1e-6)
    assert result.eval_history[-1]["eval/kl"] > 0  # the adapter moved the base (and the KL term measures it)
    assert top1(result.eval_history[-1], 0) > top1(result.eval_history[0], 0)
    config = MedusaConfig.load(out)
    assert config.extra["training"]["method"] == "medusa-2"

    # from_pretrained merges the adapter: its base equals the peft model's adapted base.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = MedusaModel.from_pretrained(out)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), str(out)).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    ids = torch.tensor([[3, 4, 5] + CYCLE])
    with torch.no_grad():
        merged, adapted, original = loaded.base(ids).logits, peft_model(ids).logits, plain(ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)
    assert (merged - original).abs().max() > 1e-4  # the adapter really changed the base
    assert loaded.config.feature_layers == heads.get("feature_layers", [])
    # the heads read the adapted base's features, and decoding stays exactly the adapted base's greedy output
    prompt = torch.tensor([[3, 4, 5] + CYCLE[:4]])
    expected = loaded.base.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=12, tree=[[0], [1], [0, 0]]), expected)
    # saved again, the heads keep their adapter: loading that directory gives the same adapted base
    loaded.save_pretrained(tmp_path / "resaved")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "resaved" / name).read_bytes() == (out / name).read_bytes()
    with torch.no_grad():
        torch.testing.assert_close(MedusaModel.from_pretrained(tmp_path / "resaved").base(ids).logits, merged)


def test_medusa1_output_replaces_a_stale_adapter(tmp_path, tiny_base, tiny_data):
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=2)
    out = Path(raw["training"]["output_dir"])
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")
    run(raw)
    assert not (out / "adapter_config.json").exists()
    MedusaModel.from_pretrained(out)


# --------------------------------------------------------------------------- errors
def test_error_empty_dataset(tmp_path, tiny_base):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no data shards.*generate_data"):
        run(sections(tmp_path, tiny_base, empty))
    from datasets import Dataset

    Dataset.from_dict({"input_ids": [], "response_start": [], "source": [], "greedy": []}).save_to_disk(
        str(empty / "shard-00000")
    )  # a shard with no rows
    with pytest.raises(ValueError, match="is empty .*run train/generate_data.py"):
        run(sections(tmp_path, tiny_base, empty))
    Dataset.from_list([{"input_ids": [1, 2, 3], "response_start": 3, "source": "x", "greedy": True}]).save_to_disk(
        str(empty / "shard-00001")
    )  # a prompt whose response is empty
    with pytest.raises(ValueError, match="none has a response token"):
        run(sections(tmp_path, tiny_base, empty))


def test_error_too_few_conversations_for_eval(tmp_path, tiny_base, tiny_data):
    with pytest.raises(ValueError, match="eval_conversations=48 leaves none"):
        run(sections(tmp_path, tiny_base, tiny_data, eval_conversations=48))


def test_error_unknown_config_key(tmp_path, tiny_base, tiny_data):
    raw = sections(tmp_path, tiny_base, tiny_data)
    raw["training"]["learning_rate"] = 1e-3
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\] in section 'training'"):
        build(raw)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_head'\] in section 'heads'"):
        train_mod.main(["--config", str(REPO / "configs" / "smollm2-135m.yaml"), "--heads.num_head", "3"])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"heads": {"projection": "tied"}}, "heads.projection must be one of"),
        ({"heads": {"num_layers": 0}}, "nothing to train"),
        ({"training": {"batch_unit": "rows"}}, "training.batch_unit"),
        ({"training": {"medusa2": True}}, "precompute_hidden false for Medusa-2"),
        ({"training": {"lr": "fast"}}, "training.lr must be a number"),
        ({"training": {"report_to": "tensorboard"}}, "training.report_to"),
        ({"training": {"shard": "fsdp"}}, "precompute_hidden runs the whole base in every process"),
        ({"training": {"shard": "zero3"}}, "training.shard must be one of"),
        ({"heads": {"condition_on_next_token": "yes"}}, "heads.condition_on_next_token must be true or false"),
        ({"heads": {"condition_on_path": True}}, "condition_on_path needs heads.condition_on_next_token"),
        ({"heads": {"feature_layers": [1]}}, "feature_layers needs heads.context_window"),
    ],
)
def test_error_invalid_values(tmp_path, tiny_base, tiny_data, bad, message):
    raw = sections(tmp_path, tiny_base, tiny_data)
    for section, values in bad.items():
        raw[section].update(values)
    with pytest.raises(ValueError, match=message):
        build(raw)


def test_yaml_reads_exponent_learning_rates(tmp_path, tiny_base, tiny_data):
    raw = sections(tmp_path, tiny_base, tiny_data)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw).replace("lr: 0.01", "lr: 1e-3"))  # YAML 1.1 reads 1e-3 as a string
    assert load_config(str(path)).training.lr == 1e-3


def test_error_heads_that_do_not_match_the_base(tmp_path, tiny_base, tiny_data):
    from medusa.heads_io import save_heads
    from tests.conftest import make_heads

    other = tmp_path / "other-heads"
    other.mkdir()
    save_heads(make_heads(num_heads=3, hidden=32), other)  # made for a base with hidden size 32
    with pytest.raises(ValueError, match="hidden_size 32 but the base .* has 64"):
        run(sections(tmp_path, tiny_base, tiny_data, heads={"init_from": str(other)}))

    save_heads(make_heads(num_heads=2), other)
    with pytest.raises(ValueError, match="num_heads=2 but the heads section asks for 3"):
        run(sections(tmp_path, tiny_base, tiny_data, heads={"init_from": str(other)}))

    save_heads(
        MedusaHeads(
            MedusaConfig(
                hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=3, condition_on_next_token=True, context_window=4
            )
        ),
        other,
    )  # context heads without feature layers
    with pytest.raises(ValueError, match=r"feature_layers=\[\] but the heads section asks for \[0, 1\]"):
        run(
            sections(
                tmp_path,
                tiny_base,
                tiny_data,
                heads={
                    "init_from": str(other),
                    "condition_on_next_token": True,
                    "context_window": 4,
                    "feature_layers": [0, 1],
                },
            )
        )


def test_error_data_from_another_tokenizer(tmp_path, tiny_base):
    from datasets import Dataset

    data = tmp_path / "big-vocab"
    Dataset.from_list(
        [{"input_ids": [1, 2, 500, 7], "response_start": 2, "source": "x", "greedy": True}] * 12
    ).save_to_disk(str(data / "shard-00000"))
    with pytest.raises(ValueError, match="token id 500 but the base vocabulary has 96"):
        run(sections(tmp_path, tiny_base, data))


def test_init_from_continues_from_saved_heads(tmp_path, tiny_base, tiny_data):
    (tmp_path / "a").mkdir()
    first = run(sections(tmp_path / "a", tiny_base, tiny_data, max_steps=20))
    (tmp_path / "b").mkdir()
    second = run(
        sections(tmp_path / "b", tiny_base, tiny_data, max_steps=1, lr=1e-6, heads={"init_from": str(first.output_dir)})
    )
    before, after = first.eval_history[-1], second.eval_history[0]  # at steps 20 and 0: the same heads
    assert {k: v for k, v in after.items() if k != "step"} == pytest.approx(
        {k: v for k, v in before.items() if k != "step"}, abs=1e-5
    )


# --------------------------------------------------------------------------- processes
@pytest.mark.parametrize("kind", ["DEEPSPEED", "MEGATRON_LM"])
def test_deepspeed_launches_are_refused_with_the_reason(kind):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    with pytest.raises(NotImplementedError, match="Shard with FSDP instead"):
        train_mod.check_distributed_type(SimpleNamespace(distributed_type=DistributedType[kind]))
    for accepted in ("MULTI_CPU", "FSDP"):
        train_mod.check_distributed_type(SimpleNamespace(distributed_type=DistributedType[accepted]))


def test_sharding_refuses_what_it_cannot_shard(tmp_path, tiny_base, tiny_data, monkeypatch):
    """An int8 (torchao) base is refused by name, for heads and for the EAGLE-3 draft, also when `--use_fsdp` asked
    for sharding; so are heads whose hidden states the whole base would precompute in every process."""
    raw = sections(tmp_path, tiny_base, tiny_data, precompute_hidden=False, shard="fsdp")
    raw["model"]["quantize"] = "int8"
    with pytest.raises(NotImplementedError, match="cannot shard the int8"):
        run(raw)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    raw = sections(tmp_path, tiny_base, tiny_data)
    raw["model"]["quantize"] = "int8"
    raw["eagle3"] = {"enabled": True}
    with pytest.raises(NotImplementedError, match="cannot shard the int8"):
        run(raw)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # (train.py turned it off for accelerate on a CPU)
    with pytest.raises(ValueError, match="precompute_hidden runs the whole base in every process"):
        run(sections(tmp_path, tiny_base, tiny_data, precompute_hidden=True))


def _launch_two(tmp_path: Path, config: Path, how: str, *args: str, kill_when: Path | None = None) -> str:
    """train/train.py in 2 CPU processes (gloo) -> its stdout. how: torchrun, or accelerate (`--use_fsdp`).
    kill_when: SIGKILL every process once that file exists (the run must still be going)."""
    with socket.socket() as sock:  # a free port: a stale run elsewhere must not capture the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    bin_dir = Path(sys.executable).parent
    launcher = {
        "torchrun": [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--master_port", port],
        "accelerate": [str(bin_dir / "accelerate"), "launch", "--use_fsdp", "--num_processes", "2"]
        + ["--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no"],
    }[how]
    proc = subprocess.Popen(
        [*launcher, str(REPO / "train" / "train.py"), "--config", str(config), *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def kill() -> None:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun share this new session
        _kill_processes_reading(config)  # torchrun starts each worker in a session of its own; they hold our pipes

    if kill_when is not None:
        deadline = time.time() + 90
        while not kill_when.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        running = proc.poll() is None
        kill()
        stdout, stderr = proc.communicate()
        assert running and kill_when.exists(), f"the run ended before it was killed:\n{stderr[-3000:]}"
        return stdout
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{how} hung:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def _step_losses(log: str) -> list[float]:
    return [float(line.split(" loss ")[1].split()[0]) for line in log.splitlines() if line.startswith("step ")]


def _assert_same_weights(a_dir: Path, b_dir: Path, names: tuple[str, ...], atol: float) -> None:
    for file in names:
        a, b = load_file(str(a_dir / file)), load_file(str(b_dir / file))
        assert set(a) == set(b) and a, file
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=f"{file}: {name}")


MEDUSA2 = dict(medusa2=True, lora_r=4, lora_alpha=8, lora_lr=1e-2, lora_dropout=0.0, kl_weight=1.0)


@pytest.mark.parametrize("method", ["medusa1", "medusa2"])
def test_fsdp_over_two_processes_matches_one_process(tmp_path, tiny_base, tiny_data, capsys, method):
    """FSDP2 over 2 CPU processes (gloo), the base sharded, x 2 micro-batches of 1 conversation each: the same
    per-step losses (within 1e-4, as logged to 4 decimals) and final weights (within 5e-5) as 1 process x 4
    conversations; the output has a single-process run's files. Medusa-1 is sharded by `accelerate launch
    --use_fsdp`, Medusa-2 by training.shard fsdp under torchrun. 9 held-out conversations, one per batch: one
    process evaluates 5, the other 4 plus one uncounted (lockstep), and the held-out scores equal 1 process's."""
    options = dict(
        eval_conversations=9,
        max_steps=6,
        eval_every=3,
        log_every=1,
        precompute_hidden=False,
        **(MEDUSA2 if method == "medusa2" else {}),
    )
    (tmp_path / "fsdp").mkdir(), (tmp_path / "single").mkdir()
    raw = sections(tmp_path / "fsdp", tiny_base, tiny_data, batch_size=1, grad_accum=2, save_every=3, **options)
    if method == "medusa2":
        raw["training"]["shard"] = "fsdp"
    config = tmp_path / "fsdp" / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    log = _launch_two(tmp_path, config, "torchrun" if method == "medusa2" else "accelerate")
    assert "2 process(es)" in log
    held = next(line for line in log.splitlines() if line.startswith("FSDP2: this process holds"))
    local, total = (int(n.replace(",", "")) for n in held.split("holds ")[1].split(" weights")[0].split(" of "))
    assert local <= total // 2 + 1000, held  # the base's layers and the root are split between the 2 processes

    capsys.readouterr()
    single = run(sections(tmp_path / "single", tiny_base, tiny_data, batch_size=4, **options))
    reference = capsys.readouterr().out
    losses, expected = _step_losses(log), _step_losses(reference)
    assert len(losses) == len(expected) == 6 and losses[0] > losses[-1] + 0.5, (losses, expected)
    assert losses == pytest.approx(expected, abs=1e-4)
    out = Path(raw["training"]["output_dir"])
    files = (WEIGHTS_NAME, "adapter_model.safetensors") if method == "medusa2" else (WEIGHTS_NAME,)
    # measured 1.2e-5, exactly what DDP gives for this split: the accumulated sum in another order, which AdamW
    # magnifies where a gradient is near 0
    _assert_same_weights(out, single.output_dir, files, atol=5e-5)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in single.output_dir.iterdir())
    loaded = MedusaModel.from_pretrained(out)
    assert loaded.config.extra["training"]["processes"] == 2
    reference_eval = MedusaConfig.load(single.output_dir).extra["eval"]
    assert set(loaded.config.extra["eval"]) == set(reference_eval) and reference_eval["head0"]["top1"] > 0
    for head, scores in reference_eval.items():  # (base_kl: a number, the heads: their scores)
        assert loaded.config.extra["eval"][head] == pytest.approx(scores, abs=2e-4), head
    checkpoint = tmp_path / "fsdp" / "ckpt" / "checkpoints" / "checkpoint_0"
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:  # whole tensors, trainable only
        assert {k: f.get_slice(k).get_shape() for k in f.keys() if k.startswith("heads.")} == {
            f"heads.{k}": list(v.shape) for k, v in load_file(str(out / WEIGHTS_NAME)).items()
        }


def assert_killed_then_resumed_equals_uninterrupted(tmp_path: Path, make_raw, files: tuple[str, ...]) -> None:
    """`make_raw(directory)` -> a config run in 2 processes (torchrun) twice: uninterrupted, and SIGKILLed after its
    first checkpoint then resumed with --resume. Both end with the same weights in `files` (within 1e-6)."""
    outputs = []
    for name in ("whole", "split"):
        (tmp_path / name).mkdir(exist_ok=True)
        raw = make_raw(tmp_path / name)
        config = tmp_path / name / "config.yaml"
        config.write_text(yaml.safe_dump(raw))
        if name == "split":
            first = tmp_path / name / "ckpt" / "checkpoints" / "checkpoint_0" / "trainer_state.json"
            _launch_two(tmp_path / name, config, "torchrun", kill_when=first)
            assert not Path(raw["training"]["output_dir"]).exists()
            assert "resumed from" in _launch_two(tmp_path / name, config, "torchrun", "--resume")
        else:
            _launch_two(tmp_path / name, config, "torchrun")
        outputs.append(Path(raw["training"]["output_dir"]))
    _assert_same_weights(*outputs, files, atol=1e-6)


@pytest.mark.slow
def test_fsdp_sigkill_then_resume_equals_uninterrupted(tmp_path, tiny_base, tiny_data):
    """A Medusa-2 run sharded over 2 processes, SIGKILLed after its first checkpoint, resumed with --resume in 2
    processes: the same heads and adapter as the uninterrupted sharded run."""
    options = dict(max_steps=40, save_every=4, batch_size=2, precompute_hidden=False, shard="fsdp", **MEDUSA2)
    assert_killed_then_resumed_equals_uninterrupted(
        tmp_path,
        lambda directory: sections(directory, tiny_base, tiny_data, **options),
        (WEIGHTS_NAME, "adapter_model.safetensors"),
    )


def _kill_processes_reading(path: Path) -> None:
    """SIGKILL every process whose command line names `path` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to read
            continue


@pytest.mark.slow
def test_accelerate_launch_two_processes(tmp_path, tiny_base, tiny_data):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU host (DDP over gloo) trains and writes complete heads
    once. (`--cpu --num_processes 2` starts one process in accelerate 1.x: huggingface/accelerate#2741.)"""
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=6, save_every=3, eval_every=3, batch_size=2)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with socket.socket() as sock:  # a free port: a stale run elsewhere must not capture the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.time()
    proc = subprocess.Popen(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--main_process_port",
            str(port),
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(REPO / "train" / "train.py"),
            "--config",
            str(config),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun share this new session
        _kill_processes_reading(config)  # torchrun starts each worker in a session of its own; they hold our pipes
        stdout, stderr = proc.communicate()
        pytest.fail(f"accelerate launch hung:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "2 process(es)" in stdout
    out = Path(raw["training"]["output_dir"])
    loaded = MedusaModel.from_pretrained(out)
    assert loaded.config.extra["training"]["processes"] == 2 and loaded.config.extra["training"]["steps"] == 6
    state = load_file(str(out / WEIGHTS_NAME))
    assert set(state) == {f"blocks.{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")}
    assert any(t.abs().max() > 0 for t in state.values())
    assert (tmp_path / "ckpt" / "checkpoints" / "checkpoint_0" / "random_states_1.pkl").is_file()  # each process's
    assert not list(out.parent.glob(".*tmp*")) and not list((tmp_path / "cache").glob(".*part*"))
    assert time.time() - start < 60
    # Gradients are averaged across processes: 2 processes x 2 conversations == 1 process x 4 conversations.
    (tmp_path / "single").mkdir()
    single = run(sections(tmp_path / "single", tiny_base, tiny_data, max_steps=6, batch_size=4))
    reference = load_file(str(single.output_dir / WEIGHTS_NAME))
    for name in state:
        torch.testing.assert_close(state[name], reference[name], atol=1e-6, rtol=0, msg=name)


def test_frequent_tokens_orders_by_count_then_id():
    from medusa.train.data import frequent_tokens

    assert frequent_tokens([[5, 5, 3, 9], [3, 5]], 4, 10).tolist() == [5, 3, 9, 0]
    with pytest.raises(ValueError, match="vocab subset size"):
        frequent_tokens([[1]], 11, 10)


def test_vocab_subset_is_taken_from_training_responses(tmp_path, tiny_base, tiny_data):
    result = run(sections(tmp_path, tiny_base, tiny_data, heads={"vocab_subset_size": 8}, max_steps=2, eval_every=0))
    loaded = MedusaModel.from_pretrained(result.output_dir)
    subset = set(loaded.heads.vocab_subset.tolist())
    assert loaded.config.vocab_subset_size == 8 and set(CYCLE) <= subset  # the cycle's tokens are the frequent ones


@pytest.mark.parametrize("path", [False, True], ids=["root", "path"])
def test_next_token_heads_learn_over_the_candidate_vocabulary(tmp_path, tiny_base, tiny_data, path):
    """heads.condition_on_next_token (and _on_path) with a vocabulary subset (the loss runs over the candidates)."""
    raw = sections(
        tmp_path,
        tiny_base,
        tiny_data,
        heads={"condition_on_next_token": True, "vocab_subset_size": 12, "condition_on_path": path},
        max_steps=30,
        eval_every=30,
    )
    result = run(raw)
    first, last = result.eval_history[0], result.eval_history[-1]
    for k in range(3):
        assert top1(last, k) > 0.9 and top1(last, k) > top1(first, k) + 0.5, (k, first, last)
    loaded = MedusaModel.from_pretrained(result.output_dir)
    assert loaded.config.condition_on_next_token and loaded.config.vocab_subset_size == 12
    assert loaded.config.condition_on_path == path
    assert loaded.heads.next_token_maps[0].weight.abs().max() > 0  # the maps were trained, and saved
    if path:
        assert loaded.heads.path_token_maps[2][1].weight.abs().max() > 0
    ids = torch.tensor([[5, 9] + CYCLE * 2])  # the heads read position t and the tokens after it
    with torch.no_grad():
        hidden = loaded.base(ids, output_hidden_states=True).hidden_states[-1]
        embedded = loaded.base.get_input_embeddings()(following_tokens(ids, 3))  # (1, T, 3, H)
        guesses = loaded.heads(
            hidden[:, :-3], loaded.base.get_output_embeddings(), embedded[:, :-3, 0], embedded[:, :-3, 1:]
        ).argmax(-1)
    t = 2 + 3  # reads CYCLE[3]; head k predicts CYCLE[3 + k + 2]
    assert [int(guesses[k, 0, t]) for k in range(3)] == [CYCLE[(3 + k + 2) % len(CYCLE)] for k in range(3)]
    prompt = torch.tensor([[5, 9] + CYCLE])
    expected = loaded.base.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=20, tree=[[0], [0, 0], [0, 0, 0]]), expected)


@pytest.mark.parametrize(
    "layers, precompute", [([], True), ([0, 1], True), ([0, 1], False)], ids=["last", "fused-cached", "fused-live"]
)
def test_context_heads_learn_and_decode_exactly(tmp_path, tiny_base, tiny_data, layers, precompute):
    """heads.context_window: the context layer trains with the heads (cached spans reach back a whole window), is
    saved, and decoding feeds it step by step; with heads.feature_layers it also learns to read those layers."""
    heads = {
        "condition_on_next_token": True,
        "condition_on_path": True,
        "vocab_subset_size": 12,
        "context_window": 4,
        "feature_layers": layers,
    }
    result = run(
        sections(tmp_path, tiny_base, tiny_data, heads=heads, max_steps=30, eval_every=30, precompute_hidden=precompute)
    )
    first, last = result.eval_history[0], result.eval_history[-1]
    for k in range(3):
        assert top1(last, k) > 0.9 and top1(last, k) > top1(first, k) + 0.5, (k, first, last)
    loaded = MedusaModel.from_pretrained(result.output_dir)
    assert loaded.config.context_window == 4 and loaded.heads.context.attention_out.weight.abs().max() > 0
    assert loaded.config.feature_layers == layers
    if layers:
        assert loaded.heads.context.feature_map.weight.abs().max() > 0
    prompt = torch.tensor([[5, 9] + CYCLE])
    expected = loaded.base.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=20, tree=[[0], [0, 0], [0, 0, 0]]), expected)


def test_distilled_heads_learn_the_base_distribution(tmp_path, tiny_base, tiny_data):
    """training.distill: the heads move towards the base's own distributions (the random tiny base does not follow
    the data's cycle, so its KL, not the data's tokens, is what must fall)."""
    from medusa.train.losses import medusa_heads_loss

    heads = {"condition_on_next_token": True, "context_window": 4}
    result = run(sections(tmp_path, tiny_base, tiny_data, heads=heads, max_steps=30, eval_every=0, distill=True))
    trained = MedusaModel.from_pretrained(result.output_dir)
    fresh = build_heads(
        build(sections(tmp_path, tiny_base, tiny_data, heads=heads)).heads,
        HIDDEN,
        VOCAB,
        trained.base.get_output_embeddings(),
        None,
    )
    ids = torch.tensor([[5, 9, 30, 2] + CYCLE * 2])
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    with torch.no_grad():
        hidden = trained.base(ids, output_hidden_states=True).hidden_states[-1]
        kl = [
            medusa_heads_loss(
                h,
                hidden,
                ids,
                mask,
                trained.base.get_output_embeddings(),
                distill=True,
                embed_tokens=trained.base.get_input_embeddings(),
            ).ce
            for h in (fresh, trained.heads)
        ]
    assert (kl[1] < 0.5 * kl[0]).all(), kl


def write_prompt_only_shards(directory: Path, n: int = 24, seed: int = 3) -> Path:
    """What generate_data writes with data.answer false: prompts alone, response_start at their end."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(12, 30))]
        rows.append({"input_ids": ids, "response_start": len(ids), "source": "synthetic", "greedy": True})
    Dataset.from_list(rows).save_to_disk(str(directory / "shard-00000"))
    (directory / "data_config.json").write_text('{"answer": false}')  # as generate_data records it
    return directory


def test_prompt_tokens_train_on_whole_conversations_and_prompt_only_data(tmp_path, tiny_base, tiny_data):
    """training.prompt_tokens: every position of the training conversations (prompt-only rows included) is scored
    against the base's distribution, the cache holds whole conversations (cached = live), held-out conversations are
    answered ones, and the heads move towards the base on prompt text that plain training never scores."""
    from medusa.train.losses import medusa_heads_loss

    prompts = write_prompt_only_shards(tmp_path / "prompts")
    heads = {"condition_on_next_token": True, "context_window": 4}
    with pytest.raises(ValueError, match="prompts without responses"):  # plain training cannot use prompt-only data
        raw = sections(tmp_path, tiny_base, tiny_data, heads=heads, distill=True)
        raw["data"]["extra_dirs"] = [str(prompts)]
        run(raw)
    with pytest.raises(ValueError, match="prompt_tokens needs training.distill"):
        build(sections(tmp_path, tiny_base, tiny_data, heads=heads, prompt_tokens=True))
    results = {}
    for precompute in (True, False):
        raw = sections(
            tmp_path / str(precompute),
            tiny_base,
            tiny_data,
            heads=heads,
            distill=True,
            prompt_tokens=True,
            max_steps=12,
            eval_every=6,
            precompute_hidden=precompute,
        )
        raw["data"]["extra_dirs"] = [str(prompts)]
        (tmp_path / str(precompute)).mkdir()
        results[precompute] = run(raw)
    for a, b in zip(results[True].eval_history, results[False].eval_history):
        for key in a:
            assert a[key] == pytest.approx(b[key], abs=2e-2), key  # the cache stores bf16 hidden states
    convs = load_conversations(tiny_data, 1024, VOCAB) + load_conversations(prompts, 1024, VOCAB, prompt_only=True)
    train_idx, eval_idx = split_eval(convs, 8)
    assert len(eval_idx) == 8 and all(convs[i].response_tokens for i in eval_idx) and len(train_idx) == 40 + 24
    extra = MedusaModel.from_pretrained(results[True].output_dir).config.extra["training"]
    assert extra["train_scored_tokens"] == sum(len(convs[i].ids) for i in train_idx)
    assert extra["train_response_tokens"] == sum(convs[i].response_tokens for i in train_idx)

    # the same steps without prompt positions: the heads stay further from the base on prompt text
    raw = sections(tmp_path / "plain", tiny_base, tiny_data, heads=heads, distill=True, max_steps=12)
    (tmp_path / "plain").mkdir()
    plain = MedusaModel.from_pretrained(run(raw).output_dir)
    trained = MedusaModel.from_pretrained(results[True].output_dir)
    ids = torch.tensor([convs[-1].ids])  # a prompt-only row
    with torch.no_grad():
        hidden = trained.base(ids, output_hidden_states=True).hidden_states[-1]
        kl = [
            medusa_heads_loss(
                m.heads,
                hidden,
                ids,
                torch.ones_like(ids),
                m.base.get_output_embeddings(),
                distill=True,
                embed_tokens=m.base.get_input_embeddings(),
            ).ce
            for m in (plain, trained)
        ]
    assert (kl[1] < kl[0]).all(), kl


def test_distill_needs_the_shared_projection(tmp_path, tiny_base, tiny_data):
    with pytest.raises(ValueError, match="training.distill"):
        run(sections(tmp_path, tiny_base, tiny_data, heads={"projection": "own"}, distill=True))


@pytest.mark.parametrize("name", ["smollm2-135m.yaml", "smollm2-135m-medusa2.yaml", "smollm2-135m-cpu.yaml"])
def test_shipped_configs_parse_and_agree_with_the_shipped_heads(name):
    """The configs that reproduce / continue the shipped heads describe the heads that are shipped; the CPU recipe
    (the heads shipped before) differs only in not reading feature layers and not copying."""
    cfg = load_config(str(REPO / "configs" / name))
    shipped = MedusaConfig.load(REPO / "medusa" / "default_heads" / "smollm2-135m-instruct")
    heads = cfg.heads
    for field in (
        "num_heads",
        "num_layers",
        "projection",
        "condition_on_next_token",
        "condition_on_path",
        "context_window",
    ):
        assert getattr(heads, field) == getattr(shipped, field), field
    assert list(heads.feature_layers) == ([] if name == "smollm2-135m-cpu.yaml" else shipped.feature_layers)
    assert heads.copy_ngram == (0 if name == "smollm2-135m-cpu.yaml" else shipped.copy_ngram)
    if heads.vocab_subset_size is not None:
        assert heads.vocab_subset_size == shipped.vocab_subset_size
    if name == "smollm2-135m.yaml":  # the heads were trained on exactly the data directories this config reads
        assert shipped.extra["training"]["data_dirs"] == [cfg.data.out_dir, *cfg.data.extra_dirs]


def test_copy_ngram_goes_from_the_heads_section_to_the_saved_heads(tmp_path, tiny_base, tiny_data):
    """heads.copy_ngram is not trained: it is written to the heads' config (fresh heads and init_from alike), and
    a value the heads config refuses is named when the heads are built."""
    cfg = build(sections(tmp_path, tiny_base, tiny_data, heads={"copy_ngram": 3})).heads
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    fresh = build_heads(cfg, HIDDEN, VOCAB, lm_head, None)
    assert fresh.config.copy_ngram == 3
    from medusa.heads_io import save_heads

    (tmp_path / "start").mkdir()
    save_heads(fresh, tmp_path / "start")
    continued = build(
        sections(tmp_path, tiny_base, tiny_data, heads={"copy_ngram": 0, "init_from": str(tmp_path / "start")})
    ).heads
    assert build_heads(continued, HIDDEN, VOCAB, lm_head, None).config.copy_ngram == 0
    with pytest.raises(ValueError, match="copy_ngram"):
        build_heads(
            build(sections(tmp_path, tiny_base, tiny_data, heads={"copy_ngram": 1})).heads, HIDDEN, VOCAB, lm_head, None
        )


def test_heads_record_the_commit_of_a_hub_base(tmp_path, tiny_base, tiny_data, monkeypatch):
    """A base given by Hub id: the heads config records the commit it was loaded at (MedusaConfig.revision, read from
    the cache the load updated), and the card names the base by that id."""
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    refs = tmp_path / "hub" / "models--someone--tiny-base" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(commit)  # what loading someone/tiny-base from the Hub leaves in the cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    load_base = trainer_mod.load_base
    monkeypatch.setattr(trainer_mod, "load_base", lambda source, **options: load_base(tiny_base, **options))
    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=2)
    raw["model"]["base"] = "someone/tiny-base"
    out = run(raw).output_dir
    config = MedusaConfig.load(out)
    assert (config.base_model_name_or_path, config.revision) == ("someone/tiny-base", commit)
    card = (out / "README.md").read_text()
    assert yaml.safe_load(card.split("---")[1])["base_model"] == "someone/tiny-base" and commit in card


def test_error_unwritable_output_is_found_before_any_step(tmp_path, tiny_base, tiny_data, monkeypatch):
    """A file where a directory should be (here the checkpoints'): refused at the start. An unwritable output used
    to fail after every step, with no checkpoint kept when save_every is 0."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    steps = []
    monkeypatch.setattr(
        trainer_mod,
        "load_base",
        lambda *a, **k: (
            steps.append("loaded")
            or (_ for _ in ()).throw(AssertionError("the base was loaded before the output was checked"))
        ),
    )
    with pytest.raises(PermissionError, match="cannot write to .*blocker"):
        run(sections(tmp_path, tiny_base, tiny_data, checkpoint_dir=str(blocker / "ckpt")))
    assert steps == []


def test_medusa_train_command_trains_as_the_script_does(tmp_path, tiny_base, tiny_data):
    """`medusa train --config` (the installed command: no checkout needed) is medusa.train.train's main."""
    from medusa.cli import main

    raw = sections(tmp_path, tiny_base, tiny_data, max_steps=4)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    reset_accelerate()
    main(["train", "--config", str(config)])
    loaded = MedusaModel.from_pretrained(tmp_path / "heads", base=str(tiny_base))
    assert loaded.config.num_heads == 3 and (tmp_path / "heads" / WEIGHTS_NAME).is_file()


def test_training_without_its_extra_names_the_extra(monkeypatch, capsys):
    import importlib.util

    from medusa.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    for command in ("train", "generate-data"):
        with pytest.raises(SystemExit, match=r"needs peft: pip install 'medusa-spec\[train\]'"):
            main([command, "--config", "unused.yaml"])


def test_a_loaded_hidden_cache_is_read_per_batch_not_held_whole(tmp_path):
    """The precomputed hidden states stay in their file (memory-mapped): loading a 192 MB cache and reading a batch
    from it adds a few MB to this process's resident memory, not the file's size, and the batch is the saved rows."""

    if not Path("/proc/self/status").is_file():
        pytest.skip("reads resident memory from /proc")
    rows, width = 100_000, 1024
    hidden = torch.randn(rows, width).to(torch.bfloat16)
    offsets = torch.arange(0, rows + 1, 1000)
    cache = HiddenCache(
        hidden, torch.zeros(rows, dtype=torch.long), offsets, torch.zeros(len(offsets) - 1, dtype=torch.long)
    )
    cache.save(tmp_path / "hidden.safetensors", "k")
    expected = cache.batch([7, 42])["hidden"]
    del cache, hidden
    before = status_mb("VmRSS")
    loaded = HiddenCache.load(tmp_path / "hidden.safetensors", "k")
    batch = loaded.batch([7, 42])["hidden"]
    assert status_mb("VmRSS") - before < 32  # the whole file is 195 MB
    assert torch.equal(batch, expected)
