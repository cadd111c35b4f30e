"""``deinfer serve``: the engine behind an OpenAI-compatible HTTP server (FastAPI on
uvicorn). SIGTERM or Ctrl-C stops accepting, lets running requests finish for
``--shutdown-timeout`` seconds, aborts the rest, stops the ranks and exits 0."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator

from codegen.cli.engine_options import add_engine_arguments, open_engine

DEFAULT_MAX_QUEUE = 256  # requests waiting beyond the running batch before a 503
SWITCH_INTERVAL_S = 0.0005


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: spec name)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests admitted beyond the running batch; more get 503",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish after SIGTERM/SIGINT",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=run)


@contextlib.contextmanager
def _signals_handled_by_server() -> Iterator[None]:
    """uvicorn turns SIGTERM/SIGINT into a graceful shutdown and re-raises the signal
    once it is done; by then the shutdown has happened, so the re-raise must not turn
    into an exit status or a KeyboardInterrupt traceback."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dsl.errors import UserError
    from runtime.serve.app import build_app
    from runtime.serve.engine_loop import EngineLoop
    from runtime.serve.metrics import ServerMetrics

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0 to 65535, found {args.port}")
    if args.max_queue < 0 or args.shutdown_timeout < 0:
        raise UserError("--max-queue and --shutdown-timeout must not be negative")
    start = time.perf_counter()
    with open_engine(args) as llm:
        name = args.served_model_name or llm.spec.name
        max_in_flight = llm.spec.runtime.max_batch_size + args.max_queue
        engine = EngineLoop(llm, ServerMetrics(), max_in_flight)
        app = build_app(llm, engine, name)
        print(
            f"loaded in {time.perf_counter() - start:.1f} s: model {name!r}, tp "
            f"{llm.spec.parallel.tp}, {llm.describe_path()}, {llm.blocks.num_blocks} KV blocks",
            file=sys.stderr,
            flush=True,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=args.access_log,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
        server = uvicorn.Server(config)
        # The event loop (HTTP, JSON, SSE) and the engine thread share the GIL; at the
        # default 5 ms switch interval each token waited for the loop's turn to end.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        with _signals_handled_by_server():
            server.run()
        if not server.started:
            return 1  # uvicorn said why (e.g. the port is taken)
    print("deinfer serve: stopped", file=sys.stderr)
    return 0
