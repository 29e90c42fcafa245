"""Directories are replaced as a whole: readers see the old version or the new one, never a mix, even after a kill."""

import inspect
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa.config import MedusaConfig
from medusa.fileio import _settle, write_directory
from medusa.heads import MedusaHeads
from medusa.heads_io import load_heads_weights

ROOT = Path(__file__).resolve().parent.parent


def _writer(files: dict):
    def write(tmp: Path) -> None:
        for name, text in files.items():
            (tmp / name).write_text(text)

    return write


def test_an_existing_directory_is_replaced_whole_keeping_foreign_files(tmp_path):
    out = tmp_path / "heads"
    write_directory(out, _writer({"config.json": "1", "weights": "1", "old_layout.bin": "1"}))
    (out / "notes.txt").write_text("mine")
    write_directory(out, _writer({"config.json": "2", "weights": "2"}), stale=("old_layout.bin",))
    assert {p.name: p.read_text() for p in out.iterdir()} == {"config.json": "2", "weights": "2", "notes.txt": "mine"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".heads.")]  # no temporary folder left


def test_leftovers_of_killed_writes_are_cleaned_and_an_old_version_put_back(tmp_path):
    out = tmp_path / "heads"
    (tmp_path / ".heads.tmp-dead").mkdir()
    (tmp_path / ".heads.old-dead").mkdir()
    (tmp_path / ".heads.old-dead" / "config.json").write_text("old")
    _settle(out)  # killed between the fallback's two renames: the old version comes back
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]
    write_directory(out, _writer({"config.json": "new"}))
    assert (out / "config.json").read_text() == "new"


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "heads").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        write_directory(tmp_path / "heads", _writer({"a": "b"}))


def versioned_heads(version: int, **config) -> MedusaHeads:
    """Tiny heads whose weights and config.extra are a function of `version` (the writers below and the checks share
    it)."""
    torch.manual_seed(version)
    heads = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=2, extra={"version": version}, **config))
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    return heads


# A writer process: this file's versioned_heads, os.replace slowed down to widen every window between renames
# (where a mix could show), then `write(h)` over two versions, forever.
WRITER = """
import os, sys, time
import torch
sys.path.insert(0, {root!r})
from medusa.config import MedusaConfig
from medusa.heads import MedusaHeads
from medusa.heads_io import export_heads, save_heads
from medusa.fileio import write_directory

real_replace = os.replace
def slow_replace(*args, **kwargs):
    real_replace(*args, **kwargs)
    time.sleep(0.01)
os.replace = slow_replace

{versioned_heads}
versions = [versioned_heads(v, **{config!r}) for v in (1, 2)]
print("ready", flush=True)
while True:
    for h in versions:
{write}
"""
SAVE = """\
        def write(tmp, h=h):
            save_heads(h, tmp)
            time.sleep(0.005)
        write_directory({out!r}, write)"""
EXPORT = "        export_heads(h, {out!r}, {layout!r}, overwrite=True)"


def _writer_script(path: Path, write: str, config: dict) -> Path:
    path.write_text(
        WRITER.format(root=str(ROOT), versioned_heads=inspect.getsource(versioned_heads), config=config, write=write)
    )
    return path


def _kill_at_random(script: Path, rng: random.Random) -> None:
    """Run the writer, let it write, then SIGKILL it at a random moment (or let it end, should it stop)."""
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    try:
        proc.wait(timeout=rng.uniform(0.05, 0.4))
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _version_on_disk(out: Path) -> int:
    config = MedusaConfig.load(out)
    heads = MedusaHeads(config)
    load_heads_weights(heads, out / "medusa_heads.safetensors")
    version = config.extra["version"]
    expected = versioned_heads(version)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(heads.state_dict()[name], tensor), f"weights of another version than config {version}"
    return version


def test_sigkill_during_repeated_overwrites_leaves_a_whole_version(tmp_path):
    out = tmp_path / "heads"
    script = _writer_script(tmp_path / "saver.py", SAVE.format(out=str(out)), {})
    rng = random.Random(0)
    seen = set()
    for _ in range(3):
        _kill_at_random(script, rng)
        write_directory(tmp_path / "unrelated", _writer({"x": "y"}))  # an unrelated write settles nothing here
        if out.exists():
            _settle(out)  # what the next write (or a reader that writes) does first
            seen.add(_version_on_disk(out))
    assert seen  # the saver wrote at least once before each kill


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_sigkill_during_repeated_exports_leaves_a_whole_export(tmp_path, layout):
    """An export killed at random moments: the directory then holds one whole export (one version's weights)."""
    from medusa.heads_io import import_heads

    out = tmp_path / "export"
    config = {"projection": "own", "base_model_name_or_path": "base"}
    script = _writer_script(tmp_path / "exporter.py", EXPORT.format(out=str(out), layout=layout), config)
    versions = [versioned_heads(version, **config).state_dict() for version in (1, 2)]
    rng = random.Random(1)
    for _ in range(3):
        _kill_at_random(script, rng)
        if out.exists():
            _settle(out)
            state = import_heads(out).state_dict()
            matches = [all(torch.equal(state[k], v[k]) for k in v) for v in versions]
            assert any(matches), "the export on disk mixes two versions"


def test_processes_converting_one_gguf_together_convert_it_once(tmp_path, monkeypatch):
    """Two ranks of `accelerate launch` loading the embedded default on a fresh machine: one converts, the other
    waits and reads its result. Unlocked, both converted, and the second's clean-up of "leftovers" removed the first's
    temporary folder mid-write."""
    import threading
    import time

    import medusa.loading
    from tests.conftest import make_tiny_model, run_together, tiny_tokenizer

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    conversions = []

    def slow_load(*args, **kwargs):
        conversions.append(threading.current_thread().name)
        time.sleep(0.5)  # long enough for the other thread to arrive while this one converts
        return make_tiny_model("llama")

    monkeypatch.setattr(medusa.loading.AutoModelForCausalLM, "from_pretrained", slow_load)
    monkeypatch.setattr(medusa.loading.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    results, errors = {}, []

    def convert(name):
        try:
            results[name] = medusa.loading.convert_gguf(gguf)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    run_together(convert)
    assert not errors and len(conversions) == 1
    assert results["first"] == results["second"] and (results["first"] / "config.json").is_file()


def test_a_gguf_copied_elsewhere_shares_its_conversion(tmp_path, monkeypatch):
    """Each checkout's virtual environment holds the embedded GGUF at its own path; keyed by path, every fresh clone
    converted it again (500 MB each) until CI's disk was full."""
    from medusa.loading import gguf_cache_dir

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    first, copy, other = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf", tmp_path / "c" / "model.gguf"
    for path, content in ((first, b"GGUF weights"), (copy, b"GGUF weights"), (other, b"GGUF other weights")):
        path.parent.mkdir()
        path.write_bytes(content)
    assert gguf_cache_dir(first) == gguf_cache_dir(copy)
    assert gguf_cache_dir(other) != gguf_cache_dir(first)


def test_compiled_packages_past_the_limit_go_least_recently_used_first(tmp_path, monkeypatch):
    from medusa.runtime import aot

    folder = tmp_path / "aoti"
    folder.mkdir()
    packages = {}
    for age, name in enumerate(("used-just-now", "used-a-minute-ago", "used-an-hour-ago", "used-a-day-ago")):
        path = folder / f"512-{name}.pt2"
        path.write_bytes(b"x" * 400)
        (folder / f".{path.name}.lock").touch()
        seconds = (0, 60, 3600, 86400)[age]
        os.utime(path, ns=((1_000_000 - seconds) * 10**9, 5 * 10**9))
        packages[name] = path
    new = folder / "1024-new.pt2"
    new.write_bytes(b"x" * 400)
    stale, loading = folder / ".1024-new.pt2.killed", folder / ".1024-new.pt2.loading"  # libraries extracted (Package)
    for extracted in (stale, loading):
        extracted.mkdir()
        (extracted / "model.so").write_bytes(b"x")
    os.utime(stale, (1, 1))
    monkeypatch.setenv("MEDUSA_AOT_CACHE_GB", str(1200 / 2**30))  # room for three packages of 400 bytes
    deleted = aot.prune(keep=new)
    assert not stale.exists() and loading.exists()  # left by a killed process long ago; another loading now
    assert set(deleted) == {packages["used-an-hour-ago"], packages["used-a-day-ago"]}
    assert sorted(p.name for p in folder.glob("*.pt2")) == [
        "1024-new.pt2",
        "512-used-a-minute-ago.pt2",
        "512-used-just-now.pt2",
    ]
    assert not (folder / ".512-used-a-day-ago.pt2.lock").exists()

    aot._mark_used(packages["used-a-minute-ago"])  # loaded now: newer than "used-just-now"
    assert aot.prune(keep=new) == []
    monkeypatch.setenv("MEDUSA_AOT_CACHE_GB", str(800 / 2**30))
    assert aot.prune(keep=new) == [packages["used-just-now"]]
    assert packages["used-a-minute-ago"].stat().st_mtime_ns == 5 * 10**9  # _version tells packages apart by it

    monkeypatch.setenv("MEDUSA_AOT_CACHE_GB", "eight")
    with pytest.raises(ValueError, match="MEDUSA_AOT_CACHE_GB='eight' is not a number"):
        aot.prune(keep=new)
