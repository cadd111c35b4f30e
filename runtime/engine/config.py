"""An engine's configuration, decided once.

``EngineOptions`` is every option of an engine as the user gives it (the Python API, the
command line, the server and the benchmark all build one); ``resolve`` turns it, on this
machine, into the facts every part then reads (``EngineFacts``: execution path, kernels,
threads, KV cache, shared-memory collectives, deinfer's up and down layouts) — each rule defined
here and nowhere else; ``RunnerConfig`` is what each rank receives: the spec, the plan
built once with those facts, and both of the above."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from dsl import MODES, Spec
from dsl.errors import UserError
from dsl.layout import LAYOUTS, OPTIMIZED, Merges
from dsl.plan import (
    DOWN_LAYOUTS,
    DOWN_REPLICATED,
    DOWN_SHARDED,
    UP_LAYOUTS,
    UP_REPLICATED,
    UP_SHARDED,
    ModePlan,
)
from runtime.dist import shm_collectives
from runtime.dist.emulated_link import LinkSpec
from runtime.dist.launcher import HEARTBEAT_S
from runtime.dist.torchrun_group import under_torchrun
from runtime.kernels import BACKENDS
from tune.cost_model import Workload
from tune.layout import choose_layout, merges_of
from tune.profiles import DeviceProfile, load_profile

PATHS = ("static", "dynamic")


@dataclass(frozen=True)
class EngineOptions:
    """Every option of an engine, as given; None (and ``auto``) is chosen by ``resolve``."""

    tp: int | None = None  # None: the spec's
    mode: str = "deinfer"  # deinfer | base | dense
    path: str | None = None  # static (fixed shapes, CUDA graphs) | dynamic (shapes follow)
    backend: str | None = None  # the static path's kernels: triton | torch
    kv_cache: str | None = None  # dense | latent | auto; None: the spec's
    threads: int | None = None  # intra-op threads per rank; None: cores // tp
    up_layout: str = "auto"  # deinfer's o/down up factors: auto | dsl.plan.UP_LAYOUTS
    # deinfer's column groups' down factors: auto (``auto_down_layout``: whole where the
    # ranks talk over gloo on the CPU path, in the optimized layout) | dsl.plan.DOWN_LAYOUTS
    down_layout: str = "auto"
    # deinfer's matrices: optimized (each merged or latent, as the cost model predicts
    # faster: tune.layout) | paper (every decomposed matrix latent, the paper's dataflow)
    layout: str = OPTIMIZED
    # The device profile (tune.profiles: a name or a .yaml path) the optimized layout is
    # chosen for; None: cpu-here on a CPU, a800-nvlink on a GPU.
    profile: str | None = None
    plan_batch: int | None = None  # decode rows the layout is chosen for; None: max batch
    shm_collectives: bool = True  # same-host CPU ranks talk through shared memory
    link: LinkSpec | str | None = None  # emulated link between the ranks (namespaces)
    # With a link: the emulated machines the ranks are spread over (tp // link_hosts
    # consecutive ranks on each, talking over its loopback); None: one machine per rank
    link_hosts: int | None = None
    num_blocks: int | None = None  # KV blocks; None: what kv_memory_bytes holds
    kv_memory_bytes: int = 256 << 20
    cuda_graphs: bool = True
    generated_root: str = "generated"
    timeout_s: float = 600.0  # a rank's answer to one call
    heartbeat_s: float = HEARTBEAT_S  # a rank silent this long is stopped or hung
    comm_stats: str = "off"  # off | count | timed (timed syncs the GPU around collectives)
    overlap: bool = True  # ring all-gather overlapped with the up-projection ...
    overlap_min_rows: int = 0  # ... in forwards of at least this many rows
    # Prompt tokens per prefill forward. 512 rows already make every GEMM of the 135M
    # model compute-bound here, and bound activations to O(512 · hidden) per layer.
    prefill_chunk: int = 512
    # Dynamic path on a CPU: measure the fastest form of each weight's product at start-up
    # (``runtime.kernels.cpu_gemm``); off, every product takes the untuned default.
    tune_gemm: bool = True
    # Tuning may keep a reordered copy of the weights whose shape multiplies fastest from
    # it (oneDNN's blocks or the native panels): in place of the weight where that form
    # takes every row count (``CpuGemm.release``), else beside it; off, the tuner chooses
    # among the forms that read the weights as stored.
    pack_weights: bool = True
    # Shapes tuning times at most; the others take the forms of their class's timed shape
    # (``runtime.kernels.gemm_tuning``): start-up stays bounded however many distinct
    # shapes per-layer ranks give.
    tune_budget: int = 16
    # Timings kept on disk (``DEINFER_CACHE_DIR``) so that a second start times nothing.
    tune_cache: bool = True
    # A weight of absurd magnitude (``runtime.model.checkpoint``) is a warning, not an error.
    allow_extreme_weights: bool = False


@dataclass(frozen=True)
class EngineFacts:
    """What ``EngineOptions`` come to on this machine for one spec."""

    path: str  # static | dynamic
    kernels: str  # the layers' kernels: "eager" on the dynamic path, else the backend
    kv_cache: str  # dense | latent | auto
    threads: int  # intra-op threads per rank
    shm_collectives: bool  # whether the ranks all-reduce and all-gather in shared memory
    up_layout: str  # deinfer's o/down up factors: replicated | sharded
    link: LinkSpec | None
    merges: Merges = field(default_factory=dict)  # deinfer's merged matrices per shape
    shared_cores: bool = False  # more ranks than this process's cores: they take turns
    down_layout: str = DOWN_SHARDED  # deinfer's column groups' down factors

    @property
    def static(self) -> bool:
        return self.path == "static"


def default_path() -> str:
    """Static (graph-safe, CUDA graphs) on a GPU; dynamic on a CPU, where host
    synchronisation is free and fixed shapes only waste work."""
    return "static" if torch.cuda.is_available() else "dynamic"


def usable_cores() -> int:
    """The cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def default_threads(tp: int) -> int:
    """Intra-op threads per rank: the cores this process may use, shared by the ranks."""
    return max(1, usable_cores() // tp)


def uses_shared_memory(requested: bool, tp: int, link: LinkSpec | None) -> bool:
    """Shared-memory collectives: asked for, between CPU ranks that all run on this host
    (the built-in launcher's always do; torchrun's when its local world is the whole
    world) and can share memory there, and no emulated link (every collective must
    cross it)."""
    one_host = not under_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == str(tp)
    return (
        requested
        and link is None
        and tp > 1
        and one_host
        and not torch.cuda.is_available()
        and shm_collectives.supported()
    )


def auto_up_layout(shared_memory: bool) -> str:
    """``auto``: split the o/down up factors where the ranks share memory — there an
    all-gather of the output costs less than streaming the replicated factors
    (docs/METHOD.md) — and replicate them, as the paper does, across a link."""
    return UP_SHARDED if shared_memory else UP_REPLICATED


def auto_down_layout(shared_memory: bool, path: str, tp: int, layout: str = OPTIMIZED) -> str:
    """``auto``: in the optimized layout, hold the column groups' down factors whole on
    every rank where CPU ranks talk over gloo (TCP: across a link, or without shared
    memory); split them where the ranks share memory, on the static path (its generated
    kernels take them split) and in the paper's layout (its dataflow, reproduced).

    Over gloo a collective costs far more inside a decode step than its idle latency
    (cpu-demo at param_count, tp 2, behind the emulated links: 0.6-0.7 ms above the
    cost model's per call), so two fewer per layer outweigh the down factors' bytes; in
    shared memory they do not. Whole vs split, decode tok/s of cpu-demo on the Xeon VM
    (docs/bench/vs-dense-cpu/down-layout/): behind ratio:0.373 1.23x / 1.05x (batch 16 /
    1), behind ratio:5.18 1.05x / 1.07x; in shared memory 0.92x / 0.90x (tp 2), 0.92x /
    0.88x (tp 4)."""
    gloo_on_cpu = not shared_memory and not torch.cuda.is_available()
    whole = tp > 1 and path == "dynamic" and gloo_on_cpu and layout == OPTIMIZED
    return DOWN_REPLICATED if whole else DOWN_SHARDED


def static_kernels(backend: str | None, path: str) -> str:
    """The static path's kernels: triton on a GPU, torch on a CPU; triton on a CPU only
    in Triton's interpreter (the dynamic path always runs the eager kernels)."""
    if backend is None:
        return "triton" if torch.cuda.is_available() else "torch"
    runnable = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and path == "static" and not runnable:
        raise UserError(
            "backend triton needs a GPU (or TRITON_INTERPRET=1 to run the kernels in "
            "Triton's interpreter on the CPU); on a CPU use the default path"
        )
    return backend


def _check(options: EngineOptions, kv: str) -> None:
    """One line naming the option that is not one of its choices."""
    if options.up_layout != "auto" and options.up_layout not in UP_LAYOUTS:
        raise UserError(
            f"up_layout must be auto or one of {', '.join(UP_LAYOUTS)}, found {options.up_layout!r}"
        )
    if options.down_layout != "auto" and options.down_layout not in DOWN_LAYOUTS:
        raise UserError(
            f"down_layout must be auto or one of {', '.join(DOWN_LAYOUTS)}, "
            f"found {options.down_layout!r}"
        )
    if options.backend is not None and options.backend not in BACKENDS:
        raise UserError(f"backend must be one of {', '.join(BACKENDS)}, found {options.backend!r}")
    if options.mode not in MODES:
        raise UserError(f"mode must be one of {', '.join(MODES)}, found {options.mode!r}")
    if options.path is not None and options.path not in PATHS:
        raise UserError(f"path must be one of {', '.join(PATHS)}, found {options.path!r}")
    if options.layout not in LAYOUTS:
        raise UserError(f"layout must be one of {', '.join(LAYOUTS)}, found {options.layout!r}")
    if options.plan_batch is not None and options.plan_batch < 1:
        raise UserError(f"plan_batch must be at least 1 row, found {options.plan_batch}")
    if options.tune_budget < 1:
        raise UserError(f"tune_budget must be at least 1 shape, found {options.tune_budget}")
    if kv == "latent" and options.mode != "deinfer":
        raise UserError(
            "a latent KV cache needs mode deinfer (base and dense hold no gathered latent)"
        )


def _check_link_hosts(hosts: int | None, link: LinkSpec | None, tp: int) -> None:
    if hosts is None:
        return
    if link is None:
        raise UserError("link_hosts spreads the ranks over emulated machines: it needs a link")
    if not 2 <= hosts <= tp or tp % hosts:
        raise UserError(f"link_hosts must divide tp {tp} into at least 2 machines, found {hosts}")


def resolve(options: EngineOptions, spec: Spec) -> EngineFacts:
    """The facts ``options`` come to for ``spec`` (planned for its tp) on this machine."""
    kv = options.kv_cache or spec.runtime.kv_cache
    _check(options, kv)
    path = options.path or default_path()
    if options.down_layout == DOWN_REPLICATED and path == "static":
        raise UserError(
            "down_layout replicated needs the dynamic path (the static path's generated "
            "kernels take the split down factors)"
        )
    kernels = static_kernels(options.backend, path) if path == "static" else "eager"
    link = LinkSpec.parse(options.link) if isinstance(options.link, str) else options.link
    tp = spec.parallel.tp
    _check_link_hosts(options.link_hosts, link, tp)
    shared = uses_shared_memory(options.shm_collectives, tp, link)
    layout = auto_up_layout(shared) if options.up_layout == "auto" else options.up_layout
    threads = options.threads or default_threads(tp)
    down = options.down_layout
    down = auto_down_layout(shared, path, tp, options.layout) if down == "auto" else down
    merges = planned_merges(options, spec, kv, layout, link, down, path)
    shared_cores = tp > usable_cores()
    return EngineFacts(
        path, kernels, kv, threads, shared, layout, link, merges, shared_cores, down
    )  # fmt: skip


def layout_profile(name: str | None, link: LinkSpec | None) -> DeviceProfile:
    """The device profile the layout is chosen for: ``name`` or this machine's kind, its
    link replaced by an emulated one's rate and latency where the ranks sit behind one."""
    dev = load_profile(name or ("a800-nvlink" if torch.cuda.is_available() else "cpu-here"))
    if link is None:
        return dev
    return replace(
        dev,
        link_bytes_per_s=min(dev.link_bytes_per_s, link.bytes_per_s),
        link_latency_s=dev.link_latency_s + link.latency_s,
    )


def planned_merges(
    options: EngineOptions,
    spec: Spec,
    kv: str,
    up_layout: str,
    link: LinkSpec | None,
    down_layout: str = DOWN_SHARDED,
    path: str = "dynamic",
) -> Merges:
    """deinfer's optimized layout for ``spec``: what ``tune.layout`` predicts fastest at
    ``plan_batch`` decode rows over half the longest context, with the resolved up and
    down layouts (nothing merged under the paper's layout or in the other modes; k and
    v kept latent for a latent cache)."""
    if options.mode != "deinfer" or options.layout != OPTIMIZED:
        return {}
    rt = spec.runtime
    work = Workload(options.plan_batch or rt.max_batch_size, rt.max_seq_len // 2, kv)
    dev = layout_profile(options.profile, link)
    keep = kv == "latent"
    # the native decode block (the CPU path, dense-cache layers) needs whole groups
    whole_groups = path == "dynamic" and not torch.cuda.is_available() and not keep
    choices = choose_layout(spec, dev, work, None, up_layout, keep, down_layout, whole_groups)
    return merges_of(choices)


@dataclass(frozen=True)
class RunnerConfig:
    """What every rank runs: ``spec`` (planned for the group's size), ``plan`` (its mode
    with the resolved up layout, built once by the driver), where the code and the
    weights are, and the engine's options and facts."""

    spec: Spec
    plan: ModePlan
    generated: str
    checkpoint: str
    num_blocks: int
    options: EngineOptions
    facts: EngineFacts
