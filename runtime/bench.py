"""``deinfer bench``: throughput, serving and per-block breakdown, side by side.

Every configuration (mode × KV cache × tp × compression ratio × max_seq_len) gets one
engine, kept alive for the whole run, and is measured at each decode batch; with ``hf``,
transformers ``generate`` on the same weights runs beside them. Repetitions are
interleaved across everything (rep 1 of all, then rep 2 of all, ...) after a warm-up,
so slow drifts of the machine hit every row alike. Checkpoints have random factors of
the spec's shapes. Each row is also set against the weight-streaming floor: the bytes a
decode step must read over the memory bandwidth the bench measures.
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
from typing import Any, Protocol

import torch
import yaml

from dsl import build_plan, parse_spec
from runtime.bench_baseline import hf_throughput, memory_bandwidth
from runtime.bench_config import PRESETS, BenchConfig, preset
from runtime.emulated_link import LinkSpec
from runtime.engine import LLM
from runtime.model_runner import default_path, default_threads
from runtime.random_checkpoint import write_random_checkpoint
from runtime.sequence import SamplingParams

__all__ = ["PRESETS", "BenchConfig", "preset", "run_bench"]


@dataclass(frozen=True)
class Variant:
    mode: str  # deinfer | base | dense | hf (transformers generate)
    kv_cache: str
    tp: int
    ratio: float | None
    batch: int | None = None  # None: num_requests, max_batch at a time
    max_seq_len: int | None = None  # None: prompt + output
    link: str | None = None  # an emulated link (BenchConfig.links); None: loopback

    @property
    def label(self) -> str:
        kv = "" if self.mode == "hf" else f" kv={self.kv_cache}"
        ratio = "" if self.ratio is None else f" r{self.ratio:g}"
        batch = "" if self.batch is None else f" b{self.batch}"
        length = "" if self.max_seq_len is None else f" len{self.max_seq_len}"
        link = "" if self.link is None else f" link={self.link}"
        return f"{self.mode}{kv} tp{self.tp}{ratio}{batch}{length}{link}"

    @property
    def engine(self) -> tuple:
        """Rows that differ only in batch or link share one engine (links are reshaped
        in place between rows)."""
        return (self.mode, self.kv_cache, self.tp, self.ratio, self.max_seq_len)


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


def _max_batch(cfg: BenchConfig) -> int:
    return max((*cfg.batches, cfg.max_batch, 1))


def _spec_text(base: str, v: Variant, cfg: BenchConfig) -> str:
    raw = yaml.safe_load(base)
    raw.setdefault("parallel", {})["tp"] = v.tp
    if v.ratio is not None:
        raw["decomposition"] = {
            "ratio": v.ratio,
            "rule": "smaller_dim_fraction",
            "rank_multiple": 2,
        }
    rt = raw.setdefault("runtime", {})
    rt["max_batch_size"] = _max_batch(cfg)
    rt["max_seq_len"] = v.max_seq_len or cfg.prompt_len + cfg.output_len
    rt["cuda_graph_batch_sizes"] = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= _max_batch(cfg)]
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


def throughput_run(
    llm: LLM, cfg: BenchConfig, vocab: int, batch: int | None = None
) -> dict[str, float]:
    prompts = _prompts(cfg, batch or cfg.num_requests, vocab, cfg.seed)
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
    rank_ms = stats.get("step:rank", (0, 0, elapsed))[2] / max(1, steps) / layers * 1e3
    per_token = max(1, tokens) * layers
    return {
        "block_ms_per_step": {"communication": comm_ms, "compute_and_overhead": total_ms - comm_ms},
        # The same step seen from rank 0 (its forward and sampling, without the driver's
        # scheduling and the messages to and from the ranks), per block.
        "rank_ms_per_step_per_block": rank_ms,
        "driver_ms_per_step": (total_ms - rank_ms) * layers,
        "elements_per_token_per_block": {k: v[1] / per_token for k, v in block.items()},
        "collectives_per_token_per_block": {k: v[0] / per_token for k, v in block.items()},
        "decode_steps": steps,
        "decode_tokens": tokens,
    }


def planned_elements(spec, mode: str) -> dict[str, float]:
    mp = build_plan(spec).modes[mode]
    out: dict[str, float] = {}
    for lp in mp.layer_plans:
        for c in lp.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.elements * len(lp.layers) / mp.num_layers
    return out


def variants_of(cfg: BenchConfig) -> list[Variant]:
    batches = cfg.batches or (None,)
    lengths = cfg.max_seq_lens or (None,)
    rows = [
        Variant(m, kv, tp, r, b, n, link)
        for r in (cfg.ratios or (None,))
        for tp in cfg.tps
        for link in (cfg.links or (None,) if tp > 1 else (None,))
        for n in lengths
        for m in cfg.modes
        for kv in cfg.kv_caches
        for b in batches
        if not (kv == "latent" and m != "deinfer")
    ]
    if cfg.hf:
        rows += [Variant("hf", "-", 1, r, b) for r in (cfg.ratios or (None,)) for b in batches]
    return rows


class _Models:
    """Spec files and random checkpoints in a temporary folder, one checkpoint per ratio."""

    def __init__(self, cfg: BenchConfig, folder: Path) -> None:
        self.cfg, self.folder = cfg, folder
        self.base_text = Path(cfg.spec).read_text()
        self.checkpoints: dict[float | None, Path] = {}

    def spec(self, v: Variant) -> Path:
        text = _spec_text(self.base_text, v, self.cfg)
        path = self.folder / f"spec-{abs(hash(text))}.yaml"
        path.write_text(text)
        if v.ratio not in self.checkpoints:
            ckpt = self.folder / f"checkpoint-{len(self.checkpoints)}"
            spec = parse_spec(text, default_name=Path(self.cfg.spec).stem)
            write_random_checkpoint(spec, ckpt, self.cfg.seed)
            self.checkpoints[v.ratio] = ckpt
        return path


class LinkPlanner(Protocol):
    """What turns ``BenchConfig.links`` entries into tc rates and predicts each row
    (``tune.link_planner`` has the one built on the cost model)."""

    def resolve(self, cfg: BenchConfig, fit: tuple[str, Any, float]) -> dict[str, str]: ...

    def describe(self) -> dict[str, Any]: ...

    def probe(self, engine: Any, v: Variant) -> None: ...

    def predict(self, spec: Any, v: Variant, cfg: BenchConfig) -> dict: ...


FAST_LINK = "8000000000bit"  # far above what gloo over TCP carries here


def _fit_block(variants, engines, specs, cfg: BenchConfig, vocab: int) -> tuple:
    """(mode, engine, measured compute ms per block) of one linked engine — Base's where
    it runs — measured behind the fast link: what the planner fits its compute scale on."""
    linked = [v for v in variants if v.link and v.mode != "hf"]
    v = next((v for v in linked if v.mode == "base"), linked[0])
    engine, spec = engines[v.engine], specs[v.engine]
    engine.workers.call("set_comm_stats", "timed")
    block = breakdown_run(engine, cfg, vocab, spec.model.num_layers)["block_ms_per_step"]
    engine.workers.call("set_comm_stats", "off")
    return v.mode, engine, block["compute_and_overhead"]


def _switch_link(v: Variant, engine, rates: dict[str, str], links: dict[str, Any]) -> None:
    """Reshape ``engine``'s links to ``v``'s; the first time a link is used, measure it."""
    if v.link is None or v.mode == "hf":
        return
    want = LinkSpec.parse(rates[v.link])
    if engine.link != want:
        probe = engine.set_link(want, probe="probe" not in links[v.link])
        if probe:
            links[v.link]["probe"] = probe
    elif "probe" not in links[v.link]:
        links[v.link]["probe"] = engine.workers.link_probe


def _start(v: Variant, models: _Models, cfg: BenchConfig, link: str | None = None):
    spec_path = models.spec(v)
    ckpt = models.checkpoints[v.ratio]
    spec = parse_spec(spec_path.read_text(), default_name=Path(cfg.spec).stem)
    if v.mode == "hf":
        from runtime.hf_reference import load_transformers

        return load_transformers(spec, ckpt), spec
    blocks = _max_batch(cfg) * -(-(cfg.prompt_len + cfg.output_len) // spec.runtime.block_size)
    llm = LLM(
        spec_path,
        ckpt,
        mode=v.mode,
        kv_cache=v.kv_cache,
        backend=cfg.backend,
        num_blocks=blocks + 1,
        overlap=cfg.overlap,
        path=cfg.path,
        threads=cfg.threads,
        link=link if v.tp > 1 else None,
    )
    return llm, spec


def _threads(cfg: BenchConfig, tp: int) -> int:
    return cfg.threads or default_threads(tp)


def _measure(v: Variant, engine, cfg: BenchConfig, vocab: int) -> dict[str, Any]:
    """One throughput run (and a serving run for engines), at the row's thread count."""
    if v.mode == "hf":
        torch.set_num_threads(_threads(cfg, 1))
        prompts = _prompts(cfg, v.batch or cfg.num_requests, vocab, cfg.seed)
        return {"throughput": hf_throughput(engine, prompts, cfg.output_len)}
    if v.tp == 1:  # this process is the rank: other rows may have changed its threads
        engine.workers.call("threads", _threads(cfg, 1))
    out = {"throughput": throughput_run(engine, cfg, vocab, v.batch)}
    if cfg.serving:
        out["serving"] = serving_run(engine, cfg, vocab)
    return out


def _streamed_bytes(v: Variant, engine) -> int:
    if v.mode != "hf":
        return engine.workers.call("streamed_weight_bytes")[0]
    named = engine.named_parameters(remove_duplicate=False)
    return sum(p.numel() * p.element_size() for n, p in named if "embed_tokens" not in n)


def run_bench(
    cfg: BenchConfig,
    progress: Callable[[str], None] | None = None,
    planner: LinkPlanner | None = None,
) -> dict[str, Any]:
    """Measure every variant of ``cfg``. Links given as plain tc rates need no
    ``planner``; others (e.g. ``ratio:5.2``) are resolved by it, which also predicts
    each row."""
    note = progress or (lambda message: None)
    variants = variants_of(cfg)
    tmp = tempfile.TemporaryDirectory(prefix="deinfer-bench-")
    engines: dict[tuple, Any] = {}
    specs: dict[tuple, Any] = {}
    cores = default_threads(1)
    results: dict[str, Any] = {"config": asdict(cfg), "machine": machine(), "variants": []}
    results["machine"]["memory_bandwidth_bytes_per_s"] = memory_bandwidth(cores)
    results["machine"]["bandwidth_threads"] = cores
    # Engines start behind a fast link; links given as a ratio are resolved once the
    # planner has measured a block here (it needs the real compute to set the rate).
    rates = {link: link if planner is None else FAST_LINK for link in cfg.links}
    try:
        models = _Models(cfg, Path(tmp.name))
        for v in variants:
            if v.engine not in engines:
                note(f"start {v.label}")
                link = rates[v.link] if v.link else None
                engines[v.engine], specs[v.engine] = _start(v, models, cfg, link)
        vocab = parse_spec(models.base_text).model.vocab_size
        if cfg.links:
            if planner:
                note("calibrate the cost model on a measured block")
                rates = planner.resolve(cfg, _fit_block(variants, engines, specs, cfg, vocab))
                results["planner"] = planner.describe()
            results["links"] = {link: {"rate": rates[link]} for link in cfg.links}
        links = results.get("links", {})
        for v in variants:  # warm-up, excluded
            _switch_link(v, engines[v.engine], rates, links)
            short = replace(cfg, num_requests=1, output_len=2, serving=False)
            _measure(replace(v, batch=1), engines[v.engine], short, vocab)
        raw: dict[Variant, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(cfg.reps):
            for v in variants:
                note(f"rep {rep + 1}/{cfg.reps} {v.label}")
                _switch_link(v, engines[v.engine], rates, links)
                raw[v].append(_measure(v, engines[v.engine], cfg, vocab))
                if planner and v.link:
                    planner.probe(engines[v.engine], v)
        for v in variants:
            _switch_link(v, engines[v.engine], rates, links)
            row = _row(v, raw[v], engines[v.engine], specs[v.engine], cfg)
            if planner and v.link:
                row["predicted"] = planner.predict(specs[v.engine], v, cfg)
            results["variants"].append(row)
        if planner:
            results["planner"] = planner.describe()
    finally:
        for key, engine in engines.items():
            if key[0] != "hf":
                engine.close()
        tmp.cleanup()
    add_ratios(results)
    return results


def _row(v: Variant, runs: list[dict[str, Any]], engine, spec, cfg: BenchConfig) -> dict:
    row = {
        **asdict(v),
        "label": v.label,
        "threads_per_rank": _threads(cfg, v.tp),
        "path": None if v.mode == "hf" else cfg.path or default_path(),
        "throughput": [r["throughput"] for r in runs],
        "serving": [r["serving"] for r in runs if "serving" in r],
        "streamed_weight_bytes_per_rank": _streamed_bytes(v, engine),
    }
    if v.mode != "hf" and cfg.breakdown:
        engine.workers.call("set_comm_stats", "timed")
        row["breakdown"] = breakdown_run(engine, cfg, spec.model.vocab_size, spec.model.num_layers)
        row["planned_elements_per_token_per_block"] = planned_elements(spec, v.mode)
    return row


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def add_ratios(results: dict[str, Any]) -> None:
    """min/median/max over repetitions; each median's ratio to base (same tp, ratio,
    batch, length and link), to transformers (same ratio and batch) and to the weight-streaming
    floor: batch / (tp · streamed bytes per rank / memory bandwidth), since the ranks
    share the memory bus."""
    cfg = results["config"]
    bandwidth = results["machine"].get("memory_bandwidth_bytes_per_s")
    medians: dict[tuple, float] = {}
    for var in results["variants"]:
        var["decode_tokens_per_s"] = _spread([r["decode_tokens_per_s"] for r in var["throughput"]])
        var["output_tokens_per_s"] = _spread([r["output_tokens_per_s"] for r in var["throughput"]])
        key = (var["mode"], var["kv_cache"], var["tp"], var["ratio"], var["batch"])
        medians[(*key, var["max_seq_len"], var.get("link"))] = var["decode_tokens_per_s"]["median"]
    for var in results["variants"]:
        median = var["decode_tokens_per_s"]["median"]
        at = (var["tp"], var["ratio"], var["batch"], var["max_seq_len"], var.get("link"))
        base = medians.get(("base", "dense", *at))
        hf = medians.get(("hf", "-", 1, var["ratio"], var["batch"], None, None))
        var["decode_speedup_vs_base"] = median / base if base else None
        var["decode_speedup_vs_hf"] = median / hf if hf else None
        batch = var["batch"] or min(cfg["num_requests"], cfg["max_batch"])
        streamed = var.get("streamed_weight_bytes_per_rank")
        if bandwidth and streamed:
            floor_step = var["tp"] * streamed / bandwidth
            var["floor_decode_tokens_per_s"] = batch / floor_step
            var["fraction_of_floor"] = median / var["floor_decode_tokens_per_s"]
