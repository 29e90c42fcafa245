"""Precision is the user's choice: it changes what the target says, so nothing else ever changes it. Exactness is
relative to plain decoding of the same target at the same precision.

- "float32" (the default): the exact reference, token-identical to transformers' fp32 `generate`.
- "bfloat16" / "float16": on a CPU only where it computes bf16 natively (AVX512-BF16 or AMX); elsewhere it is
  emulated and slower than float32, so it is refused with the faster choices named.
- "int8" / "int4": weight-only int8 or 4-bit linear layers (medusa.runtime.quantize; int4 is llama.cpp's Q4_1
  scheme) on bf16 activations where the CPU has native bf16, else float32 ones; CPU precisions. int4 only where torch
  runs its AVX-512 kernels on bf16 activations (elsewhere its kernel is a reference loop), so it is refused there,
  naming int8; int8 not under torch's AVX2 kernels, where it computes at float32's pace a row and both float32's plan
  and w8a8 are faster (docs/engines.md, "The proposal on fbgemm"), so it is refused there, naming them.
- "w8a8": int8 weights and int8 activations, each row with its own scale (medusa.runtime.quantize), as llama.cpp's
  Q8_0 computes; a tree's verify grows slowly with its nodes where weight-only int8's doubles past four, and
  speculative decoding on it is identical to its plain decoding. Less accurate than weight-only int8 (docs/engines.md
  has the measurements); where inductor's int8 GEMM template runs at vector speed (AVX512-VNNI), else on fbgemm's
  (x86: AVX2, weights at 7 bits), else refused, naming int8; for the inductor engine (uncompiled, its attention is
  exact but slow at long contexts).
- "auto": bfloat16 where the hardware computes it natively, else float32.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel

from medusa.hardware import amx, native_bf16, vector_int4, w8a8_kernel
from medusa.loading import DTYPES, load_base, resolve_dtype
from medusa.runtime import QUANTIZED, quantize_target

PRECISIONS = ("float32", "bfloat16", "float16", *QUANTIZED, "auto")
# set to 1 to run bf16 where the CPU only emulates it, and int8, int4 and w8a8 where their kernels have no fast path
ALLOW_EMULATED = "MEDUSA_ALLOW_EMULATED_BF16"


def int8_runs_well(device) -> bool:
    """Weight-only int8 at a speed worth its rounding: not under torch's AVX2 kernels (an x86 CPU without AVX-512),
    where aten's int8 kernel and inductor's template cost what float32 costs a row, and int8 ran behind llama.cpp's
    Q8_0, w8a8 and float32's plan alike (docs/engines.md, "The proposal on fbgemm")."""
    return torch.device(device).type != "cpu" or torch.backends.cpu.get_cpu_capability() != "AVX2"


def fastest_quantized_cpu() -> str:
    """The quantised precision that decodes fastest on this CPU with the shipped heads: weight-only int8 where AMX's
    tile units multiply it, w8a8 (fbgemm's int8 sums, flat from one query row to many) everywhere else, where
    inductor's int8 template widens the weights and a tree's rows cost nearly what separate steps do (planned on
    each CPU kind measured: docs/benchmarks/cpu-zen4-session68)."""
    return "int8" if amx("cpu") else "w8a8"


def _weight_only_choice(device) -> str:
    """The quantised precision to name in a refusal: int8 where it runs well, else w8a8."""
    if int8_runs_well(device):
        return "dtype='int8' (weight-only, a quarter of the bytes)"
    return "dtype='w8a8' (int8 weights and activations, as llama.cpp's Q8_0 computes)"


def activation_dtype(dtype, device) -> torch.dtype:
    """The torch dtype a target of precision `dtype` computes its activations in, after the checks above."""
    device = torch.device(device or "cpu")
    if dtype in QUANTIZED and device.type != "cpu":
        raise ValueError(f"dtype={dtype!r} is a CPU precision here; on {device.type} use dtype='bfloat16'")
    if dtype == "int4" and not vector_int4(device) and os.environ.get(ALLOW_EMULATED) != "1":
        raise ValueError(
            "aten's int4 kernel runs at vector speed only on bf16 activations under torch's AVX-512 kernels; on this "
            f"CPU it is a reference loop, about ten times slower than int8. Use {_weight_only_choice(device)}, or "
            f"set {ALLOW_EMULATED}=1 to run int4 anyway"
        )
    if dtype == "int8" and not int8_runs_well(device) and os.environ.get(ALLOW_EMULATED) != "1":
        raise ValueError(
            "weight-only int8 has no fast kernel under torch's AVX2 kernels (this CPU): it computes at float32's pace "
            "a row, and both float32's plan and w8a8 run faster than it here. Use dtype='w8a8' (int8 weights and "
            "activations, as llama.cpp's Q8_0 computes: the fastest here) or dtype='float32' (exact), or set "
            f"{ALLOW_EMULATED}=1 to run int8 anyway"
        )
    if dtype == "w8a8" and w8a8_kernel(device) is None and os.environ.get(ALLOW_EMULATED) != "1":
        raise ValueError(
            "w8a8 runs its int8 x int8 GEMMs on inductor's AVX512-VNNI template or on fbgemm (x86), neither of which "
            "this CPU or torch build offers; elsewhere each GEMM is a oneDNN call that costs more than it saves. Use "
            f"dtype='int8' (weight-only), or set {ALLOW_EMULATED}=1 to run w8a8 anyway"
        )
    if dtype == "auto" or dtype in QUANTIZED:
        return torch.bfloat16 if native_bf16(device) else torch.float32
    resolved = resolve_dtype(dtype)
    half = resolved in (torch.bfloat16, torch.float16)
    if half and device.type == "cpu" and not native_bf16(device) and os.environ.get(ALLOW_EMULATED) != "1":
        raise ValueError(
            f"this CPU has no native bf16 (AVX512-BF16 or AMX): {str(resolved).replace('torch.', '')} would be "
            f"emulated and slower than float32. Use dtype='float32' (exact), or {_weight_only_choice(device)}, or set "
            f"{ALLOW_EMULATED}=1 to run it anyway"
        )
    return resolved


def load_target(source, *, dtype=None, device=None, **options):
    """load_base at a precision (PRECISIONS, or a torch dtype): -> (model, tokenizer). A loaded model keeps its own
    precision unless `dtype` names one (converting it would change it under whatever else holds it)."""
    if isinstance(dtype, str) and dtype not in PRECISIONS and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {list(PRECISIONS)}")
    as_it_is = dtype is None and isinstance(source, PreTrainedModel)
    activations = None if as_it_is else activation_dtype(dtype, device)
    model, tokenizer = load_base(source, dtype=activations, device=device, **options)
    if dtype in QUANTIZED:
        quantize_target(model, dtype)
    return model, tokenizer
