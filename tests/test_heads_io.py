"""Heads on disk in other layouts (official Medusa / vLLM): exact file contents, round trips, named errors for broken
directories; one loader for every layout (medusa.heads_io). The native layout is tested in test_model_io.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa import MedusaModel
from medusa.cli import main
from medusa.config import MedusaConfig
from medusa.heads_io import (
    EXPORTABLE_FLAGS,
    FORMATS,
    OFFICIAL_PICKLE,
    OFFICIAL_WEIGHTS,
    VLLM_WEIGHTS,
    check_exportable,
    export_directory,
    export_heads,
    export_model,
    foreign_layout,
    import_heads,
    load_heads,
    resolve_heads,
    save_heads,
)
from medusa.model import DEFAULT_HEADS_DIR
from tests.conftest import HIDDEN, VOCAB, make_heads, make_tiny_model, save_tiny_checkpoint, tiny_tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"

K, L = 3, 2
_TOKENIZER = object()  # tiny models have no tokenizer; from_pretrained only stores it


def medusa_model(projection: str) -> MedusaModel:
    base = make_tiny_model("llama")
    heads = make_heads(num_heads=K, num_layers=L, random=True, projection=projection, seed=3)
    heads.config.base_model_name_or_path = "org/tiny-llama"
    return MedusaModel(base, heads, tokenizer=_TOKENIZER)


def head_logits(model: MedusaModel) -> torch.Tensor:
    """(K, 1, T, V) head logits on a fixed token sequence."""
    ids = torch.arange(1, 17)[None] % VOCAB
    with torch.no_grad():
        hidden = model.base(ids, output_hidden_states=True).hidden_states[-1]
        return model.heads(hidden, model.base.get_output_embeddings())


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_official_export_layout_and_import_round_trip(tmp_path, projection):
    model = medusa_model(projection)
    out = export_model(model, tmp_path / "official", "medusa")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_num_heads"] == K and cfg["medusa_num_layers"] == L
    assert cfg["base_model_name_or_path"] == "org/tiny-llama"
    state = load_file(str(out / OFFICIAL_WEIGHTS))
    pickled = torch.load(out / OFFICIAL_PICKLE, weights_only=True)  # our own file: plain tensors, the same ones
    assert pickled.keys() == state.keys() and all(torch.equal(pickled[k], state[k]) for k in state)
    expected = {f"{h}.{i}.linear.{p}" for h in range(K) for i in range(L) for p in ("weight", "bias")}
    expected |= {f"{h}.{L}.weight" for h in range(K)}
    assert set(state) == expected
    assert state[f"1.{L}.weight"].shape == (VOCAB, HIDDEN)
    torch.testing.assert_close(state["2.1.linear.weight"], model.heads.blocks[2][1].linear.weight, rtol=0, atol=0)
    if projection == "shared":  # every head carries a copy of the base lm_head
        lm_head = model.base.get_output_embeddings().weight
        for h in range(K):
            torch.testing.assert_close(state[f"{h}.{L}.weight"], lm_head, rtol=0, atol=0)

    assert foreign_layout(out) == "medusa"
    loaded = MedusaModel.from_pretrained(out, base=make_tiny_model("llama"), tokenizer=_TOKENIZER)
    assert loaded.config.projection == "own" and loaded.config.num_heads == K and loaded.config.num_layers == L
    assert loaded.config.base_model_name_or_path == "org/tiny-llama"
    torch.testing.assert_close(head_logits(loaded), head_logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_vllm_export_layout_and_load_back(tmp_path, projection):
    model = medusa_model(projection)
    out = export_model(model, tmp_path / "vllm", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["truncated_vocab_size"]) == (HIDDEN, VOCAB, VOCAB)
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (K, L, True)
    assert cfg["original_lm_head"] == (projection == "shared")
    state = load_file(str(out / VLLM_WEIGHTS))
    expected = {f"blocks.{h}.layers.{i}.{p}" for h in range(K) for i in range(L) for p in ("weight", "bias")}
    expected |= {f"lm_heads.{h}.weight" for h in range(K)}
    assert set(state) == expected
    torch.testing.assert_close(state["blocks.1.layers.0.bias"], model.heads.blocks[1][0].linear.bias, rtol=0, atol=0)

    heads = import_heads(out)
    lm_head = model.base.get_output_embeddings().weight
    for h in range(K):
        want = lm_head if projection == "shared" else model.heads.projections[h].weight
        torch.testing.assert_close(heads.projections[h].weight, want, rtol=0, atol=0)
        for i in range(L):
            for p in ("weight", "bias"):
                got, ref = getattr(heads.blocks[h][i].linear, p), getattr(model.heads.blocks[h][i].linear, p)
                torch.testing.assert_close(got, ref, rtol=0, atol=0)
    loaded = MedusaModel.from_pretrained(out, base=make_tiny_model("llama"), tokenizer=_TOKENIZER)
    torch.testing.assert_close(head_logits(loaded), head_logits(model), rtol=0, atol=0)


def test_vllm_import_without_bias_and_with_one_shared_lm_head(tmp_path):
    """vLLM's own variants: medusa_fc_bias false (no bias tensors) and original_lm_head (only lm_heads.0)."""
    torch.manual_seed(0)
    w = {f"blocks.{h}.layers.0.weight": torch.randn(HIDDEN, HIDDEN) for h in range(2)}
    w["lm_heads.0.weight"] = torch.randn(VOCAB, HIDDEN)
    save_file(w, str(tmp_path / VLLM_WEIGHTS))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "medusa",
                "hidden_size": HIDDEN,
                "vocab_size": VOCAB,
                "num_heads": 2,
                "num_hidden_layers": 1,
                "medusa_fc_bias": False,
                "original_lm_head": True,
            }
        )
    )
    heads = import_heads(tmp_path)
    assert torch.equal(heads.blocks[1][0].linear.bias, torch.zeros(HIDDEN))
    assert torch.equal(heads.projections[1].weight, w["lm_heads.0.weight"])
    assert heads.projections[0].weight.data_ptr() != heads.projections[1].weight.data_ptr()  # not tied


def test_export_directory_from_native_loads_base_for_shared_projection(tmp_path, monkeypatch):
    model = medusa_model("shared")
    base_dir = tmp_path / "base"
    model.base.save_pretrained(base_dir)
    model.save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="share the base model's lm_head"):
        export_heads(load_heads(tmp_path / "native"), tmp_path / "nope", "medusa")
    import medusa.loading

    # the tiny base has no tokenizer files, and copying lm_head needs no tokenizer
    monkeypatch.setattr(medusa.loading.AutoTokenizer, "from_pretrained", lambda *a, **k: _TOKENIZER)
    out = export_directory(
        tmp_path / "native",
        tmp_path / "official",
        "medusa",
        base=str(base_dir),
        base_model_name_or_path="org/tiny-llama",
        dtype=torch.float16,
    )
    state = load_file(str(out / OFFICIAL_WEIGHTS))
    assert all(t.dtype == torch.float16 for t in state.values())
    assert torch.equal(state[f"0.{L}.weight"], model.base.get_output_embeddings().weight.half())
    # official -> vLLM conversion reads the official directory, needs no base
    vllm = export_directory(out, tmp_path / "vllm", "vllm")
    assert torch.equal(load_file(str(vllm / VLLM_WEIGHTS))["lm_heads.2.weight"], state[f"2.{L}.weight"])


def test_export_is_atomic_and_refuses_non_empty_directory(tmp_path, monkeypatch):
    model = medusa_model("own")
    out = export_model(model, tmp_path / "x", "medusa")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_model(model, out, "vllm")
    export_model(model, out, "vllm", overwrite=True)  # the other layout's weights must not linger
    assert not (out / OFFICIAL_WEIGHTS).exists() and foreign_layout(out) == "vllm"
    mask = os.umask(0)
    os.umask(mask)
    assert (out / VLLM_WEIGHTS).stat().st_mode & 0o777 == 0o666 & ~mask  # not the temporary file's owner-only mode
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask

    import medusa.heads_io

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(medusa.heads_io, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_model(model, tmp_path / "y", "medusa")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no half directory, no temporary left behind


def test_pickle_only_directory_is_refused_with_conversion_help(tmp_path):
    (tmp_path / OFFICIAL_PICKLE).write_bytes(b"\x80\x04not really a pickle")  # never opened
    with pytest.raises(ValueError, match=r"(?s)never unpickles.*safetensors") as err:
        import_heads(tmp_path)
    assert "medusa_lm_head.safetensors" in str(err.value) and "weights_only=True" in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="never unpickles"):
        MedusaModel.from_pretrained(tmp_path, base=make_tiny_model("llama"), tokenizer=_TOKENIZER)


def test_broken_official_directories_give_named_errors(tmp_path):
    out = export_model(medusa_model("own"), tmp_path / "ok", "medusa")
    weights, config = out / OFFICIAL_WEIGHTS, out / "config.json"
    good_weights, good_config = weights.read_bytes(), config.read_text()

    config.write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        import_heads(out)
    config.write_text(json.dumps({**json.loads(good_config), "medusa_num_heads": K + 1}))
    with pytest.raises(ValueError, match=r"does not match its config .*missing \['3\.0\.linear\.bias'"):
        import_heads(out)
    config.write_text(json.dumps({**json.loads(good_config), "hidden_size": HIDDEN * 2}))
    with pytest.raises(ValueError, match="hidden_size .* disagrees with the weights"):
        import_heads(out)
    config.write_text(good_config)

    weights.write_bytes(good_weights[: len(good_weights) // 2])
    with pytest.raises(ValueError, match="medusa_lm_head.safetensors is not a readable safetensors file"):
        import_heads(out)
    weights.unlink()  # the export's own medusa_lm_head.pt (for the official package) is never read instead
    with pytest.raises(ValueError, match="medusa_lm_head.pt is a pickle .*never unpickles"):
        import_heads(out)
    (out / OFFICIAL_PICKLE).unlink()
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors is missing"):
        import_heads(out)
    weights.write_bytes(good_weights)
    state = load_file(str(weights))
    state["0.0.linear.weight"] = state["0.0.linear.weight"][:, :8].contiguous()
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"blocks\.0\.0\.linear\.weight has shape \(64, 8\)"):
        import_heads(out)


def test_unrecognised_directory_is_not_taken_for_heads(tmp_path):
    make_tiny_model("llama").save_pretrained(tmp_path)  # a plain model directory: config.json, no medusa keys
    assert foreign_layout(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="medusa_config.json is missing"):
        MedusaModel.from_pretrained(tmp_path, base=make_tiny_model("llama"), tokenizer=_TOKENIZER)
    with pytest.raises(FileNotFoundError, match="not a heads directory"):
        import_heads(tmp_path)
    vllm = export_model(medusa_model("own"), tmp_path / "v", "vllm")
    (vllm / VLLM_WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        import_heads(vllm)


def test_vocab_subset_travels_as_vllm_token_map(tmp_path, caplog):
    model = medusa_model("shared")
    subset = torch.tensor([5, 1, 90, 33, 7, 60])
    model.heads.set_vocab_subset(subset)
    model.refresh_candidate_projection()
    out = export_model(model, tmp_path / "vllm", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["truncated_vocab_size"]) == (VOCAB, len(subset))
    state = load_file(str(out / VLLM_WEIGHTS))
    assert torch.equal(state["token_map"], subset) and state["lm_heads.0.weight"].shape == (VOCAB, HIDDEN)
    loaded = MedusaModel.from_pretrained(out, base=make_tiny_model("llama"), tokenizer=_TOKENIZER)
    assert loaded.config.vocab_subset_size == len(subset) and torch.equal(loaded.heads.vocab_subset, subset)
    for k in range(K):  # imported heads own K copies of the shared rows
        torch.testing.assert_close(
            loaded.candidate_projection.weight[k], model.candidate_projection.weight, rtol=0, atol=0
        )
    half = load_file(str(export_model(model, tmp_path / "vllm16", "vllm", dtype=torch.float16) / VLLM_WEIGHTS))
    assert half["lm_heads.0.weight"].dtype == torch.float16  # weights cast for serving, token ids kept exact
    assert half["token_map"].dtype == torch.int64 and torch.equal(half["token_map"], subset)

    state["token_map"] = torch.tensor([5, 1, 96, 33, 7, 60])  # 96 is outside the vocabulary
    save_file(state, str(out / VLLM_WEIGHTS))
    with pytest.raises(ValueError, match="token_map must hold truncated_vocab_size=6 token ids"):
        import_heads(out)
    del state["token_map"]
    save_file(state, str(out / VLLM_WEIGHTS))
    with pytest.raises(ValueError, match="needs a token_map"):
        import_heads(out)
    with caplog.at_level("WARNING"):
        export_model(model, tmp_path / "official", "medusa")
    assert "cannot carry the 6-token candidate subset" in caplog.text


def test_copy_guess_is_named_when_it_does_not_travel(tmp_path, caplog):
    """copy_ngram is a ranking rule of medusa's: exporting says the other engine's heads will guess without it."""
    model = medusa_model("own")
    model.heads.config = dataclasses.replace(model.config, copy_ngram=4)
    with caplog.at_level(logging.WARNING, logger="medusa.heads_io"):
        out = export_model(model, tmp_path / "vllm", "vllm")
    assert "copy_ngram 4" in caplog.text
    assert MedusaModel.from_pretrained(out, base=make_tiny_model("llama"), tokenizer=_TOKENIZER).config.copy_ngram == 0


def test_one_loader_for_every_layout_and_one_base_check(tmp_path):
    """load_heads reads native, official and vLLM directories alike; heads of any layout that name no base model are
    refused without base= (imported ones took the embedded SmolLM2 silently before)."""
    model = medusa_model("own")
    model.save_pretrained(tmp_path / "native")
    for directory in (
        tmp_path / "native",
        export_model(model, tmp_path / "official", "medusa"),
        export_model(model, tmp_path / "vllm", "vllm"),
    ):
        loaded = load_heads(directory).state_dict()
        assert loaded.keys() == model.heads.state_dict().keys(), directory.name
        for name, tensor in model.heads.state_dict().items():
            assert torch.equal(tensor, loaded[name]), (directory.name, name)
    with pytest.raises(FileNotFoundError, match=r"(?s)not a medusa heads directory.*nor an official Medusa or vLLM"):
        load_heads(tmp_path / "empty")

    config = json.loads((tmp_path / "official" / "config.json").read_text())
    (tmp_path / "official" / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="do not name their base model"):
        MedusaModel.from_pretrained(tmp_path / "official")
    loaded = MedusaModel.from_pretrained(tmp_path / "official", base=make_tiny_model("llama"), tokenizer=_TOKENIZER)
    assert loaded.config.num_heads == K


def test_medusa_export_command_writes_both_layouts_and_refuses_the_shipped_heads(tmp_path, capsys):
    """`medusa export` (medusa.cli) on a tiny model's plain heads; the shipped heads are refused before any base load,
    naming each input the foreign layouts lack and the training flags that avoid it."""
    base_dir, heads_dir = save_tiny_checkpoint(tmp_path)
    ours = load_heads(heads_dir)
    lm_head = load_file(str(base_dir / "model.safetensors"))["lm_head.weight"]
    main(["export", str(heads_dir), str(tmp_path / "official"), "--format", "medusa", "--base", str(base_dir)])
    main(["export", str(heads_dir), str(tmp_path / "vllm"), "--format", "vllm", "--base", str(base_dir)])
    official, vllm = (
        load_file(str(tmp_path / "official" / OFFICIAL_WEIGHTS)),
        load_file(str(tmp_path / "vllm" / VLLM_WEIGHTS)),
    )
    assert torch.equal(official["2.0.linear.weight"], ours.blocks[2][0].linear.weight)
    assert torch.equal(vllm["blocks.2.layers.0.bias"], ours.blocks[2][0].linear.bias)
    assert torch.equal(official["3.1.weight"], lm_head) and torch.equal(vllm["lm_heads.3.weight"], lm_head)
    assert json.loads((tmp_path / "official" / "config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    assert "wrote vllm layout" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(DEFAULT_HEADS_DIR), str(tmp_path / "shipped"), "--format", "vllm"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and not (tmp_path / "shipped").exists()
    for named in (
        "context layer over the last 64 positions",
        "layers [2, 15, 27]",
        "next token's embedding",
        "path tokens",
        EXPORTABLE_FLAGS,
    ):
        assert named in err, named


def test_readme_exports_the_shipped_exportable_heads_and_the_recipes_parse(tmp_path, monkeypatch):
    """README's step 5, read from the README itself: its `medusa export` lines name the shipped exportable set
    (whose config and recipe, configs/smollm2-135m-medusa1.yaml, export) and write both layouts (run here on tiny
    heads built from that recipe's section); docs/serving.md's command for training on your own data parses against
    configs/smollm2-135m.yaml (it failed once with "heads.context_window needs heads.condition_on_next_token") with
    the flags the export error advises (EXPORTABLE_FLAGS), also given in the default heads' README."""
    from medusa.train.config import parse_args
    from medusa.train.trainer import build_heads

    step = README.read_text().split("# 5. serve heads elsewhere")[1].split("```")[0]
    exports = [shlex.split(line)[1:] for line in step.splitlines() if line.startswith("medusa export")]
    assert sorted(argv[4] for argv in exports) == sorted(FORMATS)
    assert {argv[1] for argv in exports} == {"embedded:smollm2-135m-instruct-medusa1"}
    shipped = resolve_heads(exports[0][1])
    check_exportable(MedusaConfig.load(shipped))
    monkeypatch.chdir(README.parent)  # the commands' --config is relative to the repository
    _, recipe = parse_args("train", ["--config", "configs/smollm2-135m-medusa1.yaml"])
    assert README.parent / recipe.training.output_dir == shipped
    check_exportable(recipe.heads)

    serving = (README.parent / "docs" / "serving.md").read_text().replace("\\\n", " ")
    (train_line,) = [line for line in serving.splitlines() if line.startswith("accelerate launch train/train.py")]
    _, cfg = parse_args("train", shlex.split(train_line.split("#")[0])[3:])
    check_exportable(cfg.heads)
    assert EXPORTABLE_FLAGS in " ".join(train_line.split())
    assert EXPORTABLE_FLAGS in (DEFAULT_HEADS_DIR / "README.md").read_text()

    base_dir = tmp_path / "base"
    make_tiny_model("llama").save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)  # export loads the base (shared projection) with its tokenizer
    section = dataclasses.replace(recipe.heads, vocab_subset_size=32)  # 8192 exceeds the tiny vocabulary
    heads = build_heads(section, HIDDEN, VOCAB, torch.nn.Linear(HIDDEN, VOCAB, bias=False), str(base_dir))
    (tmp_path / "heads").mkdir()
    save_heads(heads, tmp_path / "heads")
    monkeypatch.chdir(tmp_path)
    for argv in exports:
        main([argv[0], str(tmp_path / "heads"), *argv[2:]])
        out = tmp_path / argv[2]
        assert foreign_layout(out) == argv[4]
        assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == argv[-1]
        assert load_heads(out).config.num_heads == recipe.heads.num_heads
