"""The `medusa` command: `medusa <command> [options]`; `medusa <command> --help` for each."""

from __future__ import annotations

import sys

# --heads none: a base with no heads of its own (untrained heads: its plan guesses with prompt lookup)
NO_HEADS = "none"
NO_HEADS_HELP = f"'{NO_HEADS}': a base (--base) with no heads of its own, guessing with prompt lookup"


def load_model(heads: str | None, **options):
    """--heads and the loading options -> a MedusaModel: the heads on their base (or `base`), or untrained heads on
    `base` for --heads none (MedusaModel.from_base: its plan guesses with prompt lookup)."""
    from medusa import MedusaModel

    if heads == NO_HEADS:
        return MedusaModel.from_base(options.pop("base", None), **options)
    return MedusaModel.from_pretrained(heads, **options)


# Each command's module is imported only when it runs, so `medusa --help` does not load torch.
def _chat(argv):
    from medusa.cli import chat

    chat.main(argv)


def _calibrate(argv):
    from medusa.cli import calibrate

    calibrate.main(argv)


def _export(argv):
    from medusa.cli import export

    export.main(argv)


def _bench(argv):
    from medusa.cli import bench

    bench.main(argv)


def _accuracy(argv):
    from medusa.cli import accuracy

    accuracy.main(argv)


def _serve(argv):
    from medusa.cli import serve

    serve.main(argv)


TRAIN_EXTRA = ("accelerate", "datasets", "peft", "draccus")  # what `pip install 'medusa-spec[train]'` brings


def _needs_train_extra() -> None:
    """Training's dependencies are an extra: name it before any work starts, not at the first missing import."""
    import importlib.util

    missing = [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"training needs {', '.join(missing)}: pip install 'medusa-spec[train]'")


def _train(argv):
    _needs_train_extra()
    from medusa.train import train

    train.main(argv)


def _generate_data(argv):
    _needs_train_extra()
    from medusa.train import generate_data

    generate_data.main(argv)


COMMANDS = {  # command -> (its main(argv), what it does)
    "chat": (_chat, "streaming chat in the terminal (or from a pipe), tokens/s and tau per answer"),
    "bench": (_bench, "Spec-Bench style speed benchmark: methods interleaved per question, summary and plot"),
    "accuracy": (_accuracy, "per-head, per-rank accuracy of the heads on the target's own answers to a question file"),
    "calibrate": (_calibrate, "measure this machine and choose the decoding plan (cached)"),
    "export": (
        _export,
        "write heads in the official Medusa / TGI or the vLLM layout, or an EAGLE-3 draft (vLLM, OpenVINO)",
    ),
    "serve": (_serve, "an OpenAI-compatible HTTP server (chat and text completions, streamed or not)"),
    "generate-data": (_generate_data, "self-distilled training data: the target answers prompts (resumable)"),
    "train": (_train, "train heads or an EAGLE-3 draft (accelerate launch -m medusa.train for several processes)"),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<14} {what}" for name, (_, what) in COMMANDS.items())
        usage = f"usage: medusa <command> [options]\n\ncommands:\n{lines}"
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"{usage}\nmedusa: unknown command {argv[0]!r}")
        print(usage)
        return
    run, _ = COMMANDS[argv[0]]
    run(argv[1:])
