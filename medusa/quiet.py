"""torchao (an optional extra, for draft="int8"), which transformers' quantizers import whenever a model loads, logs a
warning at import for each compiled extension of its wheel that cannot load here (its CUDA kernels, or one built for
another Python), and torch a deprecation for each enum torchao registers: lines on every run, none about anything
medusa runs. So those quantizers are imported first, here, with the two loggers held to errors meanwhile (an error
still shows)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def loggers_held_to_errors(names=NOISY_LOGGERS):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_quantizers_quietly() -> None:
    if importlib.util.find_spec("torchao") is None:
        return
    with loggers_held_to_errors():
        import transformers.quantizers  # noqa: F401


import_quantizers_quietly()
