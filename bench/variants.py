"""The bench's rows: one ``Variant`` per configuration, its spec, and the machine."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.config import BenchConfig
from dsl import Spec, build_plan, with_ratio, with_runtime, with_tp
from dsl.layout import OPTIMIZED
from dsl.plan import DOWN_SHARDED, UP_REPLICATED

# The rows that run another program on the same weights: what a user would pick instead.
EXTERNAL_MODES = ("hf", "llama.cpp")


@dataclass(frozen=True)
class Variant:
    mode: str  # deinfer | base | dense | hf (transformers generate) | llama.cpp (``peer``)
    kv_cache: str
    tp: int
    ratio: float | None
    batch: int | None = None  # None: num_requests, max_batch at a time
    max_seq_len: int | None = None  # None: prompt + output
    link: str | None = None  # an emulated link (BenchConfig.links); None: loopback
    up_layout: str = "auto"  # deinfer's o/down up factors (RunnerConfig.up_layout)
    threads: int | None = None  # intra-op threads per rank; None: the bench's (``_threads``)
    # rank 0 of this tp degree alone in the bench's process, no collectives: the rank's
    # own work per step (``rank_alone``; timing only)
    alone: bool = False
    hosts: int | None = None  # behind a link: emulated machines the ranks are spread over
    layout: str = OPTIMIZED  # deinfer's matrices merged as predicted faster, or the paper's
    down_layout: str = "auto"  # deinfer's column groups' down factors (EngineOptions)

    @property
    def external(self) -> bool:
        """Whether the row runs another program on the same weights (transformers,
        llama.cpp) instead of this engine."""
        return self.mode in EXTERNAL_MODES

    @property
    def label(self) -> str:
        kv = "" if self.external else f" kv={self.kv_cache}"
        kv += "" if self.up_layout == "auto" else f" up={self.up_layout}"
        kv += "" if self.layout == OPTIMIZED else f" layout={self.layout}"
        kv += "" if self.down_layout == "auto" else f" down={self.down_layout}"
        ratio = "" if self.ratio is None else f" r{self.ratio:g}"
        batch = "" if self.batch is None else f" b{self.batch}"
        length = "" if self.max_seq_len is None else f" len{self.max_seq_len}"
        link = "" if self.link is None else f" link={self.link}"
        link += "" if self.hosts is None else f" hosts={self.hosts}"
        threads = "" if self.threads is None else f" threads={self.threads}"
        alone = " rank alone" if self.alone else ""
        return f"{self.mode}{kv} tp{self.tp}{ratio}{batch}{length}{link}{threads}{alone}"

    @property
    def engine(self) -> tuple:
        """Rows that differ only in batch or link share one engine (links are reshaped
        in place between rows)."""
        return (
            self.mode,
            self.kv_cache,
            self.tp,
            self.ratio,
            self.max_seq_len,
            self.up_layout,
            self.threads,
            self.alone,
            self.hosts,
            self.layout,
            self.down_layout,
        )

    @property
    def in_process(self) -> bool:
        """Whether the row's engine computes in the bench's process (tp 1, or one rank
        alone), whose intra-op thread count the bench sets before each of its steps."""
        return self.tp == 1 or self.alone


def machine() -> dict[str, Any]:
    first: dict[str, str] = {}  # each field of /proc/cpuinfo as the first core gives it
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            first.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = first.get("model name") or platform.processor()
    flags = set(first.get("flags", "").split())
    import triton

    return {
        "cpu": cpu,
        "vector_isa": vector_isa(flags),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def vector_isa(flags: set[str]) -> str | None:
    """The widest vector instructions among the CPU's ``flags`` (/proc/cpuinfo): the same
    model name hides VMs with and without AVX-512, and the native kernels' speed
    differs between them."""
    widest = next((name for flag, name in _VECTOR_FLAGS if flag in flags), None)
    if widest and "amx_tile" in flags:
        return f"{widest} + AMX"
    return widest


def cpu_times(stat: str | None = None) -> list[int] | None:
    """The machine's CPU time counters (``/proc/stat``'s ``cpu`` line: user, nice,
    system, idle, iowait, irq, softirq, steal, ...), or None where there are none."""
    if stat is None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return None
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu" and len(fields) >= 9:
            return [int(f) for f in fields[1:]]
    return None


def steal_fraction(before: list[int] | None, after: list[int] | None) -> float | None:
    """Of the CPU time that passed between two ``cpu_times``, the part the hypervisor
    gave to other guests (steal): on a shared VM the same run drifts with it, and a tp
    rank that loses its core holds up the others at the next collective."""
    if before is None or after is None:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent[:8])  # guest time (fields 9-10) is already counted in user
    return spent[7] / total if total > 0 else None


_VECTOR_FLAGS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2"))


def max_batch(cfg: BenchConfig) -> int:
    return max((*cfg.batches, cfg.max_batch, 1))


def variant_spec(base: Spec, v: Variant, cfg: BenchConfig) -> Spec:
    """The bench's spec for one row: the row's tp and ratio, room for the bench's batch
    and lengths."""
    spec = with_tp(base, v.tp)
    if v.ratio is not None:
        spec = with_ratio(spec, v.ratio, cfg.rule, rank_multiple=2)
    return with_runtime(
        spec,
        max_batch_size=max_batch(cfg),
        max_seq_len=v.max_seq_len or cfg.prompt_len + cfg.output_len,
        cuda_graph_batch_sizes=[b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch(cfg)],
    )


def planned_elements(
    spec, mode: str, up_layout: str = UP_REPLICATED, down_layout: str = DOWN_SHARDED
) -> dict[str, float]:
    mp = build_plan(spec, up_layout=up_layout, down_layout=down_layout).modes[mode]
    out: dict[str, float] = {}
    for lp in mp.layer_plans:
        for c in lp.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.elements * len(lp.layers) / mp.num_layers
    return out


def variants_of(cfg: BenchConfig) -> list[Variant]:
    batches = cfg.batches or (None,)
    lengths = cfg.max_seq_lens or (None,)
    rows = [
        Variant(m, kv, tp, r, b, n, link, up, threads, layout=layout, down_layout=down)
        for r in (cfg.ratios or (None,))
        for tp in cfg.tps
        for link in (cfg.links or (None,) if tp > 1 else (None,))
        for n in lengths
        for m in cfg.modes
        for kv in cfg.kv_caches
        for b in batches
        for up in (cfg.up_layouts if m == "deinfer" else ("auto",))
        for layout in (cfg.layouts if m == "deinfer" else (OPTIMIZED,))
        for down in (cfg.down_layouts if m == "deinfer" else ("auto",))
        for threads in (None, *(cfg.tp1_threads if tp == 1 else ()))
        if not (kv == "latent" and m != "deinfer")
    ]
    if cfg.hosts is not None:  # linked rows across emulated machines; the others as they are
        rows = [
            replace(v, hosts=cfg.hosts) if v.link else v
            for v in rows
            if not v.link or (v.tp >= cfg.hosts and v.tp % cfg.hosts == 0)
        ]
    if cfg.rank_alone:  # each loopback tp > 1 engine row, then its rank 0 alone
        alone = [(v, replace(v, alone=True)) if v.tp > 1 and v.link is None else (v,) for v in rows]
        rows = [row for pair in alone for row in pair]
    ratios = cfg.ratios or (None,)
    if cfg.hf:
        rows += [Variant("hf", "-", 1, r, b) for r in ratios for b in batches]
    if cfg.peer:  # llama.cpp at each thread count a tp 1 engine row has
        rows += [
            Variant("llama.cpp", "-", 1, r, b, threads=threads)
            for r in ratios
            for b in batches
            for threads in (None, *cfg.tp1_threads)
        ]
    return rows


def phases(cfg: BenchConfig) -> list[list[Variant]]:
    """The rows whose engines live at once: all of them, or (``phase_by_tp``) those of
    each tp degree, transformers' rows with the first."""
    variants = variants_of(cfg)
    if not cfg.phase_by_tp:
        return [variants]
    engines = [v for v in variants if not v.external]
    groups = [[v for v in engines if v.tp == tp] for tp in dict.fromkeys(v.tp for v in engines)]
    groups[0] += [v for v in variants if v.external]
    return groups
