"""Continuous batching: prefill waiting requests when blocks allow, otherwise decode the
running ones; when blocks run out, preempt (free and recompute later) the newest."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.engine.block_manager import BlockManager
from runtime.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_seq_len: int
    max_prefill_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def unfit_reason(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run here, or None when it can."""
        limit = self.config.max_seq_len
        total = prompt_len + max_tokens
        if prompt_len == 0:
            return "empty prompt"
        if total > limit:
            return (
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_seq_len {limit}"
            )
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            return (
                f"needs {self.blocks.blocks_needed(total)} KV blocks, the pool "
                f"has {self.blocks.num_blocks}"
            )
        return None

    def add(self, seq: Sequence) -> None:
        """Queue a request; one that can never fit ends at once with an error."""
        reason = self.unfit_reason(len(seq.prompt), seq.params.max_tokens)
        if reason is not None:
            self._reject(seq, reason)
        else:
            self.waiting.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """End a waiting or running request now (its blocks freed); False if it had
        already finished."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.blocks.free_sequence(seq)
        else:
            return False
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        return True

    @staticmethod
    def _reject(seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = f"error: {reason}"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill) for the next step."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_batch_size:
            seq = self.waiting[0]
            if tokens + len(seq) > self.config.max_prefill_tokens and batch:
                break
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            tokens += len(seq)
            batch.append(seq)
        if batch:
            self.running.extend(batch)
            return batch, True
        batch = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below while making room for an earlier one
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.blocks.append_slot(seq)
                batch.append(seq)
        return batch, False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
