"""Heads on the Hugging Face Hub: a repo id where a directory is expected is fetched (and cached) by huggingface_hub;
`HF_HUB_OFFLINE=1` reads the local cache only. Pushing writes the directory as `save_pretrained` does, then uploads it
in one commit."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from medusa.config import CONFIG_NAME

# Heads shipped inside the package, named `embedded:<directory name>` (like the embedded base).
EMBEDDED_PREFIX = "embedded:"
EMBEDDED_HEADS_ROOT = Path(__file__).resolve().parent / "default_heads"

# What a heads repo holds, in every layout medusa reads (native, Medusa-2 adapter, official, vLLM) and its card.
HEADS_FILES = ["*.json", "*.safetensors", "README.md"]


def is_repo_id(reference) -> bool:
    """'org/name' that is not an existing path (a Hub id); anything else is a local path."""
    text = str(reference)
    return (
        not Path(text).expanduser().exists()
        and text.count("/") == 1
        and not text.startswith((".", "/", "~"))
        and all(text.split("/"))
    )


def resolve_heads(reference, revision: str | None = None) -> Path:
    """A heads directory, a Hub repo id or `embedded:<name>` -> the local directory holding its files (a Hub repo is
    downloaded once, then cached)."""
    if str(reference).startswith(EMBEDDED_PREFIX):
        return embedded_heads(str(reference).removeprefix(EMBEDDED_PREFIX), revision)
    if not is_repo_id(reference):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a Hub repo id, and {str(reference)!r} is a local path")
        return Path(reference)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(str(reference), revision=revision, allow_patterns=HEADS_FILES))
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"heads {reference!r} (revision {revision or 'main'}) are not in the local Hugging Face cache and the Hub "
            f"cannot be reached{' (HF_HUB_OFFLINE is set)' if os.environ.get('HF_HUB_OFFLINE') else ''}: download "
            "them once with network access, or pass a local directory"
        ) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise FileNotFoundError(f"no heads at {reference!r} (revision {revision or 'main'}) on the Hub: {err}") from err


def embedded_heads(name: str, revision: str | None = None) -> Path:
    """The directory of the heads shipped as `embedded:<name>`; raises listing the shipped names."""
    shipped = sorted(p.parent.name for p in EMBEDDED_HEADS_ROOT.glob(f"*/{CONFIG_NAME}"))
    if revision is not None:
        raise ValueError(f"revision={revision!r} applies to a Hub repo id; embedded:{name} ships with the package")
    if name not in shipped:
        raise FileNotFoundError(f"no embedded heads named {name!r}: the package ships {shipped}")
    return EMBEDDED_HEADS_ROOT / name


def push_to_hub(
    save_pretrained,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload Medusa heads",
    token: str | None = None,
) -> str:
    """`save_pretrained(directory)` into a temporary folder, then upload it as one commit; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "heads"
        save_pretrained(folder)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message
        )
    return str(getattr(info, "commit_url", info))
