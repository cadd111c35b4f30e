"""The entry points ``deinfer`` (every subcommand) and ``deinfer-gen``.

Every user error (bad spec, bad option) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from dsl.errors import RuntimeFailure, UserError

EXIT_USAGE = 2


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from cli.plan import add_plan

    add_plan(sub)


def _add_gen(sub: argparse._SubParsersAction) -> None:
    from cli.gen import add_gen_arguments, run_gen

    p = sub.add_parser("gen", help="generate kernels and modules (same as deinfer-gen)")
    add_gen_arguments(p)
    p.set_defaults(func=run_gen)


def _add_decompose(sub: argparse._SubParsersAction) -> None:
    from cli.decompose import add_decompose

    add_decompose(sub)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from cli.tune import add_tune

    add_tune(sub)


def _add_run(sub: argparse._SubParsersAction) -> None:
    from cli.run import add_run

    add_run(sub)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from cli.demo import add_demo

    add_demo(sub)


def _add_predict(sub: argparse._SubParsersAction) -> None:
    from cli.predict import add_predict

    add_predict(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from cli.bench import add_bench

    add_bench(sub)


def _add_compress(sub: argparse._SubParsersAction) -> None:
    from cli.compress import add_eval, add_fidelity, add_import

    add_import(sub)
    add_eval(sub)
    add_fidelity(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from cli.serve import add_serve

    add_serve(sub)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    from cli.launch import add_launch

    add_launch(sub)


# Subcommands are registered here; each module owns its arguments and its work.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_plan,
    _add_gen,
    _add_decompose,
    _add_tune,
    _add_run,
    _add_demo,
    _add_bench,
    _add_predict,
    _add_compress,
    _add_serve,
    _add_launch,
)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so it unwinds like Ctrl-C: engines, ranks,
    links and folders close on the way out."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_parser(build: Callable[[], argparse.ArgumentParser], argv: Sequence[str] | None) -> int:
    """Build the parser (registering subcommands imports torch: seconds) and run the
    command, with every way of stopping turned into one line and an exit status."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        args = build().parse_args(argv)
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.details and os.environ.get("DEINFER_TRACEBACK"):
            print(exc.details, file=sys.stderr, end="")
        elif exc.details:
            print("  (DEINFER_TRACEBACK=1 shows the rank's traceback)", file=sys.stderr)
        return 1
    except OSError as exc:  # the system's refusal (disk full, read-only, permissions)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        if os.environ.get("DEINFER_TRACEBACK"):
            traceback.print_exc()
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def deinfer_parser() -> argparse.ArgumentParser:
    """``deinfer``'s parser, every subcommand registered."""
    parser = OneLineParser(prog="deinfer")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND"
    )
    for register in SUBCOMMANDS:
        register(sub)
    parser.description = (
        "Tensor-parallel inference of low-rank-decomposed LLMs. Commands: "
        + ", ".join(sub.choices)
        + ". 'deinfer COMMAND --help' describes one."
    )
    return parser


def gen_parser() -> argparse.ArgumentParser:
    """``deinfer-gen``'s parser."""
    from cli.gen import add_gen_arguments, run_gen

    parser = OneLineParser(
        prog="deinfer-gen", description="generate kernels and modules for a spec"
    )
    add_gen_arguments(parser)
    parser.set_defaults(func=run_gen)
    return parser


def tune_parser() -> argparse.ArgumentParser:
    """``deinfer-tune``'s parser."""
    from cli.tune import add_tune_arguments, run_tune

    parser = OneLineParser(prog="deinfer-tune", description="autotune generated kernels on a GPU")
    add_tune_arguments(parser)
    parser.set_defaults(func=run_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_parser(deinfer_parser, argv)


def tune_main(argv: Sequence[str] | None = None) -> int:
    return run_parser(tune_parser, argv)


def gen_main(argv: Sequence[str] | None = None) -> int:
    return run_parser(gen_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
