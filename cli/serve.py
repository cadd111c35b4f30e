"""``deinfer serve``: the engine behind an OpenAI-compatible HTTP server (FastAPI on
uvicorn). The port is taken before the model loads (a busy port fails in a second, not
after the load). SIGTERM or Ctrl-C stops accepting, lets running requests finish for
``--shutdown-timeout`` seconds, then ends the rest with finish reason "abort" (each
stream gets its last event and ``[DONE]``), stops the ranks and exits 0. If the engine
dies (a rank killed, hung), the cause is logged and the server exits 1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Iterator

from cli.engine_options import add_engine_arguments, follow_rank0, open_engine, tuned_note

DEFAULT_MAX_QUEUE = 256  # requests waiting beyond the running batch before a 503
SWITCH_INTERVAL_S = 0.0005
# After the shutdown grace the open streams are ended as "abort"; this long more lets
# them send their last events before uvicorn cancels whatever is still running.
ABORT_DRAIN_S = 5.0


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
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted; larger ones get 413 before they are read "
        "(default 4 MiB)",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=run)


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before anything else starts: a second
    server on a busy port fails here, in one line, instead of after loading a model."""
    from dsl.errors import UserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _log_to_stderr() -> None:
    """The engine's and the server's own messages, beside uvicorn's, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("deinfer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


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


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server whose graceful shutdown, once ``grace_s`` is up, ends the
        requests still running with finish reason "abort" instead of cancelling their
        tasks mid-body (which cut streams with no last event and logged tracebacks)."""

        def __init__(self, config: uvicorn.Config, abort_all, grace_s: float) -> None:
            super().__init__(config)
            self.abort_all, self.grace_s = abort_all, grace_s

        async def shutdown(self, sockets=None) -> None:
            timer = asyncio.get_running_loop().call_later(self.grace_s, self.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server


def _check_options(args: argparse.Namespace) -> None:
    from dsl.errors import UserError

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0 to 65535, found {args.port}")
    if args.max_queue < 0 or args.shutdown_timeout < 0:
        raise UserError("--max-queue and --shutdown-timeout must not be negative")
    if args.max_body_bytes is not None and args.max_body_bytes < 1024:
        raise UserError(f"--max-body-bytes must be at least 1024, found {args.max_body_bytes}")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dsl.errors import RuntimeFailure
    from runtime.serve.app import build_app
    from runtime.serve.body import DEFAULT_MAX_BODY_BYTES
    from runtime.serve.engine_loop import EngineLoop
    from runtime.serve.metrics import ServerMetrics

    _check_options(args)
    _log_to_stderr()
    if follow_rank0(args):  # rank 0 serves HTTP; this rank runs its calls
        return 0
    sock = _listening_socket(args.host, args.port)
    start = time.perf_counter()
    failure: list[str] = []
    with sock, open_engine(args) as llm:
        name = args.served_model_name or llm.spec.name
        max_in_flight = llm.spec.runtime.max_batch_size + args.max_queue

        def fatal(reason: str) -> None:
            failure.append(reason)
            server.should_exit = True

        engine = EngineLoop(llm, ServerMetrics(), max_in_flight, on_fatal=fatal)
        app = build_app(llm, engine, name, args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        print(
            f"loaded in {time.perf_counter() - start:.1f} s{tuned_note(llm)}: model {name!r}, tp "
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
            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_DRAIN_S,
        )
        server = _server_class()(config, engine.abort_all, args.shutdown_timeout)
        # The event loop (HTTP, JSON, SSE) and the engine thread share the GIL; at the
        # default 5 ms switch interval each token waited for the loop's turn to end.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        with _signals_handled_by_server():
            server.run(sockets=[sock])
        if failure:
            raise RuntimeFailure(f"the server stopped: {failure[0]}")
        if not server.started:
            return 1  # uvicorn said why
    print("deinfer serve: stopped", file=sys.stderr)
    return 0
