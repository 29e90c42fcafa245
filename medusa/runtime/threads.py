"""The threads that run the target: one call at a time per target, and GNU OpenMP's thread pools on a CPU.

A target's engines keep its caches and compiled state (medusa.runtime.engine_for), shared by every wrapper of it, so
calls running it at once from several threads share them too (four threads each asking the embedded model for 48
tokens at once had not finished after five minutes). Calls that run it take the target's lock (`runs_the_target`)
and so run one after another, each at the speed of a call alone.

torch's CPU kernels (and MKL's, and oneDNN's) run their parallel regions on GNU OpenMP (libgomp), which gives every
thread that starts a region a pool of threads of its own, kept until that thread ends. A decoding step is hundreds of
short regions, fast only while the pool's threads spin between them; once the pools' threads outnumber the cores,
libgomp throttles that spinning in every pool, for as long as the pools live. So a model loaded on one thread and
run on another (a web app's worker thread) decodes at about half speed, and so does the first thread afterwards.

`omp_pause_resource_all` (OpenMP 5.0) ends the calling thread's pool; the next region on that thread starts a new one
(a few thread starts). The library's entry points that run the target release the caller's pool when they return
(`releases_openmp_pool`), so whichever thread calls next holds the only pool.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref

import torch

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's soft pause: the threads end, what they hold is freed
# each target's lock, kept beside the model rather than in it (a lock cannot be copied or pickled with the model)
_TARGET_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAKING_LOCKS = threading.Lock()


@functools.lru_cache(maxsize=1)
def _pause_functions() -> tuple:
    """omp_pause_resource_all of every GNU OpenMP library this process loaded (torch's own; another copy, should an
    extension bring one), where torch runs on GNU OpenMP; none elsewhere (another OpenMP runtime, other platforms:
    their pools are left as they are)."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return ()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return ()
    functions = []
    for path in sorted(paths):
        try:
            function = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        except OSError:  # a mapping whose file is gone, say: its pools are left as they are
            continue
        if function is not None:
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            functions.append(function)
    return tuple(functions)


def release_openmp_pool() -> bool:
    """End the calling thread's OpenMP pool (GNU OpenMP only); True if one was asked to end. Outside any parallel
    region (libgomp refuses inside one)."""
    return any([pause(OMP_PAUSE_SOFT) == 0 for pause in _pause_functions()])


def releases_openmp_pool(function):
    """`function` releases the calling thread's OpenMP pool when it returns or raises (module docstring: why)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            release_openmp_pool()

    return wrapper


def target_lock(target) -> threading.RLock:
    """The lock of one target model (re-entrant: a call that runs it may call another, calibration a generate)."""
    with _MAKING_LOCKS:
        return _TARGET_LOCKS.setdefault(target, threading.RLock())


def runs_the_target(method):
    """A method of a wrapper of `self.base` that runs it: calls from several threads run one at a time, each ending
    its thread's OpenMP pool before the next one starts (module docstring: why both)."""

    releasing = releases_openmp_pool(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with target_lock(self.base):
            return releasing(self, *args, **kwargs)

    return wrapper
