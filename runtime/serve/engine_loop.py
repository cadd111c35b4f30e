"""The engine in one background thread, fed by an asyncio server.

Requests join the running batch as they arrive (the scheduler batches continuously);
every token goes back to its request's ``asyncio.Queue`` as soon as the step that made
it ends. The thread is the only one that touches the ``LLM`` (scheduler, block manager,
ranks); the server's event loop talks to it through a command queue, so nothing is
shared but that queue, the per-request queues and an immutable snapshot of the load.

A step that raises while the ranks stay in step (``StepFailed``) ends only that step's
requests, each with the error; the engine serves on. Anything else (a rank died or hung)
ends every request with the cause, logs it once and tells the server (``on_fatal``),
which exits non-zero as a supervisor expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dsl.errors import UserError
from runtime.engine.llm import LLM, StepFailed
from runtime.engine.sampling import TokenLogprobs
from runtime.engine.sequence import SamplingParams, Sequence, Status
from runtime.serve.metrics import ServerMetrics


class QueueFull(Exception):
    """More requests in flight than the server admits; the client should retry later."""


class EngineDead(Exception):
    """The engine stopped (a rank failed, or the server is shutting down)."""


log = logging.getLogger("deinfer.serve")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    time: float  # perf_counter when the step that made it ended
    logprobs: TokenLogprobs | None = None
    # with the first token only, if asked: each prompt token's (None for the first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class Finished:
    reason: str  # "length" | "stop" | "abort" | "error: ..."


@dataclass(frozen=True)
class Load:
    """What /metrics and /health report; replaced whole after every step."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    alive: bool = True
    error: str | None = None


@dataclass
class RequestHandle:
    """The server's side of one request: its events arrive on ``events``."""

    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None  # set by the engine thread
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False


class EngineLoop:
    """Own ``llm`` in a thread; admit at most ``max_in_flight`` requests at a time.
    ``on_fatal(reason)`` is called on the event loop once the engine has died."""

    def __init__(
        self,
        llm: LLM,
        metrics: ServerMetrics,
        max_in_flight: int,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.on_fatal = on_fatal
        self.load = Load(blocks_total=llm.blocks.num_blocks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._in_flight: dict[int, RequestHandle] = {}  # touched by the event loop only
        self._by_seq: dict[int, RequestHandle] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        metrics.watch_load(lambda: self.load)

    # --- the event loop's side -----------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deinfer-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        return self.submit_all([(prompt, params)])[0]

    def submit_all(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestHandle]:
        """Queue all of ``requests`` or, if they do not all fit, none."""
        if not self.load.alive:
            raise EngineDead(self.load.error or "the engine has stopped")
        if len(self._in_flight) + len(requests) > self.max_in_flight:
            raise QueueFull(
                f"{len(self._in_flight)} requests in flight and {len(requests)} more asked, "
                f"the server admits {self.max_in_flight}; retry later"
            )
        handles = [RequestHandle(next(self._ids), p, sp) for p, sp in requests]
        for handle in handles:
            self._in_flight[handle.id] = handle
            self._commands.put(("add", handle, None))
        return handles

    def cancel(self, handle: RequestHandle, reason: str = "abort") -> None:
        """Stop generating for a request (client gone: "abort"; a stop string seen:
        "stop"); idempotent."""
        if self._in_flight.pop(handle.id, None) is not None:
            self._commands.put(("cancel", handle, reason))

    def abort_all(self) -> None:
        """End every request now with finish reason "abort" (shutdown past its grace)."""
        self._commands.put(("abort_all", None, None))

    def release(self, handle: RequestHandle) -> None:
        """The server is done with a request that finished by itself."""
        self._in_flight.pop(handle.id, None)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is left and end the thread (the ranks stay up: ``llm.close()``)."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop", None, None))
            self._thread.join(timeout_s)

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        scheduler = self.llm.scheduler
        try:
            while True:
                if not self._drain(block=not scheduler.has_work()):
                    break
                try:
                    events = self.llm.step() if scheduler.has_work() else []
                except StepFailed as exc:  # logged by the engine; only its requests end
                    for seq in exc.sequences:
                        if (handle := self._by_seq.get(seq.id)) is not None:
                            self._finish(handle, seq.finish_reason or f"error: {exc}")
                    events = []
                self._publish()  # before the tokens go out: a client sees a current load
                for seq, token, now in events:
                    self._deliver(seq, token, now)
        except Exception as exc:  # a rank failed: every request ends with the reason
            self._die(f"engine failed: {str(exc).strip().splitlines()[-1]}")
            return
        for handle in list(self._by_seq.values()):  # stopping: abort what is left
            self.llm.abort(handle.seq)
            self._finish(handle, "abort")
        self.load = Load(alive=False, error="shutting down", blocks_total=self.load.blocks_total)

    def _die(self, reason: str) -> None:
        log.error("%s; every request ends and the server stops", reason)
        self.load = Load(alive=False, error=reason, blocks_total=self.load.blocks_total)
        for handle in list(self._by_seq.values()):
            self._finish(handle, f"error: {reason}")
        self._drain_after_failure(reason)
        if self.on_fatal is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                self._loop.call_soon_threadsafe(self.on_fatal, reason)

    def _drain(self, block: bool) -> bool:
        """Apply the waiting commands (wait for one when idle); False on "stop"."""
        while True:
            try:
                if block:
                    kind, handle, reason = self._commands.get(timeout=0.5)
                else:
                    kind, handle, reason = self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(handle)
            elif kind == "cancel" and handle.seq is not None and not handle.done:
                self.llm.abort(handle.seq)
                self._finish(handle, reason)
            elif kind == "abort_all":
                for running in list(self._by_seq.values()):
                    self.llm.abort(running.seq)
                    self._finish(running, "abort")

    def _add(self, handle: RequestHandle) -> None:
        try:
            seq = self.llm.add_request(handle.prompt, handle.params)
        except UserError as exc:  # admission checks first; this is the engine's word
            self._finish(handle, f"error: {exc}")
            return
        handle.seq = seq
        self._by_seq[seq.id] = handle
        if seq.status is Status.FINISHED:  # the scheduler refused it
            self._finish(handle, seq.finish_reason or "error: refused")

    def _deliver(self, seq: Sequence, token: int, now: float) -> None:
        handle = self._by_seq.get(seq.id)
        if handle is None:
            return
        first = handle.first_token is None
        if first:
            handle.first_token = now
            self.metrics.ttft.observe(now - handle.arrival)
        else:
            self.metrics.itl.observe(now - handle.last_token)
        handle.last_token = now
        self.metrics.generation_tokens.inc()
        logprobs = seq.logprobs[-1] if seq.params.logprobs is not None else None
        prompt_logprobs = seq.prompt_logprobs if first else None
        self._send(handle, TokenEvent(token, now, logprobs, prompt_logprobs))
        if seq.status is Status.FINISHED:
            self._finish(handle, seq.finish_reason or "stop")

    def _finish(self, handle: RequestHandle, reason: str) -> None:
        handle.done = True
        self._by_seq.pop(handle.seq.id if handle.seq else -1, None)
        label = reason if not reason.startswith("error") else "error"
        self.metrics.requests.labels(finish_reason=label).inc()
        self.metrics.prompt_tokens.inc(len(handle.prompt))
        if handle.last_token is not None:
            self.metrics.e2e.observe(handle.last_token - handle.arrival)
        self._send(handle, Finished(reason))

    def _send(self, handle: RequestHandle, event: TokenEvent | Finished) -> None:
        assert self._loop is not None
        # RuntimeError: the event loop has closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(handle.events.put_nowait, event)

    def _publish(self) -> None:
        scheduler, blocks = self.llm.scheduler, self.llm.blocks
        self.load = Load(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            blocks_used=blocks.num_blocks - len(blocks.free),
            blocks_total=blocks.num_blocks,
        )

    def _drain_after_failure(self, reason: str) -> None:
        """Requests that arrive after a failure end at once with its reason."""
        while True:
            try:
                kind, handle, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._finish(handle, f"error: {reason}")
