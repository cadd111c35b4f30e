"""The one door to torch.distributed: every collective of the runtime goes through
``Comm``. It can count calls and elements per collective kind and time them (off by
default; when off, a single boolean test is the whole cost)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat all-gather; older releases only have the old name.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CollectiveStats:
    calls: int = 0
    elements: int = 0  # of the full (gathered / reduced) tensor, summed over calls
    seconds: float = 0.0


@dataclass
class CommStats:
    by_kind: dict[str, CollectiveStats] = field(default_factory=dict)

    def record(self, kind: str, elements: int, seconds: float) -> None:
        s = self.by_kind.setdefault(kind, CollectiveStats())
        s.calls += 1
        s.elements += elements
        s.seconds += seconds

    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.by_kind.values())


class Comm:
    """Collectives over one process group (``None``: the default group).

    ``count=True`` records calls and elements; ``timed=True`` also measures wall time
    (synchronising the GPU and the ranks before each collective, so only for
    breakdowns)."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, count: bool = False, timed: bool = False
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.count = count or timed
        self.timed = timed
        # Ring all-gather overlapped with compute; off inside CUDA graphs (one all-gather).
        self.overlap = True
        # Same-host ranks on a CPU: all-reduces and all-gathers that fit go through shared
        # memory (``runtime.dist.shm_collectives``); the rest through torch.distributed.
        self.shm = None
        self.stats = CommStats()

    def _start(self) -> float:
        if self.timed:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if self.world > 1:
                # Wait for the slowest rank first, outside the collective's timer: the
                # time recorded is the transfer. The wait is recorded apart (a tagged
                # kind, outside the block's collectives): a rank's own work is its time
                # less both, and the slowest rank's own work is the critical path's.
                waited = time.perf_counter()
                dist.barrier(group=self.group)
                self.stats.record("sync:barrier", 0, time.perf_counter() - waited)
            return time.perf_counter()
        return 0.0

    def _done(self, kind: str, elements: int, start: float, tag: str = "") -> None:
        """Record one collective. Tagged ones (embedding, logits) are kept apart from
        the blocks' so per-block counts compare with the plan."""
        if self.count:
            kind = f"{kind}:{tag}" if tag else kind
            if self.timed and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.stats.record(kind, elements, time.perf_counter() - start if self.timed else 0.0)

    def all_reduce(self, tensor: torch.Tensor, tag: str = "") -> torch.Tensor:
        """Sum over ranks, in place."""
        start = self._start()
        if self.world > 1:
            if self._shared(tensor):
                self.shm.all_reduce(tensor)
            elif tensor.is_contiguous():
                dist.all_reduce(tensor, group=self.group)
            else:
                # gloo sums storage, not logical elements: a transposed view (the eager
                # GEMM returns one from 16 to 64 rows) on one rank and a plain tensor on
                # another would be added element by wrong element.
                dense = tensor.contiguous()
                dist.all_reduce(dense, group=self.group)
                tensor.copy_(dense)
        self._done("all_reduce", tensor.numel(), start, tag)
        return tensor

    def skipped(self, kind: str, elements: int) -> None:
        """Count a collective that one rank alone has no need to make, as the plan counts
        it (the native decode block keeps a low-rank row's latent in its call's scratch;
        elsewhere a rank alone calls ``all_reduce``, which returns at once, counted)."""
        self._done(kind, elements, self._start())

    def summands(self, tensor: torch.Tensor, tag: str = "") -> list[torch.Tensor]:
        """An all-reduce of ``tensor`` for a caller that adds the sum into something else
        (``eager.add_and_normalize``: the residual stream and the next norm in one
        pass): what to sum, in rank order. Through shared memory, every rank's tensor
        (views of its slots, readable until the collective after next); otherwise the
        reduced tensor alone."""
        if self.world == 1 or not self._shared(tensor):
            return [self.all_reduce(tensor, tag)]
        start = self._start()
        values = self.shm.exchange(tensor)
        self._done("all_reduce", tensor.numel(), start, tag)
        return list(values.view(self.world, *tensor.shape).unbind(0))

    def all_gather_columns(self, local: torch.Tensor, tag: str = "") -> torch.Tensor:
        """[M, W] on each rank -> [M, world·W], rank order along the columns."""
        start = self._start()
        if self.world == 1:
            out = local.contiguous()
        else:
            rows, width = local.shape
            stacked = local.new_empty((self.world, rows, width))
            if self._shared(local):
                self.shm.all_gather(local, stacked)
            else:
                all_gather_flat(stacked.view(-1, width), local.contiguous(), group=self.group)
            out = self.columns(stacked)
        self._done("all_gather", out.numel(), start, tag)
        return out

    def all_gather_chunks(
        self, local: torch.Tensor, chunks: torch.Tensor
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Ring all-gather of equal [M, W] chunks into ``chunks`` [world, M, W] that
        yields ``(source rank, chunk)`` as each arrives: the local chunk first, then one
        per ring step, so the caller computes on a chunk while the next is in flight.
        Counted as one all-gather of world·M·W elements; timed, the ring's time includes
        the caller's work it overlaps, the single all-gather's (``overlap`` off) does not."""
        start = self._start()
        world, rank = self.world, self.rank
        chunks[rank].copy_(local)
        if world > 1 and not self.rings(local):
            # Through shared memory the gather costs a copy: nothing worth overlapping.
            if self._shared(local):
                self.shm.all_gather(local, chunks)
            else:
                flat = chunks.view(-1, *local.shape[1:])
                all_gather_flat(flat, local.contiguous(), group=self.group)
            # Recorded before the caller's GEMMs run on the chunks: comm time only.
            self._done("all_gather", chunks.numel(), start)
            yield rank, chunks[rank]
            for j in range(1, world):
                yield (rank - j) % world, chunks[(rank - j) % world]
            return
        nxt, prev = (rank + 1) % world, (rank - 1) % world

        def step(s: int) -> list:
            send, recv = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
            ops = [
                dist.P2POp(dist.isend, send, self._peer(nxt), self.group),
                dist.P2POp(dist.irecv, recv, self._peer(prev), self.group),
            ]
            return dist.batch_isend_irecv(ops)

        pending = step(0) if world > 1 else []
        yield rank, chunks[rank]
        for s in range(world - 1):
            for req in pending:
                req.wait()
            pending = step(s + 1) if s + 1 < world - 1 else []
            src = (rank - s - 1) % world
            yield src, chunks[src]
        self._done("all_gather", chunks.numel(), start)

    def rings(self, local: torch.Tensor) -> bool:
        """Whether ``all_gather_chunks(local, ...)`` runs the ring (chunks arriving one by
        one, worth overlapping) rather than one all-gather (or none, alone)."""
        return self.world > 1 and self.overlap and not self._shared(local)

    def _shared(self, tensor: torch.Tensor) -> bool:
        return self.shm is not None and self.shm.fits(tensor)

    def _peer(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` in this group (P2P takes global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @staticmethod
    def columns(chunks: torch.Tensor) -> torch.Tensor:
        """[world, M, W] -> [M, world·W]."""
        return chunks.permute(1, 0, 2).reshape(chunks.shape[1], -1)
