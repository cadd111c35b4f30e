"""Local tensor-parallel worker processes.

``WorkerGroup(world)`` spawns ``world`` processes that join one process group
(gloo on CPU, nccl on GPU) on 127.0.0.1 with a free port picked at run time, then
run functions sent to them: ``group.run(fn, *args)`` calls ``fn(rank, world, *args)``
on every rank and returns the per-rank results. A call that raises on some ranks while
every rank still answers leaves the group intact (``CallFailed``: the ranks are all back
at their task queues, so the next call finds them in step). A rank that dies or does not
answer in time ends the whole group with ``WorkerError`` naming the rank, never a
silent hang: every rank beats a heartbeat once a second, and a rank silent for
``heartbeat_s`` (stopped, or hung with its interpreter frozen) is named and the group torn
down. Ranks die with the driver (a parent-death signal), so no signal to the driver leaves
them behind. Under ``torchrun``: ``runtime.dist.torchrun_group``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime.dist.emulated_link import EmulatedLinks, LinkSpec, enter_namespace, probe_all_gather
from runtime.dist.failures import (
    CallFailed,
    WorkerError,
    last_line,
    first_cause,
    raise_failure,
    rank_failure,
)

HEARTBEAT_S = 15.0  # a rank silent this long is stopped or hung (it beats once a second)
# After one rank raised, how long the others get to answer before the group counts as
# broken: ranks run a call in lockstep, so a failure after their last collective (in
# sampling) reaches every rank within milliseconds; a peer still waiting past this is
# stuck in a collective the failed rank never joined.
PEERS_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when the driver dies (Linux); if the driver
    is already gone, leave now."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """While child processes start: SIGINT ignored, so they inherit an ignored SIGINT
    from their first instruction (a Ctrl-C during their imports prints nothing there),
    and blocked here, so the driver's Ctrl-C is not lost but waits (Linux keeps a blocked
    signal pending even while ignored) and is raised as the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _beat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(1.0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def pin_to_core(rank: int, world: int) -> None:
    """Keep rank r on core r (modulo the cores, in the order the process may use them),
    so with no more ranks than cores no two share one, and none migrates: a gloo
    all-reduce of 128 KB between two ranks took 0.72 ms pinned against 1.05 ms unpinned
    here. With more ranks than cores, the ranks sharing a core take turns on it at each
    collective (``SharedMemoryCollectives``' waits yield): tp 4 of cpu-demo on the 2-core
    Xeon VM decoded 20.2 tok/s at batch 1 pinned so, 18.7 left to the scheduler (the
    dense model 18.0 and 17.1; param_count 40 %, one run each, 3 repetitions)."""
    if not hasattr(os, "sched_getaffinity") or os.environ.get("DEINFER_NO_PIN"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    tasks,
    results,
    init=None,
    master: str = "127.0.0.1",
    netns: str | None = None,
    parent: int = 0,
    beats=None,
):
    # Ctrl-C reaches the whole process group; the driver alone decides when ranks stop
    # (a server finishes its requests first), so a rank ignores it and waits for its task.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent:
        die_with_parent(parent)
    if beats is not None:
        threading.Thread(target=_beat, args=(beats, rank), daemon=True).start()
    try:
        if netns is not None:  # an emulated link: this rank's own network namespace
            enter_namespace(netns)
        torch.set_num_threads(1)  # ranks share the machine's cores
        pin_to_core(rank, world)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as exc:
        results.put((rank, *rank_failure(exc)))
        return
    state = None
    try:
        if init is not None:
            factory, init_args = init
            state = factory(rank, world, *init_args)
    except Exception as exc:
        results.put((rank, *rank_failure(exc)))
        return
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            value = getattr(state, fn)(*args) if isinstance(fn, str) else fn(rank, world, *args)
            results.put((rank, "ok", value))
        except Exception as exc:
            results.put((rank, *rank_failure(exc)))
    dist.destroy_process_group()


def _probe_link(rank: int, world: int, nbytes: int) -> dict[str, float]:
    return probe_all_gather(nbytes)


class WorkerGroup:
    """``init=(factory, args)`` builds a per-rank object ``factory(rank, world, *args)``
    after the group is up; ``call(name, *args)`` then runs its method on every rank.

    ``link`` (gloo only) puts each rank in its own network namespace behind an emulated
    link of that rate (``runtime.dist.emulated_link``), torn down with the group; the
    all-gather rate measured across it right after start is in ``link_probe``. With
    ``hosts``, the ranks share that many namespaces instead (emulated machines of
    ``world // hosts`` consecutive ranks each): ranks of one machine talk over its
    loopback, only the machines' traffic crosses the links."""

    def __init__(
        self,
        world: int,
        backend: str | None = None,
        timeout_s: float = 120.0,
        init: tuple[Callable[..., Any], tuple] | None = None,
        link: LinkSpec | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        hosts: int | None = None,
    ) -> None:
        if hosts is not None and (link is None or not 2 <= hosts <= world or world % hosts):
            raise WorkerError(
                f"{hosts} emulated hosts for {world} ranks: they need a link and must divide "
                "the ranks evenly, at least 2"
            )
        self.world, self.hosts = world, hosts or world
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.procs: list = []
        self.tasks: list = []
        self.closed = False  # by ``close``: after a failure the ranks are gone
        self.links: EmulatedLinks | None = None
        self.link_probe: dict[str, float] | None = None
        ctx = mp.get_context("spawn")
        with _sigint_deferred():  # inherited: a Ctrl-C while the ranks start is the driver's
            self._start(ctx, world, backend, timeout_s, init, link)
        try:
            self._collect("ready", timeout_s)
            if link is not None:
                self.link_probe = self.probe_link()
        except BaseException:
            self.close()
            raise

    def _start(self, ctx, world: int, backend, timeout_s: float, init, link) -> None:
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.beats = ctx.Array("d", [time.monotonic()] * world, lock=False)
        port = free_port()
        backend = backend or default_backend()
        if link is not None:
            if backend != "gloo":
                raise WorkerError(f"emulated links carry gloo over TCP, not {backend}")
            self.links = EmulatedLinks(self.hosts, link).up()
        per_host = world // self.hosts
        master = self.links.address(0) if self.links else "127.0.0.1"
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world, port, backend, timeout_s, self.tasks[r], self.results, init),
                kwargs={
                    "master": master,
                    "netns": self.links.namespace_path(r // per_host) if self.links else None,
                    "parent": os.getpid(),
                    "beats": self.beats,
                },
            )
            for r in range(world)
        ]
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.close()
            raise

    def probe_link(self, nbytes: int | None = None) -> dict[str, float]:
        """Time all-gathers of ``nbytes`` per rank across the group (default: about a
        tenth of a second of traffic at the link's rate, long enough to see the rate)."""
        if nbytes is None:
            rate = self.links.link.bytes_per_s if self.links else 1e9
            nbytes = int(min(64 << 20, max(64 << 10, rate / 10 / (self.world - 1))))
        return self.run(_probe_link, nbytes)[0]

    def set_link(self, link: LinkSpec, probe: bool = True) -> dict[str, float] | None:
        """Reshape the emulated links to ``link`` and (by default) measure them again."""
        if self.links is None:
            raise WorkerError("this group was not started behind emulated links")
        self.links.reshape(link)
        self.link_probe = self.probe_link() if probe else None
        return self.link_probe

    def run(
        self, fn: Callable[..., Any] | str, *args: Any, timeout_s: float | None = None
    ) -> list[Any]:
        """fn(rank, world, *args) on every rank; the per-rank results in rank order."""
        if self.closed:
            raise WorkerError("this worker group is closed (an earlier call broke it); start a new one")
        for q in self.tasks:
            q.put((fn, args))
        return self._collect("ok", timeout_s or self.timeout_s)

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``obj.method(*args)`` on every rank's ``init`` object; per-rank results."""
        return self.run(method, *args, timeout_s=timeout_s)

    def _collect(self, want: str, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        failed: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) + len(failed) < self.world:
            waiting = [r for r in range(self.world) if r not in out and r not in failed]
            try:
                rank, status, value = self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_waiting(waiting, failed, deadline, timeout_s)
                continue
            if status not in ("error", "user_error"):
                out[rank] = value
                continue
            # A rank that fails because a peer died or stopped is not the cause: give
            # the others a moment to show theirs, then name the one that broke first.
            others = [r for r in waiting if r != rank]
            culprit = self._culprit(others, grace_s=1.0)
            if culprit is not None or want == "ready":
                self.close()
                if culprit is not None:
                    raise WorkerError(f"{culprit}; rank {rank} then failed: {last_line(value)}")
                raise_failure(rank, status, value, WorkerError)
            if not failed:
                deadline = min(deadline, time.monotonic() + PEERS_GRACE_S)
            failed[rank] = (status, value)
        if failed:  # every rank answered: the group is intact
            rank = first_cause(failed)
            raise_failure(rank, *failed[rank], CallFailed)
        return [out[r] for r in range(self.world)]

    def _check_waiting(
        self,
        waiting: list[int],
        failed: dict[int, tuple[str, str]],
        deadline: float,
        timeout_s: float,
    ) -> None:
        """Raise (the group closed) if a rank ``waiting`` is dead or silent, or the call's
        time (or, after a failure, the peers' grace) is up."""
        if (culprit := self._culprit(waiting)) is not None:
            self.close()
            raise WorkerError(culprit) from None
        if time.monotonic() <= deadline:
            return
        self.close()
        if failed:
            rank = first_cause(failed)
            raise WorkerError(
                f"rank {rank} failed: {last_line(failed[rank][1])}; ranks {waiting} did not "
                f"answer within {PEERS_GRACE_S:.0f} s (stuck in a collective it left)",
                failed[rank][1],
            ) from None
        raise WorkerError(
            f"rank {waiting[0]} did not answer within {timeout_s:.0f} s "
            f"(waiting for ranks {waiting})"
        ) from None

    def _culprit(self, ranks: list[int], grace_s: float = 0.0) -> str | None:
        """Why one of ``ranks`` cannot answer (dead, or silent past ``heartbeat_s``)."""
        end = time.monotonic() + grace_s
        while True:
            for r in ranks:
                code = self.procs[r].exitcode
                if code:  # 0: it reported its own error and returned; that is not a death
                    return f"rank {r} died (exit code {code})"
                silent = time.monotonic() - self.beats[r]
                if silent > self.heartbeat_s:
                    return (
                        f"rank {r} stopped answering (no heartbeat for {silent:.0f} s: "
                        "stopped or hung)"
                    )
            if time.monotonic() >= end:
                return None
            time.sleep(0.1)

    def close(self) -> None:
        self.closed = True
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            if p.pid is None:
                continue  # never started (a failure while starting the others)
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        if self.links is not None:
            self.links.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 120.0,
    link: LinkSpec | None = None,
) -> list[Any]:
    """One-shot: start ``world`` workers, run ``fn`` once, stop them."""
    with WorkerGroup(world, timeout_s=timeout_s, link=link) as group:
        return group.run(fn, *args)
