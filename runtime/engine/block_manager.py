"""Paged KV-cache blocks: a free list and reference counts. A block may be shared
(reference count > 1), e.g. by a forked sequence; it returns to the free list when
its last owner frees it."""

from __future__ import annotations

from collections import deque

from runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of ``seq`` (the prompt at admission, or all tokens when
        a preempted sequence is recomputed)."""
        need = self.blocks_needed(len(seq)) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError("not enough free blocks (check can_allocate first)")
        for _ in range(need):
            seq.block_table.append(self._take())

    def can_append(self, seq: Sequence) -> bool:
        """A decode step caches the last token of ``seq``: room for len(seq) tokens."""
        return self.blocks_needed(len(seq)) <= len(seq.block_table) or len(self.free) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the last token of ``seq`` (the one the next decode step caches)."""
        if self.blocks_needed(len(seq)) > len(seq.block_table):
            seq.block_table.append(self._take())

    def share(self, src: Sequence, dst: Sequence) -> None:
        """``dst`` reuses ``src``'s blocks (a fork): reference counts go up."""
        for block in src.block_table:
            self.ref_counts[block] += 1
        dst.block_table = list(src.block_table)

    def free_sequence(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.append(block)
        seq.block_table = []

    def _take(self) -> int:
        block = self.free.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block
