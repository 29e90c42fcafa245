"""Linear layers with weights reordered once into oneDNN's blocked layout (CPU): what inductor's freezing does for
linears, without compiling anything (about half the time of a plain linear at one row).

Sibling projections that read the same input (q/k/v, gate/up) are packed as one matrix and computed by one call: a
small GEMV pays a fixed cost per call.

What proposes (the heads, their context layer, the candidate projection) only ranks guesses that the target then
verifies exactly, so on a CPU it runs on int8 weights instead (one scale per output row, on fbgemm's int8 GEMM:
`Int8Weight`, `int8_copy`): a quarter of the bytes each step reads.

What runs a prompt eagerly beside a compiled engine (`onednn_copy`) calls oneDNN on the weights as they are, unpacked:
aten's float32 linear calls MKL, which on AMD CPUs runs its AVX2 kernel whatever the CPU has. Figures:
docs/engines.md."""

from __future__ import annotations

import copy
import itertools
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from medusa.hardware import fbgemm_available, native_bf16
from medusa.runtime.attention import use_shared_gqa_sdpa


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU with oneDNN, float32; bf16 only where the CPU computes it natively (elsewhere oneDNN emulates it)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def plain_weights(model: nn.Module) -> bool:
    """Whether every parameter of `model` is a plain tensor: torchao's quantized weights (a tensor subclass) are neither
    packed nor compiled ahead of time."""
    return all(type(p) in (torch.Tensor, nn.Parameter) for p in model.parameters())


# The rows oneDNN lays the weight out for. Packed for 1, a matrix read by 2-16 rows (a tree's verify, path heads)
# cost as if each row read it again; packed for 8, one row costs the same and more rows little more (docs/engines.md).
PACKED_ROWS = 8


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) weight -> an opaque oneDNN tensor for `packed_linear` (a copy; the original is untouched)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias=None) -> torch.Tensor:
    """x (..., in) @ packed.T + bias -> (..., out_features); `packed`: `pack`'s tensor or a plain (out, in) weight."""
    rows = x.reshape(-1, x.shape[-1])  # (M, in)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)


# aten's int8 kernel reads the input in blocks of 16 values: other widths give wrong numbers or crash (torch 2.13)
INT8_BLOCK = 16


def can_int8(device: torch.device, in_features: int) -> bool:
    """Whether a linear layer reading `in_features` values can run on int8 weights here (CPU)."""
    return (
        torch.device(device).type == "cpu"
        and in_features % INT8_BLOCK == 0
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    )


def quantize_rows(rows: torch.Tensor, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) values -> (their levels in -top..top (M, K) float32, one float32 scale per row (M, 1)): symmetric,
    rounded to nearest. w8a8's activations as they arrive; `quantize_int8`'s weights."""
    rows = rows.float()
    scales = rows.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / top
    return torch.round(rows / scales).clamp(-top, top), scales


def quantize_int8(weight: torch.Tensor, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (int8 weight in -top..top, bf16 scale per output row): `quantize_rows`, stored."""
    levels, scales = quantize_rows(weight.detach(), top)
    return levels.to(torch.int8).contiguous(), scales[:, 0].to(torch.bfloat16)


# fbgemm's int8 GEMM takes uint8 activations (0..255) and int8 weights; without AVX512-VNNI it multiplies them with
# AVX2's multiply-add, which saturates each pair of products at 16 bits: weights within this many levels keep every
# sum exact
FBGEMM_WEIGHT_TOP = 63
_fbgemm_weights: dict[int, tuple] = {}  # id of an int8 weight tensor -> (a weak reference to it, fbgemm's copy)


def fbgemm_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fbgemm's packed copy of an int8 weight (N, K), each output row's sum of levels (fbgemm's zero-point term) and a
    zero bias: made on first use and dropped with the weight (a quantised target's weights are never written again;
    Int8Weight's are made anew when their layer's weight changes)."""
    key = id(weight)
    held = _fbgemm_weights.get(key)
    if held is None or held[0]() is not weight:
        # torch deprecates these ops (since 1.x) but they are fbgemm's one int8 GEMM on plain tensors; each warns once
        # a process, here rather than in the middle of a step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            packed = torch.fbgemm_pack_quantized_matrix(weight)
            prepared = (packed, weight.sum(1, dtype=torch.int32), torch.zeros(weight.shape[0]))
            torch.fbgemm_linear_int8_weight_fp32_activation(
                torch.zeros(1, weight.shape[1]), weight, *prepared[:2], 1.0, 0, prepared[2]
            )
        held = _fbgemm_weights[key] = (weakref.ref(weight, lambda _: _fbgemm_weights.pop(key, None)), prepared)
    return held[1]


# fbgemm's int8 GEMM of a float input (N, K) by an int8 weight at scale 1: fbgemm rounds the whole input to uint8 with
# one scale and zero point from its minimum and maximum (w8a8's `int8_sums` pins them so that its sums come out exact).
# A library op with one CPU kernel rather than torch.library.custom_op: a step calls it once per linear layer (211 for
# SmolLM2) and custom_op's Python wrapping costs about 25 us a call, a Library op's 14 (docs/engines.md, "w8a8 on AVX2")
_fbgemm_library = torch.library.Library("medusa", "FRAGMENT")
_fbgemm_library.define("fbgemm_sums(Tensor pinned, Tensor weight) -> Tensor")


def _fbgemm_sums(pinned: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    packed, row_sums, zero = fbgemm_weight(weight)
    return torch.fbgemm_linear_int8_weight_fp32_activation(pinned, weight, packed, row_sums, 1.0, 0, zero)


_fbgemm_library.impl("fbgemm_sums", _fbgemm_sums, "CPU")


@torch.library.register_fake("medusa::fbgemm_sums")
def _(pinned, weight):
    return pinned.new_empty(pinned.shape[0], weight.shape[0])


def dequantizing_pays(rows: int, dtype: torch.dtype, least_rows: int = 0) -> bool:
    """Whether a float GEMM over the int8 weights converted to the activations' dtype beats aten's weight-only kernel
    for `rows` rows (a prompt): from 32 rows of bf16 activations, from 64 of fp32 ones on a CPU that emulates bf16
    (the kernel's arithmetic there); never for fewer rows or elsewhere (docs/engines.md). `least_rows`: a higher
    floor, for weights whose conversion costs more (int4's unpacking)."""
    if dtype == torch.bfloat16:
        return rows >= max(32, least_rows)
    return dtype == torch.float32 and rows >= max(64, least_rows) and not native_bf16()


def int8_linear(x: torch.Tensor, quantized: torch.Tensor, scales: torch.Tensor, bias=None) -> torch.Tensor:
    """x (..., in) @ (quantized * scales).T + bias -> (..., out) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    # a compiled graph keeps the int8 op (and tests no shapes)
    if not torch.compiler.is_compiling() and dequantizing_pays(rows.shape[0], x.dtype):
        out = (rows @ quantized.to(x.dtype).T) * scales.to(x.dtype)
    else:
        out = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), quantized, scales).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], quantized.shape[0])


# Children of one module that the model calls on the same tensor (llama, qwen2, gemma, mistral... attention and MLP).
FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Int8Weight:
    """A float weight (out, in) as int8 levels with one scale per output row, for what proposes (never for the
    target): on fbgemm's int8 GEMM where torch has it, its input rounded to uint8 as a whole with fbgemm's own scale
    (one call; two to four times faster than aten's weight-only kernel at the heads' shapes, docs/engines.md), else
    on aten's weight-only kernel and bf16 activations (`int8_linear`)."""

    quantized: torch.Tensor  # (out, in) int8
    scales: torch.Tensor  # (out,) float32 for fbgemm, else bf16 (aten's kernel)
    fbgemm: bool

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8Weight:
        fbgemm = fbgemm_available(weight.device)
        quantized, scales = quantize_int8(weight, FBGEMM_WEIGHT_TOP if fbgemm else 127)
        return cls(quantized, scales.float() if fbgemm else scales, fbgemm)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) @ (quantized * scales).T + bias -> (..., out) in x's dtype."""
        if not self.fbgemm:
            return int8_linear(x, self.quantized, self.scales, bias)
        rows = x.reshape(-1, x.shape[-1]).float()
        out = torch.ops.medusa.fbgemm_sums(rows, self.quantized) * self.scales
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.quantized.shape[0])


class PreparedLinear(nn.Module):
    """nn.Linear computed from a form of its weight prepared once (`prepare`: packed, quantized). The weight itself
    stays shared with the original layer; an in-place change to it (training, load_state_dict) is noticed through its
    version counter and the weight prepared again."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.prepare()

    def prepare(self) -> None:
        self.prepared_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a traced graph takes the weights as prepared (the check would break it at every linear and recompile)
        if not torch.compiler.is_compiling() and self.weight._version != self.prepared_version:
            self.prepare()
        return self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(PreparedLinear):
    """nn.Linear whose weight is used pre-packed for oneDNN."""

    def prepare(self) -> None:
        self.packed = pack(self.weight)
        super().prepare()

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.out_features, self.bias)


class OneDNNLinear(nn.Module):
    """nn.Linear computed by oneDNN on its own weight, not packed (nothing copied, so nothing to prepare again)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.out_features, self.bias)


class Int8Linear(PreparedLinear):
    """nn.Linear computed on int8 weights (Int8Weight): for what proposes, never for the target."""

    def prepare(self) -> None:
        self.int8 = Int8Weight.of(self.weight)
        super().prepare()

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8.linear(x, self.bias)


class FusedProjections:
    """Several nn.Linear layers over the same input packed as one weight. The first member called with a tensor
    computes every member's output; each other member called with that same tensor takes its slice, once."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.input, self.outputs, self.unserved = None, (), set()
        self._pack()

    def _versions(self) -> list[int]:
        return [linear.weight._version for linear in self.linears]

    def _pack(self) -> None:
        self.packed = pack(torch.cat([linear.weight for linear in self.linears]))
        biases = [linear.bias for linear in self.linears]
        self.bias = None if biases[0] is None else torch.cat(biases).detach()
        self.packed_versions = self._versions()

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output over `x`, side by side."""
        if self._versions() != self.packed_versions:
            self._pack()
        return packed_linear(x, self.packed, sum(self.sizes), self.bias)

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        if x is not self.input or member not in self.unserved:
            out = self.compute(x)
            self.input, self.outputs, self.unserved = x, out.split(self.sizes, dim=-1), set(range(len(self.sizes)))
        self.unserved.discard(member)
        result = self.outputs[member]
        if not self.unserved:  # every member served: hold no tensors between forwards
            self.input, self.outputs = None, ()
        return result


class FusedMember(nn.Module):
    """One layer of a FusedProjections group, in its original place in the model."""

    def __init__(self, group: FusedProjections, member: int):
        super().__init__()
        linear = group.linears[member]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.group, self.member = group, member

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.member)


def fuse_siblings(module: nn.Module, fuse, skipped: frozenset[int] | set[int] = frozenset()) -> None:
    """Replace each FUSABLE set of `module`'s sibling nn.Linear layers (one input width and dtype, all with a bias or
    none, none of them in `skipped`) with `fuse(linears)`'s members, each in its layer's place; `fuse` returns None
    to leave a set as it is."""
    for names in FUSABLE:
        linears = [getattr(module, name, None) for name in names]
        if not all(type(linear) is nn.Linear and id(linear) not in skipped for linear in linears):
            continue
        if len({(linear.in_features, linear.weight.dtype, linear.bias is None) for linear in linears}) != 1:
            continue
        members = fuse(linears)
        for name, member in zip(names, members or ()):
            setattr(module, name, member)


def _prepacked_members(linears: list[nn.Linear]) -> list[FusedMember]:
    group = FusedProjections(linears)
    return [FusedMember(group, member) for member in range(len(linears))]


def _copy_sharing(model: nn.Module, skip: tuple[str, ...]) -> tuple[nn.Module, set[int]]:
    """A copy of `model` sharing every parameter and buffer, and the ids of its modules under children named in
    `skip`."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    copied = copy.deepcopy(model, shared)
    skipped = {id(m) for name, child in copied.named_children() if name in skip for m in child.modules()}
    return copied, skipped


def replace_children(model: nn.Module, replacement) -> nn.Module:
    """Swap, in place, every module inside `model` for `replacement(module)` where that is not None. -> model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(module, name, new)
    return model


def attention_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` sharing every parameter and buffer, on `shared_gqa_sdpa` if it is on transformers' sdpa."""
    copied, _ = _copy_sharing(model, ())
    use_shared_gqa_sdpa(copied)
    return copied


def onednn_copy(model: nn.Module) -> nn.Module:
    """`attention_copy` of `model` whose nn.Linear layers run on oneDNN (OneDNNLinear) where their weights are plain
    and `can_prepack` allows them: for prompts, run eagerly."""

    def on_onednn(child: nn.Module) -> nn.Module | None:
        plain = type(child) is nn.Linear and plain_weights(child)
        return OneDNNLinear(child) if plain and can_prepack(child.weight.device, child.weight.dtype) else None

    return replace_children(attention_copy(model), on_onednn)


def prepacked_copy(model: nn.Module, skip: tuple[str, ...] = (), fuse: bool = True) -> nn.Module:
    """A copy of `model` whose nn.Linear layers are packed (except those under a child named in `skip`): sibling
    projections of one input fused (FUSABLE; not with `fuse=False`), the others PackedLinear. Every parameter and
    buffer is shared, not copied. A model on transformers' sdpa attention gets `shared_gqa_sdpa`."""
    packed, skipped = _copy_sharing(model, skip)
    if fuse:
        for module in list(packed.modules()):
            fuse_siblings(module, _prepacked_members, skipped)
    replace_children(packed, lambda m: PackedLinear(m) if type(m) is nn.Linear and id(m) not in skipped else None)
    use_shared_gqa_sdpa(packed)
    return packed


def int8_copy(model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """A copy of `model` (parameters and buffers shared) whose nn.Linear layers outside `skip` compute on int8
    weights (Int8Linear) where `can_int8` allows, else pre-packed where `can_prepack` does: for proposing only."""
    quantized, skipped = _copy_sharing(model, skip)

    def proposing(child: nn.Module) -> nn.Module | None:
        if type(child) is not nn.Linear or id(child) in skipped:
            return None
        if can_int8(child.weight.device, child.in_features):
            return Int8Linear(child)
        return PackedLinear(child) if can_prepack(child.weight.device, child.weight.dtype) else None

    return replace_children(quantized, proposing)
