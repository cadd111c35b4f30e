"""This process's rank in a ``torchrun`` job (one machine or several): rank 0 leads, the
others follow.

Rank 0 runs the driver (the scheduler, the HTTP server): each call it makes on its own
model runner (``call("step", inputs, is_prefill)``) is first broadcast to the other
ranks over a control group of its own, and every rank then runs it, so the ranks meet in
the same collectives in the same order. A follower does nothing but ``follow``: take the
next call, run it, until rank 0 closes. A ``Watchdog`` beats on every rank; a rank that
is lost (its machine gone, its link cut) or a call that fails ends the job with one line
naming the rank and host (``runtime.dist.watchdog``): across machines the survivors
cannot know which collectives a lost rank joined, so nothing goes on after a failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dsl.errors import UserError
from runtime.dist.failures import WorkerError
from runtime.dist.launcher import default_backend, die_with_parent
from runtime.dist.watchdog import Watchdog, host_address

# The control group waits between calls for as long as the server is idle; a lost peer
# is the watchdog's to find, not a timeout's.
IDLE_TIMEOUT = timedelta(days=365)
LEADER = 0


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_follower() -> bool:
    """A ``torchrun`` rank other than 0: it follows rank 0's calls, serves nothing."""
    return under_torchrun() and os.environ["RANK"] != "0"


def init_from_env(timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the group that ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise WorkerError(f"{key} is not set: start under torchrun or use WorkerGroup")
    # A machine's agent killed outright takes its workers along: a worker left running
    # would keep its peers on other machines waiting for it.
    die_with_parent(os.getppid())
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


class TorchrunRank:
    """What leader and followers share: the control group, the hosts of every rank, the
    watchdog and this rank's model runner (``init = (factory, args)``)."""

    def __init__(self, init: tuple[Callable[..., Any], tuple], heartbeat_s: float) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        here = host_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.hosts: list[str] = [""] * self.world
        dist.all_gather_object(self.hosts, here, group=self.control)
        self.watchdog = Watchdog.for_torchrun(self.rank, self.hosts, heartbeat_s).start()
        factory, args = init
        try:
            self.state = factory(self.rank, self.world, *args)
        except Exception as exc:
            self.watchdog.fatal(exc)

    def describe(self) -> str:
        """e.g. "rank 1 of 2 on host 10.0.0.2; rank 0 on host 10.0.0.1 drives"."""
        return (
            f"rank {self.rank} of {self.world} on host {self.hosts[self.rank]}; rank {LEADER} "
            f"on host {self.hosts[LEADER]} drives"
        )

    def _receive(self, message: Any = None) -> Any:
        box = [message]
        dist.broadcast_object_list(box, src=LEADER, group=self.control)
        return box[0]

    def _run(self, method: str, args: tuple) -> Any:
        try:
            return getattr(self.state, method)(*args)
        except Exception as exc:
            self.watchdog.fatal(exc)

    def _leave(self) -> None:
        """After the last call: stop watching (a peer that leaves first is not lost),
        then leave together."""
        self.watchdog.stop()
        self.state = None
        dist.barrier(group=self.control)


class TorchrunLeader(TorchrunRank):
    """Rank 0: ``call`` runs a method on every rank's runner; rank 0's answer."""

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        try:
            self._receive((method, args))
        except Exception as exc:
            self.watchdog.fatal(exc)
        return [self._run(method, args)]

    def close(self) -> None:
        if self.state is None:
            return
        try:
            self._receive(None)
        except Exception as exc:
            self.watchdog.fatal(exc)
        self._leave()


class TorchrunFollower(TorchrunRank):
    """A rank other than 0: ``follow`` runs rank 0's calls until rank 0 closes."""

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        raise UserError(
            f"rank {self.rank} follows rank {LEADER}: only rank {LEADER} drives the engine "
            "(call LLM.follow() on the other ranks)"
        )

    def follow(self) -> None:
        print(f"{self.describe()}: following its calls", file=sys.stderr, flush=True)
        while True:
            try:
                message = self._receive()
            except Exception as exc:
                self.watchdog.fatal(exc)
            if message is None:
                break
            method, args = message
            self._run(method, args)
        self._leave()

    def close(self) -> None:
        """Ends the job's part here only after ``follow`` returned."""
