"""Atomic writes: a crash or a kill never leaves a half-written file or directory behind; the check an export's
output directory passes first; and a lock for one-time work that several processes may start at once."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)


def _umask_modes(path: Path, is_dir: bool) -> None:
    """mkdtemp/mkstemp create owner-only entries; published files follow the umask like any other file."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod((0o777 if is_dir else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_file(path: Path, suffix: str = ""):
    """Yield a temporary path in `path`'s folder for the block to write (`suffix`: for writers that want one); it
    is renamed onto `path` when the block ends, and removed if the block fails or is killed mid-write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        _umask_modes(Path(tmp), is_dir=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the system offers no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _siblings(out_dir: Path, kind: str) -> list[Path]:
    return sorted(out_dir.parent.glob(f".{out_dir.name}.{kind}-*"))


def _settle(out_dir: Path) -> None:
    """Undo what a killed write left: temporary folders go; if the directory itself is missing while an old version
    waits beside it (killed between the two renames of the fallback swap), that version is put back."""
    old = _siblings(out_dir, "old")
    if old and not out_dir.exists():
        os.replace(old[-1], out_dir)
        old = old[:-1]
    for leftover in old + _siblings(out_dir, "tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


def _keep(item: Path, dst: Path) -> None:
    """Carry a file the write did not produce into the new version: hard links where possible (no copy)."""
    if item.is_dir():
        shutil.copytree(item, dst, copy_function=_link_or_copy)
    else:
        _link_or_copy(item, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_directory(out_dir: Path, write: Callable[[Path], None], *, stale: Iterable[str] = ()) -> Path:
    """Run `write(tmp)` in a temporary sibling folder, then put it in the place of `out_dir` as a whole.

    Readers see the old directory or the new one, never a mix: a new directory is renamed into place, an existing
    one is swapped with the new in one step (renameat2 RENAME_EXCHANGE; elsewhere two renames, and a write killed
    between them is undone by the next one). Entries of the old directory that this write does not produce are
    carried over (hard links), except those named in `stale` (files of another layout). Leftovers of killed writes
    are cleaned up first.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _settle(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} exists and is not a directory: choose another output path")
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
        written, stale = {p.name for p in tmp.iterdir()}, set(stale)
        for item in out_dir.iterdir():
            if item.name not in written and item.name not in stale:
                _keep(item, tmp / item.name)
        if not _exchange(tmp, out_dir):
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
            os.replace(out_dir, old)  # on Linux an empty directory may be replaced by rename
            os.replace(tmp, out_dir)
            tmp = old
        shutil.rmtree(tmp, ignore_errors=True)  # now the old version
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file: choose a directory path for the export")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty: choose another directory or pass overwrite=True (--overwrite)"
        )


@contextlib.contextmanager
def one_at_a_time(lock_path: Path, what: str):
    """Hold an exclusive lock on `lock_path` (created if missing) while the block runs, so that one-time work
    several processes may start together (two ranks of `accelerate launch` converting the embedded model on a fresh
    machine, two notebooks compiling one package) is done once: the others wait, then find its result. `what` names
    the work in the message a waiting process logs. Where the system has no flock, the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the writes stay atomic, only the work may be done twice
        yield
        return
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process %s (lock %s)", what, lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
