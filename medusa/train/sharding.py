"""training.shard fsdp: the trainer sharded with torch's FSDP2 (`fully_shard`), applied here rather than by
accelerate's plugin, because accelerate 1.x enables FSDP on accelerator devices only and one code path then serves
CPU (gloo) and GPU alike. Checkpoints and the output hold whole tensors, gathered to the main process: the same
files as a single-process run."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.fileio import atomic_file
from medusa.train.checkpoints import trainable_names

OPTIMIZER_NAME = "optimizer.bin"  # accelerate's name; the state is keyed by parameter name (whole tensors)
MODEL_NAME = "model.safetensors"  # accelerate's name: what check_trainable reads


def shard_trainer(trainer: nn.Module, device: torch.device) -> None:
    """Shard each decoder layer of the trainer's base (its `_no_split_modules` classes), then the rest at the root.
    The root group holds the heads, embeddings and lm_head: its parameters are gathered for the whole forward, so
    the fused loss reads the lm_head weight as a plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if trainer.base is not None:
        layer_classes = set(getattr(_transformers_model(trainer.base), "_no_split_modules", None) or ())
        for module in trainer.base.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh)
    fully_shard(trainer, mesh=mesh)


def _transformers_model(base: nn.Module) -> nn.Module:
    get_base = getattr(base, "get_base_model", None)  # peft's wrapper (Medusa-2)
    return get_base() if get_base is not None else base


def full_trainable_state(trainer: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights (and the heads' buffers), whole, on the CPU. Collective: every process calls it."""
    from torch.distributed.tensor import DTensor

    names = trainable_names(trainer)
    state = {}
    for name, tensor in trainer.state_dict().items():
        if name in names or name.startswith("heads."):
            state[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
    return state


def save_checkpoint(trainer: nn.Module, optimizer, directory: Path, main: bool) -> None:
    """The trainable weights (safetensors) and AdamW's state, whole, into `directory` (written by the main process).
    Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    names = trainable_names(trainer)
    weights = {k: v.contiguous() for k, v in full_trainable_state(trainer).items() if k in names}
    optim = get_optimizer_state_dict(
        trainer, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if main:
        with atomic_file(directory / MODEL_NAME) as tmp:
            save_file(weights, str(tmp))
        with atomic_file(directory / OPTIMIZER_NAME) as tmp:
            torch.save(optim, tmp)


def load_checkpoint(trainer: nn.Module, optimizer, directory: Path) -> None:
    """Back from `save_checkpoint`: each process reads the whole tensors and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        trainer,
        optimizer,
        model_state_dict=load_file(str(directory / MODEL_NAME)),
        optim_state_dict=torch.load(directory / OPTIMIZER_NAME, weights_only=True),
        options=StateDictOptions(full_state_dict=True, strict=False),  # the frozen base is not in the file
    )
