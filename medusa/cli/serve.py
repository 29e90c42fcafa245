"""`medusa serve`: an OpenAI-compatible HTTP server (chat and text completions, streamed or not) around one model.

    medusa serve [--heads DIR] [--base PATH] [--dtype float32] [--engine NAME] [--host 127.0.0.1] [--port 8000]
                 [--model-name NAME] [--max-batch 16] [--steady [--chunk 4] [--rate TOK_S]]

Requests are decoded in arrival order, by continuous batching: streamed or not, greedy or sampled, they decode in one
running batch that new ones join between steps, up to --max-batch rows (seeded ones alone: medusa/serve.py).
`--steady` paces streams as `medusa chat --steady` does (see medusa/cli/chat.py for why). What is supported and
refused: docs/serving.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from medusa.cli import NO_HEADS_HELP, load_model
from medusa.plan import calibrate_batches
from medusa.precision import PRECISIONS
from medusa.runtime import ENGINES

INSTALL = "pip install 'medusa-spec[serve]'"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="medusa serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--heads", default=None, help=f"heads directory or Hub id (default: the shipped heads); {NO_HEADS_HELP}"
    )
    parser.add_argument("--base", default=None, help="base model (default: the one the heads name)")
    parser.add_argument("--dtype", default=None, choices=PRECISIONS, help="the target's precision (default: float32)")
    parser.add_argument("--device", default=None, help="e.g. cuda (default: CPU)")
    parser.add_argument(
        "--engine", default=None, choices=list(ENGINES), help="how the target runs (default: the plan's choice)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", default=None, help="the model's id in the API (default: the base's name)")
    parser.add_argument(
        "--max-batch", type=int, default=16, help="the most requests decoded together (1: one at a time)"
    )
    parser.add_argument("--steady", action="store_true", help="stream at a constant pace in fixed-size chunks")
    parser.add_argument("--chunk", type=int, default=4, help="tokens per chunk with --steady")
    parser.add_argument(
        "--rate", type=float, default=None, help="tokens/s with --steady (default: the plan's plain decoding rate)"
    )
    args = parser.parse_args(argv)
    if args.chunk < 1 or (args.rate is not None and args.rate <= 0):
        parser.error("--chunk must be >= 1 and --rate > 0")
    if args.max_batch < 1:
        parser.error("--max-batch must be >= 1 (1: one request at a time)")
    try:  # before the model loads (seconds to minutes)
        import uvicorn

        from medusa.serve import MainThreadWorker, create_app
    except ImportError as error:
        sys.exit(f"medusa serve needs fastapi and uvicorn ({error.name or error} is missing): {INSTALL}")

    model = load_model(args.heads, base=args.base, dtype=args.dtype, device=args.device, engine=args.engine)
    model.engine().warm_up(batches=True)  # the batch package too: every request decodes in a batch, the first as well
    calibrate_batches(model, args.max_batch)  # the plan's batch layouts, once per machine: not while requests wait
    name = args.model_name or args.base or model.config.base_model_name_or_path or "medusa"
    worker = MainThreadWorker()  # the model decodes on this thread, where it was loaded (medusa/serve.py says why)
    app = create_app(
        model,
        model_name=name,
        steady=args.steady,
        chunk=args.chunk,
        rate=args.rate,
        max_batch=args.max_batch,
        worker=worker,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port))

    def stop(signum, frame):  # as uvicorn's own handlers, which it installs only on the main thread: the first
        # SIGINT or SIGTERM finishes the requests in flight and stops, the second stops at once
        server.force_exit = server.should_exit
        server.should_exit = True

    before = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=server.run, name="medusa-http", daemon=True)
    thread.start()
    try:
        worker.run_until(lambda: not thread.is_alive())
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    if not server.started:  # as uvicorn.run: a port in use, say (uvicorn logged why)
        sys.exit(f"medusa serve: the server did not start on {args.host}:{args.port} (the reason is logged above)")
