"""Memory of training Medusa-2 (LoRA base + heads) per configuration, computed on the meta device (no weights, no
compute, no Hub access): the table in docs/training.md ("Memory").

    python scripts/training_memory.py                    # SmolLM2-135M, Llama-3-8B- and 70B-shaped, 2,048 tokens
    python scripts/training_memory.py --tokens 4096 --lora-r 16 --heads 4 --shapes Llama-3-8B
    python scripts/training_memory.py --shapes SmolLM2-135M --measure   # and measured here, one process each

For each shape the base is built on the meta device, LoRA-adapted by peft and run forward over `--tokens` tokens
with medusa's own training forward (HeadTrainer: heads, fused loss); the activation bytes are those of every tensor
autograd keeps for backward (saved-tensor hooks, once per storage), with and without transformers' gradient
checkpointing. Weights, gradients and AdamW states are counted from the parameters: trainable ones (LoRA, heads) in
fp32 with fp32 gradients and two fp32 AdamW moments; the frozen base in fp32, bf16, or int8 (torchao weight-only: int8
decoder weights plus one scale per output row, embeddings and lm_head in bf16). The FSDP row divides weights,
gradients and optimizer states by 2 and keeps the activations (each process runs its own batch): what train.py's
training.shard fsdp brings (tested over 2 CPU processes), computed here (--measure runs it in 2 gloo processes).
Transients (one chunk of logits, the KL reference's forward under no_grad, allocator slack) are not counted.

--measure runs each configuration for real on this CPU (Linux; random weights, a process each, two gloo processes
sharded as training.shard fsdp shards for the FSDP row) and prints each process's resident memory once the trainer is
built and its peak during one training step (the kernel's high-water mark, reset before the step): what the computed
table leaves out shows there.
"""

from __future__ import annotations

import argparse

import torch
import transformers.masking_utils
from transformers import AutoModelForCausalLM, LlamaConfig

from medusa.runtime import meta_nonzero_takes_all

SHAPES = {  # hand-written: the published configs' sizes (no Hub access)
    "SmolLM2-135M": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "Llama-3-8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "Llama-3-70B": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),  # fmt: skip
}
GIB = 1024**3


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd keeps for backward of `step()`'s graph, parameters left out."""
    kept: dict[int, int] = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            kept[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()  # (meta storages have sizes)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = step()
    del out
    return sum(kept.values())


def build(shape: dict, lora_r: int, num_heads: int, checkpointing: bool, dtype: torch.dtype, device="meta", int8=False):
    """-> (HeadTrainer on `device` (random weights), frozen base parameters by kind) for a Llama of `shape`; `int8`:
    the decoder's linear layers in torchao weight-only int8, as training's model.quantize int8 holds them."""
    from peft import LoraConfig, get_peft_model

    from medusa.train.config import HeadsConfig, TrainingConfig
    from medusa.train.trainer import HeadTrainer, build_heads, enable_gradient_checkpointing

    config = LlamaConfig(**shape, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
        base.requires_grad_(False)
        if int8:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            quantize_(base.get_decoder(), Int8WeightOnlyConfig())
        if checkpointing:
            enable_gradient_checkpointing(base)
        frozen = {"decoder linear": 0, "decoder rows": 0, "embeddings + lm_head": 0, "norms": 0}
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name.startswith("model.layers"):
                frozen["decoder linear"] += module.weight.numel()
                frozen["decoder rows"] += module.weight.shape[0]
        frozen["embeddings + lm_head"] = sum(
            p.numel() for p in {base.get_input_embeddings().weight, base.get_output_embeddings().weight}
        )
        frozen["norms"] = sum(p.numel() for p in base.parameters()) - frozen["decoder linear"]
        frozen["norms"] -= frozen["embeddings + lm_head"]
        peft = get_peft_model(
            base, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", task_type="CAUSAL_LM")
        )
        cfg = TrainingConfig(medusa2=True, precompute_hidden=False, mixed_precision="no")
        heads = build_heads(
            HeadsConfig(num_heads=num_heads),
            shape["hidden_size"],
            shape["vocab_size"],
            base.get_output_embeddings(),
            None,
        )
        trainer = HeadTrainer(heads, base.get_output_embeddings(), cfg, base=peft).train()
    return trainer, frozen


CONFIGURATIONS = {  # label -> (base dtype, int8 decoder, gradient checkpointing, processes): the table's rows, and
    # what --measure runs (an int8 base computes on bf16 activations)
    "plain (fp32 base)": (torch.float32, False, False, 1),
    "gradient checkpointing": (torch.float32, False, True, 1),
    "bf16 base": (torch.bfloat16, False, False, 1),
    "int8 base": (torch.bfloat16, True, False, 1),
    "bf16 base + checkpointing": (torch.bfloat16, False, True, 1),
    "int8 base + checkpointing": (torch.bfloat16, True, True, 1),
    "FSDP over 2, bf16 + checkpointing": (torch.bfloat16, False, True, 2),
}


def rows(name: str, shape: dict, tokens: int, lora_r: int, num_heads: int) -> list[tuple]:
    # one unpadded sequence is never packed; transformers' check for packing reads values meta tensors do not have
    transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None
    ids = torch.zeros((1, tokens), dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}  # no attention mask: one unpadded sequence
    activations, trainable, frozen = {}, 0, {}
    for dtype in (torch.float32, torch.bfloat16):  # activations follow the base's dtype (int8: bf16)
        for checkpointing in (False, True):
            trainer, frozen = build(shape, lora_r, num_heads, checkpointing, dtype)
            trainable = sum(p.numel() for p in trainer.parameters() if p.requires_grad)
            activations[dtype, checkpointing] = saved_bytes(lambda: trainer(**batch)["loss"])  # noqa: B023
    base_bytes = {
        "fp32": 4 * sum(frozen.values()),
        "bf16": 2 * sum(frozen.values()),
        # torchao Int8WeightOnly: int8 weight + an fp32 scale and int8 zero point per output row
        "int8": frozen["decoder linear"]
        + 5 * frozen["decoder rows"]
        + 2 * (frozen["embeddings + lm_head"] + frozen["norms"]),
    }
    states = 16 * trainable  # fp32 weight + fp32 gradient + two fp32 AdamW moments (bf16 base: the same)
    table = []
    for label, (dtype, int8, checkpointing, shards) in CONFIGURATIONS.items():
        base = base_bytes["int8" if int8 else "fp32" if dtype == torch.float32 else "bf16"]
        act = activations[dtype, checkpointing]
        table.append((name, label, base / shards, states / shards, act, (base + states) / shards + act, trainable))
    return table


def _memory(field: str) -> int:
    """This process's VmRSS (resident now) or VmHWM (its peak since the last reset) in bytes (Linux)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _reset_peak() -> None:
    """Start VmHWM again from the resident memory now (Linux >= 4.0), so a step's peak is its own."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def measure_one(label: str, shape: dict, tokens: int, lora_r: int, num_heads: int, rank: int = 0) -> dict:
    """One configuration in this process, on the CPU with random weights: the resident memory once the trainer is
    built (and sharded over the process group where the configuration has 2 processes, as train.py's training.shard
    fsdp does), and the peak during one training step (forward and backward over one sequence of `tokens`, AdamW's
    step)."""
    dtype, int8, checkpointing, processes = CONFIGURATIONS[label]
    torch.manual_seed(0)
    trainer, _ = build(shape, lora_r, num_heads, checkpointing, dtype, device="cpu", int8=int8)
    if processes > 1:
        from medusa.train.sharding import shard_trainer

        shard_trainer(trainer, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=1e-4)
    torch.manual_seed(rank)  # each process its own sequence, as in training
    ids = torch.randint(0, shape["vocab_size"], (1, tokens))
    built = _memory("VmRSS")
    _reset_peak()
    trainer(input_ids=ids, loss_mask=torch.ones_like(ids))["loss"].backward()
    optimizer.step()
    return {"configuration": label, "built": built, "peak": _memory("VmHWM")}


def _measure_rank(rank: int, processes: int, port: int, args: tuple, results) -> None:
    """A process of a sharded measurement: joins a gloo group of `processes`, reports its own peaks."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(processes))
    torch.distributed.init_process_group("gloo")
    results.put(measure_one(*args, rank=rank))
    torch.distributed.destroy_process_group()


def measure_sharded(label: str, shape: dict, tokens: int, lora_r: int, num_heads: int) -> dict:
    """CONFIGURATIONS[label]'s processes, each measuring itself -> the largest peaks among them."""
    import socket

    import torch.multiprocessing as mp

    processes = CONFIGURATIONS[label][3]
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(
        _measure_rank,
        args=(processes, port, (label, shape, tokens, lora_r, num_heads), results),
        nprocs=processes,
        start_method="spawn",
    )
    each = [results.get() for _ in range(processes)]
    return {"configuration": label, **{key: max(r[key] for r in each) for key in ("built", "peak")}}


def measure(name: str, tokens: int, lora_r: int, num_heads: int) -> None:
    """Each configuration of CONFIGURATIONS in a process of its own (peak memory is per process), printed as a table."""
    import json
    import subprocess
    import sys

    print(f"\n{name}, measured on this CPU (random weights, resident memory per process, GiB; sharded: the")
    print("largest of the processes):\n")
    print("| configuration | built | peak of one step | growth (states + activations + transients) |")
    print("|---|---|---|---|")
    for label in CONFIGURATIONS:
        command = [sys.executable, __file__, "--measure-one", label, "--shapes", name, "--tokens", str(tokens)]
        command += ["--lora-r", str(lora_r), "--heads", str(num_heads)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        built, peak = result["built"] / GIB, result["peak"] / GIB
        print(f"| {label} | {built:.2f} | {peak:.2f} | {peak - built:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (one sequence)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--measure", action="store_true", help="also run each configuration here, on the CPU")
    # one measuring process (--measure starts one per configuration)
    parser.add_argument("--measure-one", choices=list(CONFIGURATIONS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_one:
        import json

        shape = SHAPES[args.shapes[0]]
        one = measure_sharded if CONFIGURATIONS[args.measure_one][3] > 1 else measure_one
        print(json.dumps(one(args.measure_one, shape, args.tokens, args.lora_r, args.heads)))
        return
    print(f"Medusa-2, LoRA r={args.lora_r} on every decoder linear layer, {args.heads} heads, {args.tokens} tokens")
    print("| base | configuration | base weights GiB | trainable + grads + AdamW GiB | activations GiB | total GiB |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        # the heads' loss selects the scored positions by a mask: on meta tensors, take them all
        with meta_nonzero_takes_all():
            table = rows(name, SHAPES[name], args.tokens, args.lora_r, args.heads)
        for row in table:
            _, label, base, states, act, total, trainable = row
            print(
                f"| {name} ({trainable / 1e6:.1f} M trainable) | {label} | {base / GIB:.2f} | {states / GIB:.2f} | "
                f"{act / GIB:.2f} | {total / GIB:.2f} |"
            )
    if args.measure:
        for name in args.shapes:
            measure(name, args.tokens, args.lora_r, args.heads)


if __name__ == "__main__":
    main()
