"""Heartbeats between the ranks of a ``torchrun`` job, which may span machines.

Inside one host the built-in ``WorkerGroup`` watches its ranks itself. Across hosts a
rank can vanish without a word: its machine's agent killed, its link cut. Then a
collective either fails at once (the peer's sockets were closed) or waits forever (the
link is down and nothing arrives). So every rank beats a counter in the job's store
(the ``torchrun`` store, on rank 0's host) twice a second from a thread of its own and
watches the others' counters. A peer whose counter stands still for ``heartbeat_s``, or
a store that stops answering for as long (rank 0's host is gone, or our own link), is
lost: the watchdog prints one line naming the rank and its host and ends the process
with exit code 1. Nothing is left to clean up gracefully in that state (a collective
may never return, and a process group torn down under a dead peer aborts), and the
``torchrun`` agent of this host, seeing its worker fail, ends the job here too.

After a collective has failed, ``fatal`` waits only until a peer has been quiet for
``QUIET_S`` (a dead peer's counter stops at once) and names it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

BEAT_S = 0.5  # each rank adds one to its counter this often
QUIET_S = 3.0  # after a failed collective, a counter still this long belongs to the lost peer
STORE_TIMEOUT_S = 5.0  # one store operation; a store silent longer counts as unreachable
EXIT_PEER_LOST = 1


def host_address(master_addr: str, master_port: int) -> str:
    """The address this host reaches ``master_addr`` from (a UDP "connection" sends
    nothing; it only asks the kernel which interface the route takes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, master_port))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()


class Watchdog:
    """Beats this rank's counter and watches the others' (``start``); ``stop`` before a
    planned exit. ``hosts[r]`` is rank r's host address, for the message."""

    def __init__(
        self,
        rank: int,
        hosts: list[str],
        heartbeat_s: float,
        store: dist.Store,
        exit_process: Callable[[int], NoReturn] = os._exit,
    ) -> None:
        self.rank, self.hosts, self.heartbeat_s = rank, hosts, heartbeat_s
        self.store = store
        self.exit_process = exit_process
        now = time.monotonic()
        self._counts = [-1] * len(hosts)
        self._changed = [now] * len(hosts)
        self._store_ok = now
        self._store_error: str | None = None  # the last store call's error, until one succeeds
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        # Two threads: a store call over a cut link never returns (its timeout covers
        # waiting for a key, not a connection that went silent), so the beats run apart
        # from the watching, which only reads when they last got through.
        self._threads = [
            threading.Thread(target=self._beat_loop, name="deinfer-heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="deinfer-watchdog", daemon=True),
        ]

    @classmethod
    def for_torchrun(cls, rank: int, hosts: list[str], heartbeat_s: float) -> Watchdog:
        """A watchdog on the store that ``torchrun`` gives its workers (MASTER_ADDR/PORT),
        its keys under this run and restart."""
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
        )
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(rank, hosts, heartbeat_s, dist.PrefixStore(f"deinfer/{run}/{restart}/", client))

    def start(self) -> Watchdog:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the heartbeat thread ends after its store call returns)."""
        self._stopped.set()
        self._threads[1].join()

    def _beat_loop(self) -> None:
        while not self._stopped.wait(BEAT_S):
            self._beat()

    def _watch_loop(self) -> None:
        while not self._stopped.wait(BEAT_S):
            lost = self.lost(self.heartbeat_s)
            if lost is not None and not self._stopped.is_set():
                self._exit(lost)

    def _beat(self) -> None:
        try:
            self.store.add(f"beat/{self.rank}", 1)
            counts = [self.store.add(f"beat/{r}", 0) for r in range(len(self.hosts))]
        except Exception as exc:  # refused or reset: the store's host may be gone
            lines = str(exc).strip().splitlines()
            with self._lock:
                self._store_error = lines[0].split(". ")[0] if lines else type(exc).__name__
            return
        now = time.monotonic()
        with self._lock:
            self._store_ok, self._store_error = now, None
            for r, count in enumerate(counts):
                if count != self._counts[r]:
                    self._counts[r], self._changed[r] = count, now

    def lost(self, quiet_s: float, store_errors: bool = False) -> str | None:
        """Which peer is lost, if one has been silent for ``quiet_s``, or the store (on
        rank 0's host) has: silent as long or, with ``store_errors``, failing now."""
        now = time.monotonic()
        with self._lock:
            failing = store_errors and self._store_error is not None
            if failing or now - self._store_ok > quiet_s:
                ranks = [r for r, h in enumerate(self.hosts) if h == self.hosts[0] and r != 0]
                also = f" and ranks {ranks}" if ranks else ""
                why = (
                    f"its store refuses us ({self._store_error})"
                    if failing
                    else f"the job's store there has not answered for {now - self._store_ok:.0f} s"
                )
                return f"lost rank 0{also} on host {self.hosts[0]}: {why}"
            for r, changed in enumerate(self._changed):
                if r != self.rank and now - changed > quiet_s:
                    return (
                        f"lost rank {r} on host {self.hosts[r]}: no heartbeat for "
                        f"{now - changed:.0f} s"
                    )
        return None

    def fatal(self, failure: BaseException) -> NoReturn:
        """A collective (or a call) failed: name the peer that went quiet, if one does
        within ``heartbeat_s``; otherwise this rank's own failure. Ends the process."""
        if threading.current_thread() is threading.main_thread():
            # This host's agent, losing the same peer, sends SIGTERM to its workers: the
            # line that names the peer comes first (the agent kills after 30 s anyway).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        deadline = time.monotonic() + self.heartbeat_s
        while time.monotonic() < deadline:
            lost = self.lost(QUIET_S, store_errors=True)
            if lost is not None:
                self._exit(lost)
            time.sleep(BEAT_S / 2)
        message = str(failure).strip().splitlines()
        self._exit(
            f"rank {self.rank} failed: {type(failure).__name__}: {message[-1] if message else ''}"
        )

    def _exit(self, reason: str) -> NoReturn:
        print(
            f"deinfer: rank {self.rank} on host {self.hosts[self.rank]}: {reason}; stopping",
            file=sys.stderr,
            flush=True,
        )
        self.exit_process(EXIT_PEER_LOST)
