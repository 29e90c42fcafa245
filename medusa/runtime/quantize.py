"""Weight-only quantised targets: precision as the user's choice. A quantised target is another model than the float
one (it says other things); speculative decoding on it is exact relative to plain decoding of that same target.

- int8: every linear layer whose input width aten's kernel takes (a multiple of INT8_BLOCK) holds int8 weights with
  one scale per output row (symmetric, rounded to nearest) and computes with aten's weight-only int8 kernel on bf16
  activations.
- int4: every linear layer whose shape aten's int4 kernel takes (input width a multiple of INT4_GROUP, output rows of
  INT4_ROWS) holds 4-bit weights, each group of INT4_GROUP inputs with its own scale and minimum: llama.cpp's Q4_1
  scheme, so a Q4_1 GGUF base (the weights transformers dequantised on loading) gets its stored levels back, its
  scales and minimums rounded to the activations' dtype.

- w8a8: int8 weights as int8's, and each row of activations rounded to int8 with its own scale as it arrives (what
  llama.cpp's Q8_0 does per block of 32): integer products summed exactly in int32, then scaled. Written as the
  quantized pattern inductor's freezing pass turns into its int8 GEMM template (AVX512-VNNI), whose cost stays flat
  from one to about eight rows where the weight-only kernels' doubles; uncompiled, `torch._int_mm` computes the same
  sums. Where that template has no kernel (an AVX2 CPU), fbgemm's int8 GEMM computes the sums (`int8_sums`,
  compiled or not; as flat there), on weights within FBGEMM_WEIGHT_TOP levels, sibling projections of one input fused
  (`FusedW8A8`: fewer calls out of the compiled step). A row's numbers never depend on the
  other rows (its own scale, exact sums), and the target attends with `attention.row_invariant_sdpa`, so a tree's
  verify computes each node as plain decoding does, bit for bit.

inductor lowers the kernels to its C++ templates when the inductor engine compiles the target.
Embeddings and norms stay in the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers torch.ops.quantized_decomposed (w8a8's pattern)
from torch import nn

from medusa.hardware import w8a8_kernel
from medusa.runtime.attention import use_row_invariant_sdpa
from medusa.runtime.prepack import (
    FBGEMM_WEIGHT_TOP,
    INT8_BLOCK,
    FusedProjections,
    can_int8,
    dequantizing_pays,
    fuse_siblings,
    int8_linear,
    quantize_int8,
    quantize_rows,
    replace_children,
)

QUANTIZED = ("int8", "int4", "w8a8")
INT4_GROUP = 32  # inputs sharing one scale and minimum (Q4_1's block)
INT4_ROWS = 16  # aten's int4 packing takes output rows in blocks of this many
# Unpacking every int4 weight costs a fixed time per forward: a float GEMM over them pays from this many rows of a
# prompt (prepack.dequantizing_pays' floor for int4; docs/engines.md)
INT4_DEQUANTIZED_FROM_ROWS = 256


def can_int4(device: torch.device, in_features: int, out_features: int) -> bool:
    """Whether a linear layer of this shape can run on int4 weights here (CPU)."""
    return (
        torch.device(device).type == "cpu"
        and in_features % INT4_GROUP == 0
        and out_features % INT4_ROWS == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (aten's packed int4 weight (out, in / 2) uint8, scales and zeros (in / INT4_GROUP,
    out, 2) in the activations' `dtype`, the levels two to a byte (out, in / 2) uint8, even inputs in the low four
    bits): per group, 16 levels from its minimum to its maximum, rounded to nearest."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    levels = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    levels = levels.reshape(out_features, in_features)
    zero = low + 8 * scale  # the kernel computes (level - 8) * scale + zero = level * scale + minimum
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    nibbles = (levels[:, 0::2] | (levels[:, 1::2] << 4)).to(torch.uint8)
    return packed, scales_and_zeros, nibbles


def dequantize_int4(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """quantize_int4's levels and scales -> the (out, in) weight in the scales' dtype."""
    out_features = nibbles.shape[0]
    levels = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(out_features, -1, INT4_GROUP)
    scale, zero = scales_and_zeros.transpose(0, 1).unbind(-1)  # each (out, in / INT4_GROUP)
    minimum = zero - 8 * scale
    return (levels.to(scale.dtype) * scale[..., None] + minimum[..., None]).reshape(out_features, -1)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, nibbles: torch.Tensor, bias=None
) -> torch.Tensor:
    """x (..., in) @ dequantised(packed).T + bias -> (..., out) in x's dtype: aten's int4 kernel, or for a prompt's
    many rows a float GEMM over the weights dequantised (as int8_linear does)."""
    rows = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype)
    prompt = dequantizing_pays(rows.shape[0], rows.dtype, least_rows=INT4_DEQUANTIZED_FROM_ROWS)
    if not torch.compiler.is_compiling() and prompt:
        out = (rows @ dequantize_int4(nibbles, scales_and_zeros).T).to(x.dtype)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_and_zeros).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


class QuantizedLinear(nn.Module):
    """A linear layer of a quantised target. `weight` (what heads sharing the target's projection read) is the float
    matrix for a layer tied to the input embeddings (held by them anyway), else the quantised one dequantised on
    read."""

    def __init__(self, linear: nn.Linear, tied: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self._tied = [tied]  # in a list: not registered, so never saved, exported or counted as a parameter

    @property
    def weight(self) -> torch.Tensor:
        tied = self._tied[0]
        return tied if tied is not None else self.dequantized()

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError


class Int8WeightLinear(QuantizedLinear):
    def __init__(self, linear: nn.Linear, tied: torch.Tensor | None = None):
        super().__init__(linear, tied)
        quantized, scales = quantize_int8(linear.weight)
        self.register_buffer("weight_int8", quantized)
        self.register_buffer("scales", scales)

    def dequantized(self) -> torch.Tensor:
        return (self.weight_int8.float() * self.scales.float()[:, None]).to(self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight_int8, self.scales, self.bias)


W8A8_ZERO = 128  # the pattern's activations are uint8 around this zero point (AVX512-VNNI multiplies u8 by s8)


def int8_sums(levels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """levels (M, K) float32 holding integers in -127..127, weight (N, K) int8 -> (M, N) float32: each row's exact
    integer sums, by fbgemm's int8 GEMM (compiled or not). fbgemm rounds its whole input to uint8 with one scale and
    zero point from the input's minimum and maximum, so a last row holding -128 and 127 pins them at 1 and
    W8A8_ZERO: every level goes in as it is, whatever the other rows hold."""
    columns = torch.arange(levels.shape[1], device=levels.device)
    pin = torch.where(columns == 0, -W8A8_ZERO, torch.where(columns == 1, W8A8_ZERO - 1, 0)).to(levels.dtype)
    return torch.ops.medusa.fbgemm_sums(torch.cat([levels, pin[None]]), weight)[:-1]


def w8a8_linear(
    x: torch.Tensor,
    quantized: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias=None,
    vocabulary=False,
    fbgemm=False,
):
    """x (..., in) -> (..., out) in x's dtype: x's rows rounded to int8 each with its own scale, times the int8
    weights (out, in) with theirs (float32, one per output row), the products summed exactly. `vocabulary`: the
    projection to the vocabulary, whose logits stay float32 (see W8A8Linear). `fbgemm`: the sums by `int8_sums`
    (weights within FBGEMM_WEIGHT_TOP levels), compiled or not."""
    rows = x.reshape(-1, x.shape[-1])
    levels, row_scales = quantize_rows(rows)
    if fbgemm:
        out = int8_sums(levels, quantized) * (row_scales * scales)
    elif torch.compiler.is_compiling():  # the pattern inductor's freezing pass lowers to its int8 GEMM template
        shifted = (levels + W8A8_ZERO).to(torch.uint8)
        activations = torch.ops.quantized_decomposed.dequantize_per_tensor(shifted, 1.0, W8A8_ZERO, 0, 255, torch.uint8)
        weight = torch.ops.quantized_decomposed.dequantize_per_channel(
            quantized, scales, zeros, 0, -128, 127, torch.int8
        )
        out = nn.functional.linear(activations, weight) * row_scales
    else:
        # one multiplication by the scales' outer product: as two, inductor's freezing pass matches SmoothQuant's
        # pattern and hands the GEMM to oneDNN's qlinear (tens of ms a step, docs/engines.md)
        out = torch._int_mm(levels.to(torch.int8), quantized.t()).float() * (row_scales * scales)
    if bias is not None:
        out = out + bias
    return (out if vocabulary else out.to(x.dtype)).reshape(*x.shape[:-1], quantized.shape[0])


class W8A8Linear(QuantizedLinear):
    # The projection to the vocabulary keeps its logits in float32: a step's hidden states move by a rounding with
    # the number of query rows (as at every precision), rounding activations to int8 can turn that into a level, and
    # bf16 logits then tie often enough that plain and speculative decoding parted in every answer (near-ties).
    vocabulary = False

    def __init__(self, linear: nn.Linear, tied: torch.Tensor | None = None):
        super().__init__(linear, tied)
        # inductor's int8 GEMM template where it has a kernel (AVX512-VNNI), else fbgemm's (AVX2) on narrower weights
        self.fbgemm = w8a8_kernel(linear.weight.device) == "fbgemm"
        quantized, scales = quantize_int8(linear.weight, FBGEMM_WEIGHT_TOP if self.fbgemm else 127)
        self.register_buffer("weight_int8", quantized)
        self.register_buffer("scales", scales.float())
        self.register_buffer("zeros", torch.zeros_like(scales, dtype=torch.long))  # symmetric: the pattern names them

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, self.weight_int8, self.scales, self.zeros, self.bias, self.vocabulary, self.fbgemm)


class FusedW8A8(FusedProjections):
    """Sibling projections of one input (prepack.FUSABLE: q/k/v, gate/up) as one W8A8Linear over their weights side
    by side: one rounding of the input and one GEMM call instead of three or two. Each output row keeps its own scale,
    so every member computes bit for bit what it would alone. For w8a8 on fbgemm, whose calls cost as much as the GEMM
    (docs/engines.md, "w8a8 on AVX2")."""

    def _pack(self) -> None:
        first = self.linears[0]
        together = nn.Linear(
            first.in_features, sum(self.sizes), bias=first.bias is not None, device=first.weight.device
        )
        with torch.no_grad():
            together.weight.copy_(torch.cat([linear.weight for linear in self.linears]))
            if first.bias is not None:
                together.bias.copy_(torch.cat([linear.bias for linear in self.linears]))
        self.layer = W8A8Linear(together)
        self.linears = ()  # the float weights are not needed again (a quantised target's weights never change)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class FusedW8A8Member(QuantizedLinear):
    """One layer of a FusedW8A8 group, in its original place in the model."""

    def __init__(self, linear: nn.Linear, group: FusedW8A8, member: int):
        super().__init__(linear)  # its bias (dequantize_target's) is a slice of the group layer's, which adds it
        self.group, self.member = group, member
        self.layer = group.layer  # registered here too: its buffers are this layer's to export, load and count

    def dequantized(self) -> torch.Tensor:
        start = sum(self.group.sizes[: self.member])
        return self.layer.dequantized()[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.member)


def _w8a8_members(linears: list[nn.Linear]) -> list[FusedW8A8Member] | None:
    if not can_int8(linears[0].weight.device, linears[0].in_features):
        return None
    group = FusedW8A8(linears)
    return [FusedW8A8Member(linear, group, member) for member, linear in enumerate(linears)]


def _fuse_w8a8_siblings(model: nn.Module) -> None:
    """Replace each FUSABLE set of sibling nn.Linear layers in `model` with FusedW8A8Member layers of one group."""
    for module in list(model.modules()):
        fuse_siblings(module, _w8a8_members)


class Int4WeightLinear(QuantizedLinear):
    def __init__(self, linear: nn.Linear, tied: torch.Tensor | None = None):
        super().__init__(linear, tied)
        packed, scales_and_zeros, nibbles = quantize_int4(linear.weight, linear.weight.dtype)
        self.register_buffer("weight_int4", packed)  # what the kernel reads (its own layout)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("levels", nibbles)  # the same levels in a plain layout, for prompts and `weight`

    def dequantized(self) -> torch.Tensor:
        return dequantize_int4(self.levels, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.weight_int4, self.scales_and_zeros, self.levels, self.bias)


def _quantized_layer(precision: str, device: torch.device, linear: nn.Linear):
    """The quantised layer class for `linear` at `precision`, or None where the kernel does not take its shape."""
    if precision in ("int8", "w8a8"):
        layer = Int8WeightLinear if precision == "int8" else W8A8Linear
        return layer if can_int8(device, linear.in_features) else None
    return Int4WeightLinear if can_int4(device, linear.in_features, linear.out_features) else None


def quantize_target(model: nn.Module, precision: str) -> nn.Module:
    """`model` with its linear layers in `precision` (one of QUANTIZED), in place. -> model."""
    if precision not in QUANTIZED:
        raise ValueError(f"unknown weight-only precision {precision!r}: use one of {list(QUANTIZED)}")
    device = next(model.parameters()).device
    if not can_int8(device, INT8_BLOCK):
        raise ValueError(
            f"a {precision} target needs aten's weight-only kernels on a CPU; this is {device.type}: "
            "use dtype='bfloat16' on a GPU"
        )
    embeddings = model.get_input_embeddings().weight

    def quantized(child: nn.Module) -> nn.Module | None:
        layer = _quantized_layer(precision, device, child) if type(child) is nn.Linear else None
        return layer(child, embeddings if child.weight is embeddings else None) if layer is not None else None

    if precision == "w8a8" and w8a8_kernel(device) == "fbgemm":
        _fuse_w8a8_siblings(model)
    replace_children(model, quantized)
    projection = model.get_output_embeddings()
    if isinstance(projection, W8A8Linear):
        projection.vocabulary = True  # see W8A8Linear
    if precision == "w8a8":
        use_row_invariant_sdpa(model)
    model.medusa_precision = precision  # what plans and packages are keyed on
    return model


def sums_on_fbgemm(model: nn.Module) -> bool:
    """Whether `model` is a w8a8 target whose integer sums fbgemm computes (`int8_sums`)."""
    return any(isinstance(m, W8A8Linear) and m.fbgemm for m in model.modules())


def dequantize_target(model: nn.Module) -> nn.Module:
    """`model` with each quantised linear layer replaced by an nn.Linear holding its dequantised weights in float32,
    in place: the quantised target's weights in plain float arithmetic (what scripts/divergence.py judges with). ->
    model."""

    def dequantized(child: nn.Module) -> nn.Module | None:
        if not isinstance(child, QuantizedLinear):
            return None
        weight = child.dequantized()  # what it computes with, a tied layer's too (`weight` is the float one)
        linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device=weight.device)
        with torch.no_grad():
            linear.weight.copy_(weight.float())
            if child.bias is not None:
                linear.bias.copy_(child.bias.float())
        return linear

    replace_children(model, dequantized)
    model.medusa_precision = None
    return model


def precision_of(model: nn.Module) -> str:
    """What the user chose for `model`: a weight-only precision, else its dtype's name (float32, bfloat16...)."""
    return getattr(model, "medusa_precision", None) or str(model.dtype).replace("torch.", "")
