"""Atomic writes: a crash or a kill never leaves a half-written file or directory behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable


def _umask_modes(path: Path, is_dir: bool) -> None:
    """mkdtemp/mkstemp create owner-only entries; published files follow the umask like any other file."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod((0o777 if is_dir else 0o666) & ~mask)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        _umask_modes(Path(tmp), is_dir=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_directory(out_dir: Path, write: Callable[[Path], None], *, stale: Iterable[str] = (),
                    last: str | None = None) -> Path:
    """Run `write(tmp)` in a temporary sibling folder, then move the result into place.

    A new directory is renamed into place in one step. Into an existing one the files move one by one, `last`
    (e.g. the config that announces the layout) at the end, and files named in `stale` that this write did not
    produce are removed first, so no mix of old and new layouts remains.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        write(tmp)
        _umask_modes(tmp, is_dir=True)
        for item in tmp.iterdir():
            if item.is_file():
                _umask_modes(item, is_dir=False)
        if not out_dir.is_dir():
            os.replace(tmp, out_dir)
            return out_dir
        written = {p.name for p in tmp.iterdir()}
        for name in stale:
            if name not in written:
                (out_dir / name).unlink(missing_ok=True)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == last):
            os.replace(item, out_dir / item.name)
        tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
