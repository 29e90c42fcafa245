"""The Hugging Face Hub: which references are repo ids, fetching a repo's files into huggingface_hub's cache
(`HF_HUB_OFFLINE=1` or `local_files_only=True`: the cache only), the heads shipped in the package, and pushing a
directory as `save_pretrained` writes it (model card included) in one commit. Which files of a heads repo to fetch,
and when, is medusa.heads_io.resolve_heads's business."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from medusa.config import CONFIG_NAME

# Heads and EAGLE-3 drafts shipped inside the package, named `embedded:<directory name>` (like the embedded base).
EMBEDDED_PREFIX = "embedded:"
EMBEDDED_HEADS_ROOT = Path(__file__).resolve().parent / "default_heads"


def is_repo_id(reference) -> bool:
    """'org/name' that is not an existing path (a Hub id); anything else is a local path."""
    text = str(reference)
    return (
        not Path(text).expanduser().exists()
        and text.count("/") == 1
        and not text.startswith((".", "/", "~"))
        and all(text.split("/"))
    )


def download(
    repo_id: str,
    patterns: list[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path:
    """The files of `repo_id` matching `patterns`, fetched into (or found in) the Hugging Face cache -> their folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
    except LocalEntryNotFoundError as err:
        offline = os.environ.get("HF_HUB_OFFLINE")
        why = " (local_files_only=True)" if local_files_only else " (HF_HUB_OFFLINE is set)" if offline else ""
        raise FileNotFoundError(
            f"{repo_id!r} (revision {revision or 'main'}) is not in the local Hugging Face cache and the Hub cannot "
            f"be reached{why}: download it once with network access, or pass a local directory"
        ) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise FileNotFoundError(f"no repo {repo_id!r} (revision {revision or 'main'}) on the Hub: {err}") from err
    return Path(folder)


def embedded_heads(name: str, revision: str | None = None) -> Path:
    """The directory of the heads shipped as `embedded:<name>`; raises listing the shipped names."""
    return embedded(name, CONFIG_NAME, "heads", revision)


def embedded(name: str, config_name: str, what: str, revision: str | None = None) -> Path:
    """The directory shipped as `embedded:<name>` holding `config_name` (heads' or a draft's); raises listing the
    shipped `what`."""
    shipped = sorted(p.parent.name for p in EMBEDDED_HEADS_ROOT.glob(f"*/{config_name}"))
    if revision is not None:
        raise ValueError(f"revision={revision!r} applies to a Hub repo id; embedded:{name} ships with the package")
    if name not in shipped:
        raise FileNotFoundError(f"no embedded {what} named {name!r}: the package ships {shipped}")
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
