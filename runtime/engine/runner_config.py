"""What one rank is asked to run (``RunnerConfig``) and the defaults chosen from the
machine: the execution path, the threads per rank, the layout of deinfer's up factors."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsl import Spec
from dsl.plan import UP_REPLICATED, UP_SHARDED
from runtime.dist.comm import Comm

PATHS = ("static", "dynamic")


def default_path() -> str:
    """Static (graph-safe, CUDA graphs) on a GPU; dynamic on a CPU, where host
    synchronisation is free and fixed shapes only waste work."""
    return "static" if torch.cuda.is_available() else "dynamic"


def default_threads(tp: int) -> int:
    """Intra-op threads per rank: the cores this process may use, shared by the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // tp)


def up_layout_for(requested: str, comm: Comm) -> str:
    """``auto``: split the o/down up factors where the ranks share memory — there an
    all-gather of the output costs less than streaming the replicated factors
    (docs/METHOD.md) — and replicate them, as the paper does, across a link."""
    if requested != "auto":
        return requested
    return UP_SHARDED if comm.shm is not None else UP_REPLICATED


@dataclass(frozen=True)
class RunnerConfig:
    spec: Spec  # planned for the group's size (parallel.tp == world)
    generated: str  # generated folder for that spec
    checkpoint: str
    mode: str
    backend: str  # static path: "triton" | "torch"; the dynamic path always runs "eager"
    kv_cache: str  # dense | latent | auto
    num_blocks: int
    cuda_graphs: bool = True
    comm_stats: str = "off"  # off | count | timed (timed syncs the GPU around collectives)
    overlap: bool = True  # ring all-gather overlapped with the up-projection ...
    overlap_min_rows: int = 0  # ... in forwards of at least this many rows
    path: str = "static"  # static | dynamic
    threads: int | None = None  # intra-op threads of this rank; None leaves torch's setting
    # Prompt tokens per prefill forward. 512 rows already make every GEMM of the 135M
    # model compute-bound here, and bound activations to O(512 · hidden) per layer.
    prefill_chunk: int = 512
    # CPU ranks on one host all-reduce through shared memory (tensors up to 4 MB, decode
    # sizes; larger ones through gloo).
    shm_collectives: bool = True
    # Dynamic path on a CPU: measure the fastest form of each weight's product at start-up
    # (``runtime.kernels.cpu_gemm``); off, every product takes the untuned default.
    tune_gemm: bool = True
    up_layout: str = "auto"  # deinfer's o/down up factors: auto | dsl.plan.UP_LAYOUTS
