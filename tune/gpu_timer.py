"""Timing of one generated kernel launch on a GPU with CUDA-graph replay."""

from __future__ import annotations

from types import ModuleType

import torch

from tune.tuner import TuneJob


def _inputs(module: ModuleType, job: TuneJob, rows: int, dtype: torch.dtype):
    dev, family = "cuda", job.family
    if family == "gemm_fixed":  # one module holds every (K, N): the job says which
        k, n = job.k, job.n
        a, b = (
            torch.randn(rows, k, device=dev, dtype=dtype),
            torch.randn(k, n, device=dev, dtype=dtype),
        )
        out = torch.empty(rows, n, device=dev, dtype=dtype)
        n_valid = torch.tensor([rows], device=dev, dtype=torch.int32)
        return lambda meta: module.gemm_fixed(a, b, out, n_valid, meta=meta)
    kernel = job.kernel(module)
    if family == "down_proj":
        k, w = kernel.in_features, kernel.width
        x = torch.randn(rows, k, device=dev, dtype=dtype)
        weight = torch.randn(k, w, device=dev, dtype=dtype)
        norm = torch.ones(k, device=dev, dtype=dtype)
        out = torch.empty(rows, w, device=dev, dtype=dtype)
        return lambda meta: kernel.down_proj(x, weight, out, norm, meta=meta)
    if family == "latent_up":
        widths = kernel.out_widths[: len(kernel.ranks)]
        ups = tuple(
            torch.randn(r, n, device=dev, dtype=dtype)
            for r, n in zip(kernel.ranks, widths, strict=True)
        )
        chunk = torch.randn(rows, kernel.chunk, device=dev, dtype=dtype)
        accs = tuple(torch.zeros(rows, n, device=dev, dtype=torch.float32) for n in widths)
        # The chunk with the most work stands for all.
        index = max(
            range(len(kernel.segments)), key=lambda j: sum(s[2] for s in kernel.segments[j])
        )
        return lambda meta: kernel.latent_up_chunk(chunk, index, ups, accs, meta=meta)
    raise ValueError(f"{family} is not tunable")


def cuda_graph_timer(dtype: torch.dtype = torch.bfloat16):
    """A ``tune.tuner.Timer``: median ms of graph-replayed launches."""
    import triton.testing

    def timer(module: ModuleType, job: TuneJob, rows: int, meta: dict) -> float:
        launch = _inputs(module, job, rows, dtype)
        launch(meta)  # compile outside the graph
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(lambda: launch(meta), rep=20))

    return timer


def cublas_ms(n: int, k: int, rows: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """torch.matmul (cuBLAS) on the same [rows, k] · [k, n] shape, for comparison."""
    import triton.testing

    a = torch.randn(rows, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    return float(triton.testing.do_bench_cudagraph(lambda: torch.matmul(a, b), rep=20))
