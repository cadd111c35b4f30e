"""``deinfer launch``: this machine's part of a tensor-parallel job over several machines.

It is ``torchrun`` with a c10d rendezvous (``torch.distributed.run``, in this process)
and what a job over machines needs said plainly: the rendezvous waits a stated time and
then fails in one line, a worker that fails ends the job in one line (the worker names
the rank and host it lost), and no restarts (a lost rank is not replaced mid-request).
Every machine runs the same command but for ``--local-addr``; rank 0 drives and, for
``serve``, answers HTTP. The same job runs under plain ``torchrun`` with the arguments
that ``torchrun_arguments`` makes.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dsl.errors import RuntimeFailure, UserError

COMMANDS = ("run", "serve")  # the engine commands that know how to lead and follow
DEFAULT_JOIN_TIMEOUT_S = 300.0  # torchrun's own default is 600 s
# After this machine's ranks have all ended, how long torchrun's agent may take to leave
# the rendezvous: the machines' ranks end within a second of each other, and an agent
# whose link to the rendezvous store was cut waits on it for ever (a store call over a
# silent connection never returns).
AGENT_LEAVE_S = 10.0


@dataclass(frozen=True)
class LaunchConfig:
    """One machine's part of a job: how many machines, ranks here, where they meet."""

    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    rdzv_id: str = "deinfer"
    local_addr: str | None = None
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

    @property
    def endpoint_host(self) -> str:
        return self.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")

    def check(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise UserError(
                f"--nnodes and --nproc-per-node must be at least 1, found {self.nnodes} and "
                f"{self.nproc_per_node}"
            )
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UserError(
                f"--rdzv-endpoint {self.rdzv_endpoint!r}: expected HOST:PORT with a port 1 to "
                "65535 (the machine that hosts the rendezvous, the same on every machine)"
            )
        if self.join_timeout_s <= 0:
            raise UserError(f"--join-timeout must be positive, found {self.join_timeout_s:g}")


def torchrun_arguments(config: LaunchConfig, command: list[str]) -> list[str]:
    """``torchrun``'s arguments for this machine's part (after ``torchrun``)."""
    conf = f"join_timeout={config.join_timeout_s:g}"
    if config.local_addr is not None and _same_address(config.local_addr, config.endpoint_host):
        conf += ",is_host=1"  # this machine's address is the endpoint: it hosts the store
    argv = [
        "--nnodes", str(config.nnodes),
        "--nproc-per-node", str(config.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", config.rdzv_endpoint,
        "--rdzv-id", config.rdzv_id,
        "--rdzv-conf", conf,
        "--max-restarts", "0",
    ]  # fmt: skip
    if config.local_addr is not None:
        argv += ["--local-addr", config.local_addr]
    return [*argv, "-m", "cli.main", *command]


def _same_address(a: str, b: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    return a == b


def add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="this machine's part of a tensor-parallel job over several machines (torchrun)",
        description="Run 'deinfer run' or 'deinfer serve' as this machine's part of a job "
        "over several machines: the same command on every machine but --local-addr. Rank 0 "
        "drives (and serves HTTP); ranks go to machines in the order of their addresses.",
    )
    p.add_argument("--nnodes", type=int, required=True, help="machines in the job")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this machine")
    p.add_argument(
        "--rdzv-endpoint",
        required=True,
        help="HOST:PORT where the machines meet: one of them, the same on every machine",
    )
    p.add_argument("--rdzv-id", default="deinfer", help="the job's name, the same everywhere")
    p.add_argument(
        "--local-addr",
        default=None,
        help="this machine's address as the others reach it (default: its host name); "
        "the machine whose address is the endpoint's hosts the rendezvous",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT_S,
        help=f"seconds to wait for every machine (default {DEFAULT_JOIN_TIMEOUT_S:g})",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help=f"one of {', '.join(COMMANDS)} …")
    p.set_defaults(func=launch)


def _live_children() -> set[int]:
    """This process's child processes (its ranks) still running, from /proc; a child
    that ended but was not reaped (the agent is stuck elsewhere) is a zombie, not live."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            for pid in (task / "children").read_text().split():
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.add(int(pid))
    return found


def _leave_when_ranks_ended(config: LaunchConfig) -> None:
    """Once ranks have run here and none is left, give the agent ``AGENT_LEAVE_S`` to
    finish, then end this process with one line (it is stuck on an unreachable store)."""
    started = False
    ended_at = None
    while True:
        time.sleep(0.5)
        alive = bool(_live_children())
        started = started or alive
        if not started or alive:
            ended_at = None
            continue
        ended_at = ended_at or time.monotonic()
        if time.monotonic() - ended_at > AGENT_LEAVE_S:
            print(
                f"error: the ranks on this machine have ended, but torchrun's agent could "
                f"not leave the rendezvous at {config.rdzv_endpoint} within {AGENT_LEAVE_S:g} "
                "s (unreachable): leaving without it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


def launch(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or command[0] not in COMMANDS:
        found = repr(command[0]) if command else "nothing"
        raise UserError(f"deinfer launch: expected one of {', '.join(COMMANDS)}, found {found}")
    config = LaunchConfig(
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        local_addr=args.local_addr,
        join_timeout_s=args.join_timeout,
    )
    config.check()
    threading.Thread(target=_leave_when_ranks_ended, args=(config,), daemon=True).start()
    try:
        run(parse_args(torchrun_arguments(config, command)))
    except RendezvousError as exc:  # RendezvousTimeoutError among them
        kind = "did not complete" if "Timeout" in type(exc).__name__ else "failed"
        raise RuntimeFailure(
            f"the rendezvous at {config.rdzv_endpoint} (job {config.rdzv_id!r}) {kind} within "
            f"{config.join_timeout_s:g} s: {config.nnodes} machines must start with the same "
            "--rdzv-endpoint, --rdzv-id and --nnodes and reach the endpoint"
        ) from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise RuntimeFailure(
            f"rank {rank} on this machine ended with exit code {failure.exitcode}; the job is "
            "over (its own line above says why)"
        ) from None
    except SignalException as exc:  # Ctrl-C or SIGTERM: passed on to the ranks here
        print(f"deinfer launch: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    print("deinfer launch: every rank on this machine finished", file=sys.stderr)
    return 0
