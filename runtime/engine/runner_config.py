"""What one rank is asked to run (``RunnerConfig``), the checks of the engine's options,
and the defaults chosen from the machine: the execution path, the static path's kernels,
the threads per rank, the layout of deinfer's up factors."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsl import MODES, Spec
from dsl.errors import UserError
from dsl.plan import UP_LAYOUTS, UP_REPLICATED, UP_SHARDED
from runtime.dist.comm import Comm
from runtime.kernels import BACKENDS

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
    """``requested``, with ``auto`` resolved for ranks that talk through ``comm``."""
    return auto_up_layout(comm.shm is not None) if requested == "auto" else requested


def auto_up_layout(shared_memory: bool) -> str:
    """``auto``: split the o/down up factors where the ranks share memory — there an
    all-gather of the output costs less than streaming the replicated factors
    (docs/METHOD.md) — and replicate them, as the paper does, across a link."""
    return UP_SHARDED if shared_memory else UP_REPLICATED


def check_choices(mode: str, path: str | None, kv: str, up_layout: str) -> None:
    """One line naming the engine option that is not one of its choices."""
    if up_layout != "auto" and up_layout not in UP_LAYOUTS:
        raise UserError(
            f"up_layout must be auto or one of {', '.join(UP_LAYOUTS)}, found {up_layout!r}"
        )
    if mode not in MODES:
        raise UserError(f"mode must be one of {', '.join(MODES)}, found {mode!r}")
    if path is not None and path not in PATHS:
        raise UserError(f"path must be one of {', '.join(PATHS)}, found {path!r}")
    if kv == "latent" and mode != "deinfer":
        raise UserError(
            "a latent KV cache needs mode deinfer (base and dense hold no gathered latent)"
        )


def backend_for(backend: str | None, path: str) -> str:
    """The static path's kernels: triton on a GPU, torch on a CPU; triton on a CPU only
    in Triton's interpreter (the dynamic path always runs the eager kernels)."""
    if backend is None:
        return "triton" if torch.cuda.is_available() else "torch"
    if backend not in BACKENDS:
        raise UserError(f"backend must be one of {', '.join(BACKENDS)}, found {backend!r}")
    runnable = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and path == "static" and not runnable:
        raise UserError(
            "backend triton needs a GPU (or TRITON_INTERPRET=1 to run the kernels in "
            "Triton's interpreter on the CPU); on a CPU use the default path"
        )
    return backend


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
    # Tuning may keep a reordered copy of the weights whose shape multiplies fastest from
    # it (oneDNN's blocks or the native panels): in place of the weight where that form
    # takes every row count (``CpuGemm.release``), else beside it; off, the tuner chooses
    # among the forms that read the weights as stored.
    pack_weights: bool = True
    up_layout: str = "auto"  # deinfer's o/down up factors: auto | dsl.plan.UP_LAYOUTS
    # A weight of absurd magnitude (``runtime.model.checkpoint``) is a warning, not an error.
    allow_extreme_weights: bool = False
