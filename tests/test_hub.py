"""Heads from the Hub, offline against a local Hugging Face cache (HF_HUB_OFFLINE=1), and pushed to it."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from medusa import MedusaModel
from medusa.hub import EMBEDDED_HEADS_ROOT, is_repo_id, resolve_heads
from tests.conftest import save_tiny_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, heads_dir: Path, revision: str = "main") -> Path:
    """The layout huggingface_hub keeps: refs/<revision> names a commit, snapshots/<commit>/ holds the files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(COMMIT)
    shutil.copytree(heads_dir, repo / "snapshots" / COMMIT, dirs_exist_ok=True)
    return repo / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hub"))


def _offline(cache: Path, code: str) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "MEDUSA_PLAN": "off", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )


def test_heads_load_from_a_hub_id_offline(tmp_path, checkpoint):
    base_dir, heads_dir = checkpoint
    fake_hub_cache(tmp_path / "hub", "someone/tiny-heads", heads_dir)
    done = _offline(
        tmp_path / "hub",
        f"""
        import torch
        from medusa import MedusaModel
        from medusa.hub import resolve_heads
        print(resolve_heads("someone/tiny-heads"))
        model = MedusaModel.from_pretrained("someone/tiny-heads", base={str(base_dir)!r})
        local = MedusaModel.from_pretrained({str(heads_dir)!r}, base={str(base_dir)!r})
        pairs = zip(model.heads.state_dict().values(), local.heads.state_dict().values())
        assert all(torch.equal(a, b) for a, b in pairs)
        print("loaded", model.config.num_heads)
    """,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert COMMIT in done.stdout and "loaded" in done.stdout


def test_a_missing_hub_id_or_revision_is_named_offline(tmp_path, checkpoint):
    fake_hub_cache(tmp_path / "hub", "someone/tiny-heads", checkpoint[1])
    done = _offline(
        tmp_path / "hub",
        """
        from medusa.hub import resolve_heads
        for reference, revision in (("someone/other-heads", None), ("someone/tiny-heads", "v2")):
            try:
                resolve_heads(reference, revision)
            except FileNotFoundError as err:
                print("refused:", err)
    """,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2 and "someone/other-heads" in refused[0] and "revision v2" in refused[1]
    assert all("HF_HUB_OFFLINE" in line for line in refused)


def test_local_paths_are_not_repo_ids(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "heads").mkdir()
    assert is_repo_id("org/heads") and not is_repo_id("./org/heads") and not is_repo_id("a/b/c")
    assert resolve_heads(tmp_path / "org" / "heads") == tmp_path / "org" / "heads"
    with pytest.raises(ValueError, match="revision='v1' applies to a Hub repo id"):
        resolve_heads(tmp_path / "org" / "heads", revision="v1")


def test_embedded_heads_resolve_by_name_and_an_unknown_name_lists_the_shipped_ones():
    shipped = sorted(p.parent.name for p in EMBEDDED_HEADS_ROOT.glob("*/medusa_config.json"))
    assert "smollm2-135m-instruct" in shipped and len(shipped) >= 2  # the default and the exportable set
    for name in shipped:
        assert resolve_heads(f"embedded:{name}") == EMBEDDED_HEADS_ROOT / name
    with pytest.raises(FileNotFoundError, match=r"no embedded heads named 'nope': the package ships \["):
        resolve_heads("embedded:nope")
    with pytest.raises(ValueError, match="ships with the package"):
        resolve_heads(f"embedded:{shipped[0]}", revision="v1")


def test_push_uploads_the_saved_directory_as_one_commit(monkeypatch, checkpoint):
    import huggingface_hub

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["repo"] = (repo_id, private, exist_ok)

        def upload_folder(self, repo_id, folder_path, revision=None, commit_message=""):
            calls["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            calls["config"] = json.loads((Path(folder_path) / "medusa_config.json").read_text())
            return "https://hub/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    base_dir, heads_dir = checkpoint
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir)
    assert model.push_to_hub("me/heads", private=True) == "https://hub/commit/1"
    assert calls["repo"] == ("me/heads", True, True)
    assert {"medusa_config.json", "medusa_heads.safetensors"} <= set(calls["files"])
    assert calls["config"]["num_heads"] == model.config.num_heads
    assert torch.is_tensor(next(iter(model.heads.state_dict().values())))
