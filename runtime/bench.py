"""``deinfer bench``: throughput, serving and per-block breakdown, side by side.

Every configuration (mode × KV cache × tp × compression ratio) gets one engine, kept
alive for the whole run; repetitions are interleaved across configurations (rep 1 of
all, then rep 2 of all, ...) after a warm-up, so slow drifts of the machine hit every
configuration alike. Checkpoints have random factors of the spec's shapes.
"""

from __future__ import annotations

import itertools
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from dsl import build_plan, parse_spec
from runtime.engine import LLM
from runtime.random_checkpoint import write_random_checkpoint
from runtime.sequence import SamplingParams


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


# The paper's settings (§5.2, §5.3) scaled to a 2-core CPU: batch 512 / 32 prompt / max
# 160 and batch 64 / 64 prompt / max 512 become 16 / 8 / 40 and 4 / 16 / 128 (requests
# and lengths divided by 32 and 4: same prompt:output ratios, minutes instead of hours);
# serving (128 prompts, 32 in, 256 out) becomes 8 prompts, 8 in, 32 out.
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
    },
    # The target measurement: hidden 2048, 8 layers, 40% ranks, tp 2 and 4.
    "cpu-target": {
        "spec": "specs/cpu-demo.yaml",
        "tps": (2, 4),
        "num_requests": 8,
        "prompt_len": 8,
        "output_len": 16,
        "max_batch": 8,
        "serving_requests": 4,
        "breakdown_steps": 4,
        "reps": 3,
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


@dataclass(frozen=True)
class Variant:
    mode: str
    kv_cache: str
    tp: int
    ratio: float | None

    @property
    def label(self) -> str:
        ratio = "" if self.ratio is None else f" r{self.ratio:g}"
        return f"{self.mode} kv={self.kv_cache} tp{self.tp}{ratio}"


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import triton

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _spec_text(base: str, tp: int, ratio: float | None, cfg: BenchConfig) -> str:
    raw = yaml.safe_load(base)
    raw.setdefault("parallel", {})["tp"] = tp
    if ratio is not None:
        raw["decomposition"] = {"ratio": ratio, "rule": "smaller_dim_fraction", "rank_multiple": 2}
    rt = raw.setdefault("runtime", {})
    rt["max_batch_size"] = max(cfg.max_batch, 1)
    rt["max_seq_len"] = cfg.prompt_len + cfg.output_len
    rt["cuda_graph_batch_sizes"] = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.max_batch]
    return yaml.safe_dump(raw, sort_keys=False)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def _prompts(cfg: BenchConfig, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(cfg.prompt_len)] for _ in range(n)]


def throughput_run(llm: LLM, cfg: BenchConfig, vocab: int) -> dict[str, float]:
    prompts = _prompts(cfg, cfg.num_requests, vocab, cfg.seed)
    params = SamplingParams(max_tokens=cfg.output_len)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in outs)
    first = max(o.token_times[0] for o in outs)
    decode_tokens = out_tokens - len(outs)
    decode_time = max(o.token_times[-1] for o in outs) - first
    return {
        "seconds": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + len(outs) * cfg.prompt_len) / elapsed,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
    }


def serving_run(llm: LLM, cfg: BenchConfig, vocab: int) -> dict[str, Any]:
    """Requests arrive at a Poisson rate (or all at once) while the engine steps."""
    rng = random.Random(cfg.seed + 1)
    prompts = _prompts(cfg, cfg.serving_requests, vocab, cfg.seed + 2)
    gaps = [
        0.0 if cfg.request_rate == float("inf") else rng.expovariate(cfg.request_rate)
        for _ in prompts
    ]
    params = SamplingParams(max_tokens=cfg.output_len)
    start = time.perf_counter()
    arrivals = [start + sum(gaps[: i + 1]) for i in range(len(prompts))]
    seqs, times, pending = [], {}, list(range(len(prompts)))
    while pending or llm.scheduler.has_work():
        now = time.perf_counter()
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            seq = llm.add_request(prompts[i], params)
            seqs.append((i, seq))
            times[seq.id] = []
        if not llm.scheduler.has_work():
            time.sleep(max(0.0, min(0.01, arrivals[pending[0]] - now)))
            continue
        for s, _, t in llm.step():
            times[s.id].append(t)
    elapsed = time.perf_counter() - start
    ttft, tpot, itl, e2e = [], [], [], []
    for i, seq in seqs:
        ts = times[seq.id]
        ttft.append(ts[0] - arrivals[i])
        e2e.append(ts[-1] - arrivals[i])
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
            itl += [b - a for a, b in itertools.pairwise(ts)]
    out_tokens = sum(len(times[s.id]) for _, s in seqs)
    ms = {
        k: {s: v * 1e3 for s, v in _summary(x).items()}
        for k, x in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e))
    }
    return {
        **ms,
        "requests_per_s": len(seqs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "request_rate": cfg.request_rate,
    }


def breakdown_run(llm: LLM, cfg: BenchConfig, vocab: int, layers: int) -> dict[str, Any]:
    """Per block and decode step: communication time (timed collectives) and the rest
    (compute plus runtime overhead), and what each collective kind moved per token per
    block (to compare with the plan)."""
    # A batch that fills a graph bucket exactly: no padded rows, so elements per token
    # are what the plan counts.
    n = 1 << (min(cfg.max_batch, cfg.num_requests).bit_length() - 1)
    prompts = _prompts(cfg, n, vocab, cfg.seed + 3)
    params = SamplingParams(max_tokens=cfg.breakdown_steps + 1)
    for p in prompts:
        llm.add_request(p, params)
    llm.step()  # prefill, not counted
    llm.workers.call("take_comm_stats")
    start = time.perf_counter()
    steps = tokens = 0
    while llm.scheduler.has_work():
        advanced = len(llm.step())
        steps += advanced > 0
        tokens += advanced
    elapsed = time.perf_counter() - start
    stats = llm.workers.call("take_comm_stats")[0]
    block = {k: v for k, v in stats.items() if ":" not in k}  # embedding/logits are tagged
    comm_ms = sum(v[2] for v in block.values()) / max(1, steps) / layers * 1e3
    total_ms = elapsed / max(1, steps) / layers * 1e3
    per_token = max(1, tokens) * layers
    return {
        "block_ms_per_step": {"communication": comm_ms, "compute_and_overhead": total_ms - comm_ms},
        "elements_per_token_per_block": {k: v[1] / per_token for k, v in block.items()},
        "collectives_per_token_per_block": {k: v[0] / per_token for k, v in block.items()},
        "decode_steps": steps,
        "decode_tokens": tokens,
    }


def planned_elements(spec_text: str, mode: str) -> dict[str, float]:
    spec = parse_spec(spec_text)
    mp = build_plan(spec).modes[mode]
    out: dict[str, float] = {}
    for lp in mp.layer_plans:
        for c in lp.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.elements * len(lp.layers) / mp.num_layers
    return out


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    base_text = Path(cfg.spec).read_text()
    variants = [
        Variant(m, kv, tp, r)
        for r in (cfg.ratios or (None,))
        for tp in cfg.tps
        for m in cfg.modes
        for kv in cfg.kv_caches
        if not (kv == "latent" and m != "deinfer")
    ]
    tmp = tempfile.TemporaryDirectory(prefix="deinfer-bench-")
    engines: dict[Variant, tuple[LLM, str]] = {}
    results: dict[str, Any] = {"config": asdict(cfg), "machine": machine(), "variants": []}
    try:
        made: dict[tuple, tuple[Path, Path]] = {}  # (ratio, tp) -> (spec, checkpoint)
        for v in variants:
            text = _spec_text(base_text, v.tp, v.ratio, cfg)
            spec = parse_spec(text, default_name=Path(cfg.spec).stem)
            if (v.ratio, v.tp) not in made:
                folder = Path(tmp.name) / f"model-{len(made)}"
                folder.mkdir()
                (folder / "spec.yaml").write_text(text)
                write_random_checkpoint(spec, folder / "checkpoint", cfg.seed)
                made[(v.ratio, v.tp)] = (folder / "spec.yaml", folder / "checkpoint")
            spec_path, ckpt = made[(v.ratio, v.tp)]
            if progress:
                progress(f"start {v.label}")
            blocks = (
                cfg.max_batch * -(-(cfg.prompt_len + cfg.output_len) // spec.runtime.block_size) + 1
            )
            common = {
                "mode": v.mode,
                "kv_cache": v.kv_cache,
                "backend": cfg.backend,
                "num_blocks": blocks,
                "overlap": cfg.overlap,
            }
            engines[v] = (LLM(spec_path, ckpt, **common), text)
        vocab = parse_spec(base_text).model.vocab_size
        layers = parse_spec(base_text).model.num_layers
        for llm, _ in engines.values():  # warm-up, excluded
            throughput_run(llm, replace(cfg, num_requests=1, output_len=2), vocab)
        raw: dict[Variant, dict[str, list]] = {
            v: {"throughput": [], "serving": []} for v in engines
        }
        for rep in range(cfg.reps):
            for v, (llm, _) in engines.items():
                if progress:
                    progress(f"rep {rep + 1}/{cfg.reps} {v.label}")
                raw[v]["throughput"].append(throughput_run(llm, cfg, vocab))
                raw[v]["serving"].append(serving_run(llm, cfg, vocab))
        for v, (llm, text) in engines.items():
            if progress:
                progress(f"breakdown {v.label}")
            llm.workers.call("set_comm_stats", "timed")
            results["variants"].append(
                {
                    **asdict(v),
                    "label": v.label,
                    "throughput": raw[v]["throughput"],
                    "serving": raw[v]["serving"],
                    "breakdown": breakdown_run(llm, cfg, vocab, layers),
                    "planned_elements_per_token_per_block": planned_elements(text, v.mode),
                }
            )
    finally:
        for llm, _ in engines.values():
            llm.close()
        tmp.cleanup()
    add_ratios(results)
    return results


def add_ratios(results: dict[str, Any]) -> None:
    """min/median/max over repetitions and the ratio of each median to base's."""
    medians: dict[tuple, float] = {}
    for var in results["variants"]:
        xs = [r["decode_tokens_per_s"] for r in var["throughput"]]
        var["decode_tokens_per_s"] = {
            "min": min(xs),
            "median": statistics.median(xs),
            "max": max(xs),
        }
        ys = [r["output_tokens_per_s"] for r in var["throughput"]]
        var["output_tokens_per_s"] = {
            "min": min(ys),
            "median": statistics.median(ys),
            "max": max(ys),
        }
        medians[(var["mode"], var["kv_cache"], var["tp"], var["ratio"])] = statistics.median(xs)
    for var in results["variants"]:
        base = medians.get(("base", "dense", var["tp"], var["ratio"]))
        var["decode_speedup_vs_base"] = (
            var["decode_tokens_per_s"]["median"] / base if base else None
        )
