"""medusa.runtime.torch_patches: every torch/transformers internal the runtime reaches into is where it was."""

import torch
import transformers

from medusa.runtime import torch_patches
from medusa.runtime.torch_patches import INTERNALS, Internal, moved_internals


def test_every_internal_the_runtime_uses_is_still_there():
    moved = moved_internals()
    assert not moved, (
        f"torch {torch.__version__} / transformers {transformers.__version__} moved internals the runtime relies on "
        f"(checked on {torch_patches.CHECKED_ON}): {moved}. Look at each workaround in medusa/runtime/torch_patches.py"
    )


def test_a_moved_internal_is_reported(monkeypatch):
    gone = Internal("torch._inductor.codegen.common", "KernelTemplate._no_such_parser", "a test")
    missing_module = Internal("torch._no_such_module", "anything", "a test")
    monkeypatch.setattr(torch_patches, "INTERNALS", (*INTERNALS, gone, missing_module))
    moved = moved_internals()
    assert len(moved) == 2 and "_no_such_parser" in moved[0] and "_no_such_module" in moved[1]


def test_each_internal_says_why():
    assert all(internal.why for internal in INTERNALS)
    names = {f"{i.module}.{i.name}" for i in INTERNALS}
    assert len(names) == len(INTERNALS)
