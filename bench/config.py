"""What ``deinfer bench`` runs: its configuration and the named presets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dsl.errors import UserError


@dataclass(frozen=True)
class BenchConfig:
    spec: str
    modes: tuple[str, ...] = ("deinfer", "base", "dense")
    kv_caches: tuple[str, ...] = ("dense",)
    tps: tuple[int, ...] = (2, 4)
    ratios: tuple[float, ...] = ()  # compression ratios; () keeps the spec's ranks
    num_requests: int = 8
    prompt_len: int = 16
    output_len: int = 16
    max_batch: int = 8
    request_rate: float = float("inf")  # serving: requests/s (Poisson); inf: all at once
    serving_requests: int = 8
    breakdown_steps: int = 4
    reps: int = 3
    backend: str | None = None
    overlap: bool = True  # ring all-gather overlapped with the up-projection
    seed: int = 0
    # Decode batches: each throughput run submits that many requests at once; () runs
    # num_requests with at most max_batch at a time.
    batches: tuple[int, ...] = ()
    max_seq_lens: tuple[int, ...] = ()  # runtime.max_seq_len variants; (): prompt + output
    hf: bool = False  # add transformers generate on the same weights (the baseline)
    # add llama.cpp (llama-cpp-python, where installed) on the same weights as an fp32
    # GGUF, greedy, at the thread count of each tp 1 row (``bench.peer``)
    peer: bool = False
    threads: int | None = None  # intra-op threads per rank; None: cores // tp
    # Further tp 1 rows with these intra-op thread counts: the same cores used by one
    # process's threads instead of by ranks, the machine's own scaling that tensor
    # parallelism is set against ("vs tp 1").
    tp1_threads: tuple[int, ...] = ()
    # Each tp > 1 row again as its rank 0 alone in the bench's process, its collectives
    # waiting for no one (``rank_alone.RankAloneLLM``): the rank's own work per step, beside which
    # the real row shows what its ranks' synchronisation costs. Timing only.
    rank_alone: bool = False
    path: str | None = None  # static | dynamic; None: the machine's default
    # Emulated links between the ranks of tp > 1 rows: tc rates ("200mbit") or
    # "ratio:X", the rate at which Base's comm / compute per block is X (by the cost
    # model, ``bench.link_planner``). (): loopback.
    links: tuple[str, ...] = ()
    # Rows behind a link spread their ranks over this many emulated machines (tp // hosts
    # ranks each, loopback within one; rows whose tp it does not divide into 2 or more
    # are left out). None: one machine per rank.
    hosts: int | None = None
    serving: bool = True  # the Poisson serving run
    breakdown: bool = True  # the per-block communication breakdown
    # deinfer rows: layouts of the o/down up factors (RunnerConfig.up_layout), one row each
    up_layouts: tuple[str, ...] = ("auto",)
    # deinfer rows: layouts of the column groups' down factors (EngineOptions.down_layout)
    down_layouts: tuple[str, ...] = ("auto",)
    # deinfer rows: its matrices merged where predicted faster (optimized) or all latent
    # as in the paper; one row each
    layouts: tuple[str, ...] = ("optimized",)
    # how ``ratios`` become ranks: smaller_dim_fraction (the paper's rule) or param_count
    # (a real parameter cut)
    rule: str = "smaller_dim_fraction"
    # Engines tune their products with reordered weights (RunnerConfig.pack_weights)
    pack_weights: bool = True
    # Throughput runs (and breakdowns) of the engine rows of one batch and link take their
    # steps in turn, each engine timed over its own (``measure.lockstep_runs``,
    # ``lockstep_breakdowns``); transformers rows run alone.
    lockstep: bool = False
    # Start and measure the engines of one tp degree at a time (all repetitions, then
    # closed before the next degree's start); transformers' rows go with the first. For
    # presets whose engines do not all fit in memory at once; rows compared in lockstep
    # share a tp degree.
    phase_by_tp: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 2:
            raise UserError(
                f"bench: --prompt-len {self.prompt_len} and --output-len {self.output_len}: "
                "a prompt needs a token, and a decode step two output tokens"
            )
        if self.hosts is not None and (self.hosts < 2 or not self.links):
            raise UserError(
                f"bench: --hosts {self.hosts}: emulated machines need --link and number at least 2"
            )


# The paper's settings (§5.2, §5.3) scaled to a 2-core CPU: batch 512 / 32 prompt / max
# 160 and batch 64 / 64 prompt / max 512 become 16 / 8 / 40 and 4 / 16 / 128 (requests
# divided by 32 and 16, lengths by 4: the same prompt:output ratios, minutes instead of
# hours); serving (128 prompts, 32 in, 256 out) becomes 8 prompts, 8 in, 32 out.
PRESETS: dict[str, dict[str, Any]] = {
    # Smaller than the target model so that all of it runs in under 3 minutes on 2 cores.
    "cpu-smoke": {
        "spec": "specs/cpu-smoke.yaml",
        "tps": (2, 4),
        "num_requests": 4,
        "prompt_len": 8,
        "output_len": 8,
        "max_batch": 4,
        "serving_requests": 4,
        "breakdown_steps": 2,
        "reps": 3,
        "hf": True,
    },
    # The target measurement: hidden 2048, 8 layers, 40% ranks, tp 2 and 4;
    # deinfer both with its o/down up factors as ``auto`` holds them here (split: the
    # ranks share memory) and replicated as in the paper. 5 repetitions of 31 decode
    # steps: with 3 of 15 the rows' ranges overlapped by ±5% on this 2-core VM. In
    # lockstep: measured row after row, DeInfer/Base within single repetitions ranged
    # 0.93–1.31; in lockstep 1.01–1.06 (tp 2).
    "cpu-target": {
        "spec": "specs/cpu-demo.yaml",
        "tps": (2, 4),
        "num_requests": 8,
        "prompt_len": 8,
        "output_len": 32,
        "max_batch": 8,
        "serving_requests": 4,
        "breakdown_steps": 4,
        "reps": 5,
        "lockstep": True,
        "hf": True,
        "up_layouts": ("auto", "replicated"),
        # The engines of tp 2, then those of tp 4: all eight at once, each weight reordered
        # (its copy kept beside the weight, before ``CpuGemm.release``), a rank was killed
        # for memory on this 24 GB machine; the four of tp 4 alone, with releasing, used
        # 20.6 GB at their peak.
        "phase_by_tp": True,
    },
    # The CPU path against transformers on a 135M Llama (the shape of SmolLM2-135M) at
    # full rank: batch 1 and 16, and the step time with a 16x longer max_seq_len. In
    # lockstep: measured row after row, two engines that differed only in max_seq_len
    # were 11% apart (this VM's drift between rows).
    "cpu-hf": {
        "spec": "specs/cpu-135m.yaml",
        "modes": ("dense", "deinfer"),
        "tps": (1,),
        "batches": (1, 16),
        "max_seq_lens": (512, 8192),
        "prompt_len": 32,
        "output_len": 64,
        "lockstep": True,
        "hf": True,
        "serving": False,
        "breakdown": False,
    },
    # Batch-1 decode against llama.cpp, what a user would run a small model on a CPU with:
    # the 135M shape at full rank, dense and deinfer mode at tp 1 with two threads and
    # one, llama.cpp (llama-cpp-python, which must be installed) on the same weights as
    # an fp32 GGUF at the same thread counts, transformers beside them. Every row runs
    # alone (no lockstep), as the other programs' rows must: engines stepping in turn
    # evict each other's weights from the caches between steps, which llama.cpp alone
    # keeps (this VM reports a 480 MiB L3; the dense row at batch 1 measured 47.8 tok/s in
    # lockstep with three other engines, 51 alone).
    "cpu-peer": {
        "spec": "specs/cpu-135m.yaml",
        "modes": ("dense", "deinfer"),
        "tps": (1,),
        "batches": (1, 16),
        "tp1_threads": (1,),
        "prompt_len": 32,
        "output_len": 64,
        "reps": 5,
        "hf": True,
        "peer": True,
        "serving": False,
        "breakdown": False,
    },
    # Latent vs dense KV cache at context 256, batch 8 (deinfer mode, tp 1), at full rank
    # and at the paper's 40%. 5 repetitions: with 3, single rows spread by ±15% on this VM.
    # In lockstep: the latent row's step over the dense row's, one step apart, is what
    # this preset is for; transformers (products D·U, run alone) is the baseline beside it.
    "cpu-latent": {
        "spec": "specs/cpu-135m.yaml",
        "modes": ("deinfer",),
        "kv_caches": ("dense", "latent"),
        "ratios": (0.0, 0.4),
        "tps": (1,),
        "batches": (8,),
        "prompt_len": 240,
        "output_len": 32,
        "reps": 5,
        "lockstep": True,
        "hf": True,
        "serving": False,
        "breakdown": False,
    },
    # Tensor-parallel scaling with one thread per rank: dense mode, batch 16, tp 1 and 2
    # (on cpu-demo: the 135M model's 9 heads do not split over 2 ranks), and tp 1 once
    # more with two threads — what the same two cores give without ranks. In lockstep, 5
    # repetitions: row after row, 3 repetitions, tp 2 / tp 1 measured 1.585 on an AMD
    # EPYC VM whose two-core speed drifted by 10% between rows; in lockstep 1.59. The
    # two-thread row is followed by a pause while its threads stop spinning
    # (``measure._OPENMP_SPIN_S``): without it tp 2 ran at 91% of that row, with it 99–104%.
    # And tp 2's rank 0 alone, waiting for no one: the rank's own work per step.
    "cpu-tp-scaling": {
        "spec": "specs/cpu-demo.yaml",
        "modes": ("dense",),
        "tps": (1, 2),
        "batches": (16,),
        "threads": 1,
        "tp1_threads": (2,),
        "rank_alone": True,
        "prompt_len": 32,
        "output_len": 64,
        "reps": 5,
        "lockstep": True,
        "serving": False,
        "breakdown": False,
    },
    # The paper's Table 5 regime on this CPU: base, deinfer and dense at tp 2 behind
    # emulated links whose rate makes Base's comm / compute per block what Table 5 has
    # without NVLink (12.182 / 2.352 = 5.18) and with it (0.891 / 2.391 = 0.373), plus a
    # sweep around them. One all-gather per sub-layer (no ring overlap) so the breakdown
    # separates communication from compute as the paper's profile does.
    "paper-table5-cpu": {
        "spec": "specs/cpu-demo.yaml",
        "tps": (2,),
        "batches": (16,),
        "num_requests": 16,
        "max_batch": 16,
        "threads": 1,
        "prompt_len": 32,
        "output_len": 16,
        "links": ("ratio:0.373", "ratio:0.7", "ratio:1.5", "ratio:3", "ratio:5.18"),
        "overlap": False,
        "hf": True,
        "serving": False,
        # The per-block compute is read from these steps alone, once per row (the cache
        # holds output_len - 1 of them): every step the requests have, not 4.
        "breakdown_steps": 15,
        # The rows behind one link step in turn, their breakdowns too: taken one row
        # after another, one engine's own compute moved 9.7-22.6 ms a block between
        # repetitions on the AVX2 VM (docs/bench/paper-table5-cpu/2026-12-07-layers-own).
        "lockstep": True,
    },
    # When does the decomposed model serve faster than the dense one: cpu-demo at tp 2
    # and 4, deinfer in the optimized and the paper's layouts beside Base and the dense
    # model, batch 16 and 1, on loopback. Run once per rule: as is (the paper's rule,
    # 40 %) and with --rule param_count. Links: rows that differ only in their link share
    # an engine, whose layout is chosen at its start; run behind one link at a time
    # (--link ratio:0.373, then --link ratio:5.18).
    "vs-dense-cpu": {
        "spec": "specs/cpu-demo.yaml",
        "tps": (2, 4),
        "ratios": (0.4,),
        "batches": (16, 1),
        "num_requests": 16,
        "max_batch": 16,
        "prompt_len": 16,
        "output_len": 16,
        "layouts": ("optimized", "paper"),
        "hf": True,
        "serving": False,
        "breakdown": False,
        "lockstep": True,  # the engine rows of one batch step in turn (as cpu-target)
        "phase_by_tp": True,  # one tp degree's engines in memory at a time
    },
    "paper-high-load-cpu": {
        "spec": "specs/cpu-demo.yaml",
        "num_requests": 16,
        "prompt_len": 8,
        "output_len": 32,
        "max_batch": 16,
        "serving_requests": 8,
    },
    "paper-mild-load-cpu": {
        "spec": "specs/cpu-demo.yaml",
        "num_requests": 4,
        "prompt_len": 16,
        "output_len": 112,
        "max_batch": 4,
        "serving_requests": 4,
    },
    "paper-serving-cpu": {
        "spec": "specs/cpu-demo.yaml",
        "serving_requests": 8,
        "prompt_len": 8,
        "output_len": 32,
        "request_rate": 2.0,
        "num_requests": 8,
    },
    "paper-scaling-cpu": {
        "spec": "specs/cpu-demo.yaml",
        "ratios": (0.2, 0.4, 0.6),
        "tps": (4,),
        "modes": ("deinfer", "base"),
        "num_requests": 8,
        "prompt_len": 8,
        "output_len": 16,
    },
}


def preset(name: str, **overrides: Any) -> BenchConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}")
    return replace(BenchConfig(**PRESETS[name]), **overrides)
