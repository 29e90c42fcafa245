"""Weight-only quantised targets: precision as the user's choice. An int8 target is another model than the float one
(it says other things); speculative decoding on it is exact relative to plain decoding of that same int8 target.

int8: every linear layer whose input width aten's kernel takes (a multiple of INT8_BLOCK) holds int8 weights with one
scale per output row (symmetric, rounded to nearest) and computes with aten's weight-only int8 kernel on bf16
activations; inductor lowers the same op to its C++ weight-only template when the inductor engine compiles the
target. Embeddings and norms stay in the activations' dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa.runtime.prepack import INT8_BLOCK, can_int8, int8_linear, quantize_int8

QUANTIZED = ("int8",)


class Int8WeightLinear(nn.Module):
    """A linear layer of an int8 target. `weight` (what heads sharing the target's projection read) is the float
    matrix for a layer tied to the input embeddings (held by them anyway), else the int8 one dequantised on read."""

    def __init__(self, linear: nn.Linear, tied: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        quantized, scales = quantize_int8(linear.weight)
        self.register_buffer("weight_int8", quantized)
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        self._tied = [tied]  # in a list: not registered, so never saved, exported or counted as a parameter

    @property
    def weight(self) -> torch.Tensor:
        tied = self._tied[0]
        if tied is not None:
            return tied
        return (self.weight_int8.float() * self.scales.float()[:, None]).to(self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight_int8, self.scales, self.bias)


def quantize_target(model: nn.Module, precision: str) -> nn.Module:
    """`model` with its linear layers in `precision` (one of QUANTIZED), in place. -> model."""
    if precision not in QUANTIZED:
        raise ValueError(f"unknown weight-only precision {precision!r}: use one of {list(QUANTIZED)}")
    device = next(model.parameters()).device
    if not can_int8(device, INT8_BLOCK):
        raise ValueError(
            f"an int8 target needs aten's weight-only int8 kernel on a CPU; this is {device.type}: "
            "use dtype='bfloat16' on a GPU"
        )
    embeddings = model.get_input_embeddings().weight
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and can_int8(device, child.in_features):
                tied = embeddings if child.weight is embeddings else None
                setattr(module, name, Int8WeightLinear(child, tied))
    model.medusa_precision = precision  # what plans and packages are keyed on
    return model


def precision_of(model: nn.Module) -> str:
    """What the user chose for `model`: a weight-only precision, else its dtype's name (float32, bfloat16...)."""
    return getattr(model, "medusa_precision", None) or str(model.dtype).replace("torch.", "")
