"""Heads from the Hub, offline against a local Hugging Face cache (HF_HUB_OFFLINE=1) or a mocked snapshot_download
serving a local folder, and pushed to it (a mocked HfApi) with their model card."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from medusa import MedusaModel
from medusa.config import MedusaConfig
from medusa.heads_io import HEADS_FILES, LAYOUT_FILES, check_heads_repo, model_card, resolve_heads
from medusa.hub import EMBEDDED_HEADS_ROOT, is_repo_id
from medusa.loading import DEFAULT_BASE, DEFAULT_BASE_HUB_ID, hub_commit
from tests.conftest import save_tiny_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, heads_dir: Path, revision: str = "main") -> Path:
    """The layout huggingface_hub keeps: refs/<revision> names a commit, snapshots/<commit>/ holds the files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(COMMIT)
    shutil.copytree(heads_dir, repo / "snapshots" / COMMIT, dirs_exist_ok=True)
    return repo / "snapshots" / COMMIT


class FakeHub:
    """snapshot_download serving the folder `source` as a Hub repo: it records each call and copies the files that
    `allow_patterns` select into one snapshot folder, as the cache keeps one per commit."""

    def __init__(self, source: Path, snapshot: Path):
        self.source, self.snapshot, self.calls = source, snapshot, []

    def __call__(self, repo_id, *, allow_patterns=None, **options):
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append({"repo_id": repo_id, "allow_patterns": allow_patterns, **options})
        files = [p.relative_to(self.source).as_posix() for p in self.source.rglob("*") if p.is_file()]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (self.snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.source / name, self.snapshot / name)
        return str(self.snapshot)


def serve(monkeypatch, source: Path, snapshot: Path) -> FakeHub:
    import huggingface_hub

    hub = FakeHub(source, snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    return hub


def spy_transformers_loads(monkeypatch) -> list[tuple[str, dict]]:
    """(class name, keyword arguments) of every AutoModelForCausalLM / AutoTokenizer.from_pretrained call, which
    still loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loads = []
    for auto in (AutoModelForCausalLM, AutoTokenizer):
        real = auto.from_pretrained
        monkeypatch.setattr(
            auto,
            "from_pretrained",
            lambda *a, _real=real, _name=auto.__name__, **k: loads.append((_name, k)) or _real(*a, **k),
        )
    return loads


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


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
        from medusa.heads_io import resolve_heads
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
        from medusa.heads_io import resolve_heads
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


def test_a_base_model_id_is_refused_having_downloaded_only_its_config(monkeypatch, tmp_path, checkpoint):
    """A model id where heads belong (MedusaModel.from_pretrained("Qwen/Qwen2.5-7B")) costs one config.json, not the
    model's gigabytes, and the error names both ways to put heads on it."""
    hub = serve(monkeypatch, checkpoint[0], tmp_path / "snapshot")
    with pytest.raises(ValueError, match=r"'org/base' is a base model \(its config.json declares 'llama'\)") as err:
        MedusaModel.from_pretrained("org/base")
    assert "MedusaModel.from_base('org/base')" in str(err.value)
    assert "MedusaModel.from_pretrained(<heads>, base='org/base')" in str(err.value)
    assert [call["allow_patterns"] for call in hub.calls] == [LAYOUT_FILES]
    assert sorted(p.name for p in hub.snapshot.iterdir()) == ["config.json"]


def test_heads_weights_follow_their_config_and_hub_options_reach_every_download(monkeypatch, tmp_path, checkpoint):
    """token, cache_dir and local_files_only go to huggingface_hub with both fetches of the heads (revision too) and
    to transformers with the base and its tokenizer."""
    base_dir, heads_dir = checkpoint
    hub = serve(monkeypatch, heads_dir, tmp_path / "snapshot")
    loads = spy_transformers_loads(monkeypatch)
    options = {"token": "hf_test", "cache_dir": str(tmp_path / "cache"), "local_files_only": True}
    model = MedusaModel.from_pretrained("org/heads", base=str(base_dir), revision="v1", **options)
    assert [call["allow_patterns"] for call in hub.calls] == [LAYOUT_FILES, HEADS_FILES]
    assert all(call["repo_id"] == "org/heads" and call["revision"] == "v1" for call in hub.calls)
    assert all(options.items() <= call.items() for call in hub.calls)
    assert [name for name, _ in loads] == ["AutoModelForCausalLM", "AutoTokenizer"]
    assert all(options.items() <= kwargs.items() for _, kwargs in loads)
    assert model.config.num_heads == MedusaConfig.load(heads_dir).num_heads


@pytest.mark.parametrize("constructor", ["from_base", "from_draft_model"])
def test_from_base_and_from_draft_model_pass_hub_options_to_transformers(
    monkeypatch, tmp_path, checkpoint, constructor
):
    base_dir = str(checkpoint[0])
    loads = spy_transformers_loads(monkeypatch)
    options = {"token": "hf_test", "cache_dir": str(tmp_path / "cache"), "local_files_only": True}
    if constructor == "from_base":
        MedusaModel.from_base(base_dir, **options)
    else:
        MedusaModel.from_draft_model(base_dir, base_dir, **options)
    assert loads and all(options.items() <= kwargs.items() for _, kwargs in loads)
    assert {name for name, _ in loads} == {"AutoModelForCausalLM", "AutoTokenizer"}


@pytest.mark.parametrize(
    "name, config, refusal",
    [
        ("medusa_config.json", {"num_heads": 2}, None),  # native (only its presence counts here)
        ("config.json", {"medusa_num_heads": 2, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}, None),  # official
        ("config.json", {"model_type": "medusa", "architectures": ["MedusaModel"]}, None),  # vLLM
        ("config.json", {"speculators_model_type": "eagle3"}, r"an EAGLE-3 draft.*from_draft_model"),
        ("config.json", {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}, "an EAGLE-3 draft"),
        ("config.json", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "is a base model"),
        ("config.json", {"hidden_size": 8}, "holds no Medusa heads"),
        ("adapter_config.json", {}, "holds no Medusa heads"),
    ],
)
def test_the_config_files_say_whether_a_repo_holds_heads(tmp_path, name, config, refusal):
    (tmp_path / name).write_text(json.dumps(config))
    if refusal is None:
        check_heads_repo(tmp_path, "org/x")
    else:
        with pytest.raises((ValueError, FileNotFoundError), match=refusal):
            check_heads_repo(tmp_path, "org/x")


@pytest.mark.parametrize(
    "base, hub_id",
    [(DEFAULT_BASE, DEFAULT_BASE_HUB_ID), ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"), ("/m/b", None)],
)
def test_cards_name_the_base_by_its_hub_id(base, hub_id):
    """The Hub links `base_model` only to a Hub id: the embedded base maps to the model its GGUF quantises, a local
    directory or GGUF file is left out. The body names the base as the heads recorded it, with its revision."""
    card = model_card(MedusaConfig(hidden_size=8, vocab_size=16, base_model_name_or_path=base, revision="abc1234"))
    assert front_matter(card).get("base_model") == hub_id
    assert f"`{base}` at revision `abc1234`" in card
    assert ('base="<base model>"' in card) == (hub_id is None)  # a base only this machine can find: pass base=


def test_shipped_cards_name_the_hub_id_of_the_embedded_base():
    cards = sorted(EMBEDDED_HEADS_ROOT.glob("*/README.md"))
    assert len(cards) >= 2
    for card in cards:
        front = front_matter(card.read_text())
        assert front["base_model"] == DEFAULT_BASE_HUB_ID and front["library_name"] == "medusa", card
        assert {"medusa", "speculative-decoding"} <= set(front["tags"]), card


def test_hub_commit_is_what_the_cache_says_a_hub_base_was_loaded_at(tmp_path, checkpoint):
    fake_hub_cache(tmp_path / "hub", "org/base", checkpoint[0])
    assert hub_commit("org/base", cache_dir=tmp_path / "hub") == COMMIT
    assert hub_commit(None) is None and hub_commit(DEFAULT_BASE) is None and hub_commit(str(checkpoint[0])) is None


def test_push_uploads_the_saved_directory_as_one_commit(monkeypatch, checkpoint):
    import huggingface_hub

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["repo"] = (repo_id, private, exist_ok)

        def upload_folder(self, repo_id, folder_path, revision=None, commit_message=""):
            folder = Path(folder_path)
            calls["files"] = sorted(p.name for p in folder.iterdir())
            calls["config"] = json.loads((folder / "medusa_config.json").read_text())
            calls["card"] = (folder / "README.md").read_text()
            calls["hook"] = (folder / "custom_generate" / "generate.py").read_text()
            return "https://hub/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    base_dir, heads_dir = checkpoint
    model = MedusaModel.from_pretrained(heads_dir, base=base_dir)
    model.config.base_model_name_or_path = DEFAULT_BASE  # heads for the embedded base: the card names its Hub id
    assert model.push_to_hub("me/heads", private=True) == "https://hub/commit/1"
    assert calls["repo"] == ("me/heads", True, True)
    assert {"medusa_config.json", "medusa_heads.safetensors", "README.md", "custom_generate"} <= set(calls["files"])
    assert calls["config"]["num_heads"] == model.config.num_heads
    assert torch.is_tensor(next(iter(model.heads.state_dict().values())))
    front = front_matter(calls["card"])
    assert front["base_model"] == DEFAULT_BASE_HUB_ID and front["library_name"] == "medusa"
    assert {"medusa", "speculative-decoding"} <= set(front["tags"])
    assert 'MedusaModel.from_pretrained("me/heads")' in calls["card"]
    assert 'custom_generate="me/heads", trust_remote_code=True' in calls["card"]
    assert "HEADS = 'me/heads'" in calls["hook"]  # the hook names the repo, not the temporary folder
