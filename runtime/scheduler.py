"""Continuous batching: prefill waiting requests when blocks allow, otherwise decode the
running ones; when blocks run out, preempt (free and recompute later) the newest."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.block_manager import BlockManager
from runtime.sequence import Sequence, Status


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

    def add(self, seq: Sequence) -> None:
        """Queue a request; one that can never fit ends at once with an error."""
        limit = self.config.max_seq_len
        total = len(seq.prompt) + seq.params.max_tokens
        if not seq.prompt:
            self._reject(seq, "empty prompt")
        elif total > limit:
            self._reject(
                seq,
                f"prompt ({len(seq.prompt)}) + max_tokens "
                f"({seq.params.max_tokens}) exceeds max_seq_len {limit}",
            )
        elif self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            self._reject(
                seq,
                f"needs {self.blocks.blocks_needed(total)} KV blocks, the pool "
                f"has {self.blocks.num_blocks}",
            )
        else:
            self.waiting.append(seq)

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
