"""The heartbeat watchdog of a torchrun job (``runtime.dist.watchdog``) on a store
of its own: a peer whose counter stops is named after the heartbeat timeout (or after
``QUIET_S`` once a collective failed), a store that fails is rank 0's host lost, and a
stopped watchdog names nobody. The real thing across emulated hosts:
``tests/test_multi_host.py``."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from runtime.dist import watchdog as wd
from runtime.dist.launcher import free_port

HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.2"]


class Exited(Exception):
    pass


def _exit(code: int):
    raise Exited(code)


@pytest.fixture
def store():
    return dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=5),
    )  # fmt: skip


def _beat_for(store, rank: int, stop: threading.Event) -> threading.Thread:
    def beat() -> None:
        while not stop.wait(wd.BEAT_S / 2):
            store.add(f"beat/{rank}", 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def test_a_peer_whose_counter_stops_is_named_with_its_host(store, monkeypatch):
    dog = wd.Watchdog(0, HOSTS, heartbeat_s=2.0, store=store, exit_process=_exit)
    dog.start()
    stop_one, stop_two = threading.Event(), threading.Event()
    _beat_for(store, 1, stop_one)
    _beat_for(store, 2, stop_two)
    try:
        time.sleep(1.5)
        assert dog.lost(1.0) is None  # everyone beats
        stop_two.set()  # rank 2 dies
        deadline = time.monotonic() + 5
        while dog.lost(1.0) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dog.lost(1.0).startswith("lost rank 2 on host 10.0.0.2: no heartbeat for")
    finally:
        stop_one.set()
        dog.stop()


def test_fatal_names_the_quiet_peer_and_exits(store, monkeypatch, capsys):
    monkeypatch.setattr(wd, "QUIET_S", 1.0)
    dog = wd.Watchdog(1, HOSTS, heartbeat_s=30.0, store=store, exit_process=_exit)
    dog.start()
    stop = threading.Event()
    _beat_for(store, 2, stop)  # rank 0 never beats: it is the one lost
    try:
        start = time.monotonic()
        with pytest.raises(Exited) as exited:
            dog.fatal(RuntimeError("Connection reset by peer"))
        assert time.monotonic() - start < 5  # QUIET_S, not the 30 s heartbeat
    finally:
        stop.set()
        dog.stop()
    assert exited.value.args == (wd.EXIT_PEER_LOST,)
    line = capsys.readouterr().err.strip()
    assert line.startswith("deinfer: rank 1 on host 10.0.0.2: lost rank 0 on host 10.0.0.1")
    assert line.endswith("; stopping") and "\n" not in line


class RefusingStore:
    """A store whose host is gone: every call fails at once."""

    def add(self, key: str, value: int) -> int:
        raise RuntimeError("Connection refused. Is the server up?")


def test_a_failing_store_is_rank0s_host_lost():
    dog = wd.Watchdog(2, HOSTS, heartbeat_s=30.0, store=RefusingStore(), exit_process=_exit)
    dog._beat()
    assert dog.lost(30.0) is None  # failing once is not yet silent for the timeout
    said = dog.lost(30.0, store_errors=True)
    assert said == "lost rank 0 on host 10.0.0.1: its store refuses us (Connection refused)"


def test_a_silent_store_is_named_after_the_timeout():
    dog = wd.Watchdog(1, ["a", "a", "b"], heartbeat_s=1.0, store=RefusingStore())
    dog._store_ok -= 2.0  # the last answer two seconds ago
    assert dog.lost(1.0).startswith("lost rank 0 and ranks [1] on host a: the job's store")


def test_a_stopped_watchdog_names_nobody(store):
    exits: list[int] = []
    dog = wd.Watchdog(0, HOSTS[:2], heartbeat_s=0.6, store=store, exit_process=exits.append)
    dog.start()
    dog.stop()
    time.sleep(3.0)  # rank 1 never beats: a running watchdog names it by then
    assert exits == []
    running = wd.Watchdog(0, HOSTS[:2], heartbeat_s=0.6, store=store, exit_process=exits.append)
    running.start()
    time.sleep(3.0)
    running.stop()
    assert exits and exits[0] == wd.EXIT_PEER_LOST
