"""The `medusa` command: `medusa <command> [options]`; `medusa <command> --help` for each."""

from __future__ import annotations

import importlib
import sys

# command -> (module with main(argv), what it does); imported only when run, so `medusa --help` stays fast
COMMANDS = {
    "chat": ("medusa.cli.chat", "streaming chat in the terminal (or from a pipe), tokens/s and tau per answer"),
    "calibrate": ("medusa.cli.calibrate", "measure this machine and choose the decoding plan (cached)"),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<10} {what}" for name, (_, what) in COMMANDS.items())
        usage = f"usage: medusa <command> [options]\n\ncommands:\n{lines}"
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"{usage}\nmedusa: unknown command {argv[0]!r}")
        print(usage)
        return
    module, _ = COMMANDS[argv[0]]
    importlib.import_module(module).main(argv[1:])
