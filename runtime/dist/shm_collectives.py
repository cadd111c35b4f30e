"""All-reduce and all-gather through shared memory for ranks on one host (the CPU path).

Over gloo, a 128 KB all-reduce between two ranks that are busy computing waited 4–5 ms
here (0.7–1 ms between idle ranks): TCP over loopback plus process wake-ups. Ranks on
one machine can instead meet in one shared segment: each writes its tensor into its
slot, announces it with a sequence number, waits until every rank has announced, and
sums the slots in rank order (so every rank gets bit-identical sums) — or, for an
all-gather, copies every slot out. Slots alternate
between two buffers, so one wait per call is enough: a rank writes buffer c % 2 at
call c only after every rank announced call c - 1, which each does only after reading
buffer c % 2 at call c - 2.

Stores become visible to other cores in program order on x86-64 (total store order),
which the announce-after-write protocol relies on; elsewhere ``available`` says no and
gloo is used. The segment's name is unlinked as soon as every rank has attached, so
nothing is left in /dev/shm even if a rank is killed.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
# Spins before each yield while waiting: ranks pinned to their own cores see a peer's
# announcement within microseconds. Ranks that share a core yield at once (spins 0): each
# spin is a Python loop turn of ~1 us, so 200 of them held the core from the rank it
# shares with at every collective; tp 4 of cpu-demo on the 2-core Xeon VM (param_count
# 40 %, batch 1, pinned two to a core) decoded 20.2 tok/s yielding at once against 18.2
# after 200 spins (the dense model: 18.0 against 17.1; one run each, 3 repetitions).
SPINS = 200


def supported() -> bool:
    """Whether this host can run them: x86-64's memory ordering and a /dev/shm."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


class SharedMemoryCollectives:
    """Sum, or gather, of CPU tensors of at most ``capacity`` bytes over the default
    group's ranks. Both collectives share one call sequence (and the slots)."""

    def __init__(
        self, rank: int, world: int, capacity: int, timeout_s: float = 600.0, spins: int = SPINS
    ) -> None:
        self.rank, self.world, self.capacity = rank, world, capacity
        self.timeout_s, self.spins = timeout_s, spins
        self.calls = 0
        flags = world * 8
        size = 2 * world * capacity + flags
        name = [f"deinfer-{os.getpid()}-{secrets.token_hex(6)}" if rank == 0 else None]
        if rank == 0:  # create before anyone learns the name
            fd = os.open(os.path.join(SHM_DIR, name[0]), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        dist.broadcast_object_list(name, src=0)
        path = os.path.join(SHM_DIR, name[0])
        try:
            fd = os.open(path, os.O_RDWR)
            self.map = mmap.mmap(fd, size)
            os.close(fd)
        finally:
            dist.barrier()  # every rank has mapped it (or failed): the name can go
            if rank == 0:
                os.unlink(path)
        self.raw = torch.frombuffer(self.map, dtype=torch.uint8, count=size - flags)
        self.announced = np.ndarray((world,), dtype=np.int64, buffer=self.map, offset=size - flags)
        self.announced[rank] = 0
        dist.barrier()

    def fits(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.capacity
        )

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Publish ``tensor`` in this rank's slot, wait for every rank's: the slots
        [world, numel] (readable until the call after next)."""
        if not self.fits(tensor):
            raise ValueError(f"{tensor.numel()} elements exceed {self.capacity} bytes")
        self.calls += 1
        call, world = self.calls, self.world
        nbytes = tensor.numel() * tensor.element_size()
        base = (call % 2) * world * self.capacity
        slots = self.raw[base : base + world * self.capacity].view(world, self.capacity)
        mine = slots[self.rank, :nbytes].view(tensor.dtype)
        mine.copy_(tensor.reshape(-1))
        self.announced[self.rank] = call
        self._wait_for(call)
        return slots[:, :nbytes].view(tensor.dtype)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (``fits(tensor)`` must hold)."""
        values = self.exchange(tensor)
        # Summed straight into the tensor (its own values are in its slot by now): one
        # pass instead of a sum in a new tensor copied back. Each pass over a decode
        # step's [16, 2048] fp32 tensor runs on caches the products just evicted; a tp 2
        # rank of cpu-demo at batch 16 spent 4.1-5.3 ms per step in its 17 all-reduces
        # besides waiting for the other rank, 2.8-3.7 ms this way (wrapped timers; both
        # ranks of two runs each way).
        in_place = tensor.is_contiguous()
        flat = tensor.view(-1) if in_place else torch.empty_like(values[0])
        torch.add(values[0], values[1], out=flat)
        for j in range(2, self.world):
            flat.add_(values[j])
        if not in_place:  # a strided view (the eager GEMM's transposed output)
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` into ``out`` [world, *local.shape], in rank order."""
        out.copy_(self.exchange(local).view(out.shape))
        return out

    def _wait_for(self, call: int) -> None:
        announced = self.announced
        spins, deadline = 0, None
        while announced.min() < call:
            spins += 1
            if spins < self.spins:
                continue
            os.sched_yield()
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                late = [j for j in range(self.world) if announced[j] < call]
                raise TimeoutError(f"shared-memory collective: ranks {late} did not arrive")

    def close(self) -> None:
        self.raw = self.announced = None
        self.map.close()
