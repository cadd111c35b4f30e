"""``deinfer predict --calibrate``: measure this machine's device profile.

Every rank measures at once (ranks share a CPU's memory bus and cores, so a rank's rates
are what it gets while the others run too), each with ``threads`` intra-op threads:
- memory: the weight bytes per second a decode-shaped GEMM streams (16 rows against
  [out, in] matrices far larger than the caches, as the dynamic path multiplies);
- matmul: FLOP/s of a GEMM of 512 rows, where the arithmetic, not memory, bounds it;
- per-operator overhead: a tiny elementwise op;
- link: bytes/s of one large all-gather (per rank received) and the per-step latency of
  a tiny all-reduce entered right after a product (so it holds the wait for the slower
  rank, as in a step), over loopback or, with ``link``, over an emulated link.
The slowest rank's figure is kept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from tune.profiles import DeviceProfile

WIDTH = 2048  # cpu-demo's hidden size: the calibration GEMMs are the model's shapes
MATRICES = 16  # 16 · 2048² fp32 = 256 MB: no cache holds it


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_compute(
    rank: int, world: int, shapes: list[tuple[int, int]] | None = None, reps: int = 5
) -> dict[str, float]:
    """This rank's GEMM streaming rate, matmul rate and per-operator overhead, measured
    while every rank of the group does the same (at the rank's current threads).

    ``shapes``: the (in, out) matrices streamed at 16 rows (default: 16 of 2048²; a
    bench passes the local GEMMs of its model, whose odd widths stream slower than
    square powers of two). Runs inside a worker (``WorkerGroup.run``), also inside a
    live engine's ranks, so a bench can re-measure between repetitions as the machine
    drifts."""
    import torch
    import torch.distributed as dist

    from runtime.kernels.eager import matmul

    shapes = shapes or [(WIDTH, WIDTH)] * MATRICES
    # Stored [out, in] and multiplied as the dynamic path does (runtime.kernels.eager.matmul).
    weights = [torch.randn(n_out, n_in).t() for n_in, n_out in shapes]
    rows16 = {n_in: torch.randn(16, n_in) for n_in, _ in shapes}
    rows512 = torch.randn(512, WIDTH)
    square = torch.randn(WIDTH, WIDTH).t()

    def stream() -> None:
        for w in weights:
            matmul(rows16[w.shape[0]], w)

    dist.barrier()
    stream_s = _median_seconds(stream, reps)
    dist.barrier()
    gemm_s = _median_seconds(lambda: matmul(rows512, square), reps)
    small = torch.ones(16)
    op_s = _median_seconds(lambda: [small.add(1.0) for _ in range(200)], reps) / 200
    return {
        "memory_bytes_per_s": sum(i * o for i, o in shapes) * 4 / stream_s,
        "matmul_flops_per_s": 2.0 * 512 * WIDTH * WIDTH / gemm_s,
        "op_overhead_s": op_s,
    }


def _probe_rank(rank: int, world: int, threads: int, matrices: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from runtime.dist.comm import all_gather_flat

    torch.set_num_threads(threads)
    result = {
        **probe_compute(rank, world, [(WIDTH, WIDTH)] * matrices),
        "link_bytes_per_s": float("inf"),
        "link_latency_s": 0.0,
    }
    if world > 1:
        local = torch.ones((4 << 20) // 4)
        out = torch.empty(world * local.numel())

        def gather() -> None:
            dist.barrier()
            all_gather_flat(out, local)

        gather_s = _median_seconds(gather, 3)
        barrier_s = _median_seconds(dist.barrier, 5)
        reduce_s = _loaded_reduce_seconds(reps=24)
        result["link_bytes_per_s"] = (world - 1) * local.numel() * 4 / (gather_s - barrier_s)
        result["link_latency_s"] = reduce_s / (2 * (world - 1))
    return result


def _loaded_reduce_seconds(reps: int) -> float:
    """Median time of a tiny all-reduce entered right after one decode-shaped product,
    as a step's collectives are: it includes the wait for the rank that finished its
    product last, which an all-reduce between idle ranks never sees. On a 2-vCPU Xeon a
    cpu-demo decode step at tp 2 (batch 16, the paper's rule) took 69.6 ms with its
    attention merged against 73.2 ms with k and v latent: their latent all-gather cost
    ~0.45 ms per block, where the idle-measured latency predicted ~0.15."""
    import torch
    import torch.distributed as dist

    from runtime.kernels.eager import matmul

    weight = torch.randn(WIDTH, WIDTH).t()  # 16 MB: one projection of cpu-demo
    rows = torch.randn(16, WIDTH)
    tiny = torch.ones(1)
    times = []
    dist.barrier()
    for _ in range(reps):
        matmul(rows, weight)
        start = time.perf_counter()
        dist.all_reduce(tiny)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest_rank(ranks: list[dict[str, float]]) -> dict[str, float]:
    """The slowest rank's figure of each measurement (highest time, lowest rate)."""
    return {key: (max if key.endswith("_s") else min)(r[key] for r in ranks) for key in ranks[0]}


def calibrate(
    tp: int = 2,
    threads: int = 1,
    link=None,
    name: str = "cpu-here",
    matrices: int = MATRICES,
) -> DeviceProfile:
    """Measure this machine with ``tp`` ranks of ``threads`` threads each (``matrices``
    of 2048² streamed per pass: fewer only to test the mechanics, they fit in caches)."""
    import platform

    from runtime.dist.launcher import WorkerGroup

    with WorkerGroup(tp, timeout_s=300, link=link) as group:
        ranks = group.run(_probe_rank, threads, matrices)
    where = "loopback" if link is None else f"an emulated link of {link.describe()}"
    return DeviceProfile(
        name=name,
        description=(
            f"{platform.processor() or platform.machine()}: {tp} ranks of {threads} thread(s), "
            f"collectives over {where}"
        ),
        source="deinfer predict --calibrate (measured)",
        **slowest_rank(ranks),
    )
