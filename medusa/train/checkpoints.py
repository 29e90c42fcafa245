"""Checkpoints through accelerate: `save_state` / `load_state` write and restore the trainable weights (safetensors),
AdamW, the schedule, every process's random state and the run's counters (RunState); ProjectConfiguration numbers
them (checkpoints/checkpoint_N) and keeps the newest `training.keep_checkpoints`.

Data order needs no state of its own: StepPlan is a pure function of (seed, step). A checkpoint is complete once
trainer_state.json (written last) is there; a resumption reads only complete ones and checks that the run that
wrote it is the run being resumed (its snapshot).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors import safe_open

from medusa.fileio import atomic_write_text
from medusa.train.config import Config, TrainingConfig

STATE_NAME = "trainer_state.json"  # written last: marks a checkpoint complete
# Fields that may change between a checkpoint and its resumption; every other setting must match.
RESUMABLE_CHANGES = {
    "output_dir",
    "checkpoint_dir",
    "cache_dir",
    "eval_every",
    "log_every",
    "save_every",
    "keep_checkpoints",
    "report_to",
    "wandb_project",
    "run_name",
    "precompute_batch_tokens",
}


@dataclass
class RunState:
    """The loop's counters, saved with every checkpoint (accelerate's register_for_checkpointing)."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # response tokens through the heads, all processes
    elapsed_s: float = 0.0  # training time before this invocation
    eval_history: list[dict] = field(default_factory=list)  # {"step": s, "eval/head0/top1": ..., ...}

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.__init__(**state)


def checkpoint_root(cfg: TrainingConfig) -> Path:
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path("runs") / "checkpoints" / Path(cfg.output_dir).name


def project_configuration(cfg: TrainingConfig):
    from accelerate.utils import ProjectConfiguration

    return ProjectConfiguration(
        project_dir=str(checkpoint_root(cfg)), automatic_checkpoint_naming=True, total_limit=cfg.keep_checkpoints
    )


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    found = [p for p in (root / "checkpoints").glob("checkpoint_*") if (p / STATE_NAME).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def check_resume(root: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None: a fresh run); refuses --resume without one and a fresh run over one."""
    found = checkpoints(root)
    if resume and not found:
        raise FileNotFoundError(f"--resume: no checkpoint in {root}; drop --resume to start a fresh run")
    if not resume and found:
        raise FileExistsError(
            f"{root} holds checkpoints of an earlier run: pass --resume to continue it, or delete "
            "them / set training.checkpoint_dir to start afresh"
        )
    return found[-1] if found else None


def trainable_names(trainer) -> set[str]:
    """The names of the weights that train (heads, LoRA): what a checkpoint holds, the frozen base left out."""
    return {n for n, p in trainer.named_parameters() if p.requires_grad}


def save_trainable_only(trainer):
    """A save_state pre-hook: keep the weights that train (heads, LoRA), not the frozen base in the same module."""
    names = trainable_names(trainer)

    def hook(models, weights, output_dir):
        for i, model in enumerate(models):
            if model is trainer:
                weights[i] = {k: v for k, v in weights[i].items() if k in names}

    return hook


def check_trainable(trainer):
    """A load_state pre-hook: the checkpoint must hold exactly the weights this run trains (load_state then loads
    with strict=False, the frozen weights not being in the file)."""
    names = trainable_names(trainer)

    def hook(models, input_dir):
        path = Path(input_dir) / "model.safetensors"
        with safe_open(str(path), framework="pt") as f:
            saved = set(f.keys())
        if saved != names:
            raise ValueError(
                f"checkpoint {input_dir} holds other trainable weights than this run builds (different "
                "heads, projection or LoRA settings): resume with the settings it was written with"
            )

    return hook


def save(accelerator, step: int, snapshot: dict, sharded=None) -> None:
    """`sharded`: (trainer, optimizer) under training.shard fsdp, which accelerate does not hold: saved whole here."""
    accelerator.wait_for_everyone()
    path = Path(accelerator.save_state())
    if sharded is not None:
        from medusa.train.sharding import save_checkpoint

        save_checkpoint(*sharded, path, accelerator.is_main_process)
    if accelerator.is_main_process:
        atomic_write_text(path / STATE_NAME, json.dumps({"step": step, "snapshot": snapshot}, indent=2))
    accelerator.wait_for_everyone()


def resume(accelerator, path: Path, snapshot: dict, sharded=None) -> None:
    """Restore everything registered with `accelerator` (and `sharded`, as in `save`) from `path`, after checking
    the run is the same."""
    check_snapshot(path, json.loads((path / STATE_NAME).read_text())["snapshot"], snapshot)
    if accelerator.is_main_process:  # a save a kill interrupted after `path`: its number is the next save's
        for newer in (path.parent).glob("checkpoint_*"):
            if int(newer.name.split("_")[1]) > int(path.name.split("_")[1]):
                shutil.rmtree(newer)
    accelerator.wait_for_everyone()
    accelerator.load_state(str(path), strict=False)
    if sharded is not None:
        from medusa.train.sharding import load_checkpoint

        load_checkpoint(*sharded, path)
    accelerator.project_configuration.iteration = int(path.name.split("_")[1]) + 1


def run_snapshot(cfg: Config, data_key: str, base_ref, world: int) -> dict:
    """Everything that decides the training trajectory: a checkpoint resumes only under the same snapshot."""
    training = {k: v for k, v in asdict(cfg.training).items() if k not in RESUMABLE_CHANGES}
    return {"heads": asdict(cfg.heads), "training": training, "data": data_key, "base": base_ref, "processes": world}


def check_snapshot(path: Path, saved: dict, current: dict) -> None:
    current = json.loads(json.dumps(current))  # as saved: tuples become lists
    diffs = []
    for section in current:
        a, b = saved.get(section), current[section]
        if isinstance(b, dict) and isinstance(a, dict):
            diffs += [
                f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            ]
        elif a != b:
            diffs.append(f"{section}: {a!r} -> {b!r}")
    if diffs:
        raise ValueError(
            f"cannot resume from {path}: the run changed ({'; '.join(diffs)}). Resume with the settings "
            "it was written with, or start afresh with another training.checkpoint_dir"
        )


def check_writable(directory: Path) -> None:
    """Create `directory` if needed and write (then remove) a file in it; a clear error naming it otherwise."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".medusa-write-check-"):
            pass
    except OSError as err:
        raise PermissionError(
            f"cannot write to {directory} ({err.strerror or err}): choose a writable "
            "training.output_dir / training.checkpoint_dir"
        ) from err
