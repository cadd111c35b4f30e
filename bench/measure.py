"""One measurement of one engine: throughput of a batch, serving at a request rate,
and the per-block breakdown of a decode step into communication and the rest."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from typing import Any

from bench.config import BenchConfig
from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def prompts_for(cfg: BenchConfig, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(cfg.prompt_len)] for _ in range(n)]


# After a parallel op, libgomp's idle workers spin before they sleep: here a 2-thread op
# was followed by 8-10 ms of one busy core. In lockstep, a tp 2 engine (its ranks on both
# cores) stepping right after a 2-thread step in this process paid for it: a median 4 ms
# (5%) more per step than after none; in the cpu-tp-scaling preset tp 2 fell from the
# 2-thread row's speed to 91% of it. Waiting out the spin (outside every timer) before
# the next engine's step keeps one engine's threads out of another's time.
_OPENMP_SPIN_S = 0.02


class _StepClock:
    """One engine's batch in a lockstep run: its own steps, each timed alone."""

    def __init__(
        self,
        llm: LLM,
        prompts: list[list[int]],
        params: SamplingParams,
        threads: int | None = None,
        settle: bool = False,
    ) -> None:
        self.llm = llm
        self.threads = threads  # set before each step (an engine in this process)
        # after each step with threads to spare, wait until they stop spinning
        self.settle = settle and threads is not None and threads > 1
        self.requests = len(prompts)
        for p in prompts:
            llm.add_request(p, params)
        self.started: set[int] = set()  # sequences that have their first token
        self.steps: list[tuple[float, int, bool]] = []  # (seconds, tokens, decode only)

    @property
    def busy(self) -> bool:
        return self.llm.scheduler.has_work()

    def step(self) -> None:
        decode_only = len(self.started) == self.requests
        if self.threads is not None:
            self.llm.workers.call("threads", self.threads)
        start = time.perf_counter()
        events = self.llm.step()
        self.steps.append((time.perf_counter() - start, len(events), decode_only))
        self.started.update(s.id for s, _, _ in events)
        if self.settle:
            time.sleep(_OPENMP_SPIN_S)

    def result(self, prompt_len: int) -> dict[str, float]:
        """Rates over this engine's own step time; decode: the steps after every
        request has its first token."""
        elapsed = sum(t for t, _, _ in self.steps)
        out_tokens = sum(n for _, n, _ in self.steps)
        decode_time = sum(t for t, _, d in self.steps if d)
        decode_tokens = sum(n for _, n, d in self.steps if d)
        return {
            "seconds": elapsed,
            "requests_per_s": self.requests / elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + self.requests * prompt_len) / elapsed,
            "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else 0.0,
        }


def lockstep_runs(
    llms: list[LLM],
    cfg: BenchConfig,
    vocab: int,
    batch: int | None = None,
    threads: list[int | None] | None = None,
) -> list[dict[str, float]]:
    """A throughput run of several engines at once, one step of each in turn, each
    timed over its own steps: rows compared this way see the same machine within a step
    of each other. On this 2-core VM the speed drifts by ±15% between runs seconds
    apart; latent- against dense-KV decode measured row after row spread 1.05–1.42x
    within one run's repetitions, in lockstep 1.17–1.38x. The order stays the same
    every round: reversing it gave the engines at its ends two steps in a row (warm
    caches) half the time. ``threads``: per engine, the intra-op thread count to set
    before each of its steps (engines in this process share one), or None. When some
    engine's ranks are other processes, a step with several threads here is followed by
    a pause (untimed) while those threads stop spinning (``_OPENMP_SPIN_S``)."""
    prompts = prompts_for(cfg, batch or cfg.num_requests, vocab, cfg.seed)
    params = SamplingParams(max_tokens=cfg.output_len)
    threads = threads or [None] * len(llms)
    ranks_elsewhere = any(llm.spec.parallel.tp > 1 for llm in llms)
    clocks = [
        _StepClock(llm, prompts, params, t, settle=ranks_elsewhere)
        for llm, t in zip(llms, threads, strict=True)
    ]
    while any(c.busy for c in clocks):
        for c in clocks:
            if c.busy:
                c.step()
    return [c.result(cfg.prompt_len) for c in clocks]


def throughput_run(
    llm: LLM, cfg: BenchConfig, vocab: int, batch: int | None = None
) -> dict[str, float]:
    """One engine's batch of ``batch`` (or ``cfg.num_requests``) requests: requests/s,
    output and total tokens/s, and decode tokens/s (the steps after every request has
    its first token), over the engine's step time."""
    return lockstep_runs([llm], cfg, vocab, batch)[0]


def serving_run(llm: LLM, cfg: BenchConfig, vocab: int) -> dict[str, Any]:
    """Requests arrive at a Poisson rate (or all at once) while the engine steps."""
    rng = random.Random(cfg.seed + 1)
    prompts = prompts_for(cfg, cfg.serving_requests, vocab, cfg.seed + 2)
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
        k: {s: v * 1e3 for s, v in summary(x).items()}
        for k, x in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e))
    }
    return {
        **ms,
        "requests_per_s": len(seqs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "request_rate": cfg.request_rate,
    }


class _BreakdownClock:
    """One engine's breakdown run: its batch prefilled (not counted), then its decode
    steps, each timed alone, while its ranks time their collectives. Several clocks step
    in turn in ``lockstep_breakdowns``."""

    def __init__(
        self, llm: LLM, cfg: BenchConfig, vocab: int, layers: int, threads: int | None
    ) -> None:
        self.llm, self.layers, self.threads = llm, layers, threads
        # A batch that fills a graph bucket exactly: no padded rows, so elements per
        # token are what the plan counts.
        n = 1 << (min(cfg.max_batch, cfg.num_requests).bit_length() - 1)
        # The engine's cache holds prompt_len + output_len tokens a request: more steps
        # than that would stall the batch on the cache (and time nothing).
        params = SamplingParams(max_tokens=min(cfg.breakdown_steps + 1, cfg.output_len))
        for p in prompts_for(cfg, n, vocab, cfg.seed + 3):
            llm.add_request(p, params)
        self._use_threads()
        llm.step()  # prefill, not counted
        llm.workers.call("take_comm_stats")
        self.elapsed, self.steps, self.tokens = 0.0, 0, 0

    @property
    def busy(self) -> bool:
        return self.llm.scheduler.has_work()

    def _use_threads(self) -> None:
        if self.threads is not None:  # an engine in this process (``lockstep_runs``)
            self.llm.workers.call("threads", self.threads)

    def step(self) -> None:
        self._use_threads()
        start = time.perf_counter()
        advanced = len(self.llm.step())
        self.elapsed += time.perf_counter() - start
        self.steps += advanced > 0
        self.tokens += advanced

    def result(self) -> dict[str, Any]:
        by_rank = self.llm.workers.call("take_comm_stats")
        stats, layers, steps = by_rank[0], self.layers, max(1, self.steps)
        block = {k: v for k, v in stats.items() if ":" not in k}  # embedding/logits are tagged
        comm_ms = sum(v[2] for v in block.values()) / steps / layers * 1e3
        total_ms = self.elapsed / steps / layers * 1e3
        rank_ms = stats.get("step:rank", (0, 0, self.elapsed))[2] / steps / layers * 1e3
        per_token = max(1, self.tokens) * layers
        # The layers' own work on each rank (their time less their collectives and the
        # waits before them); the slowest rank's is the step's critical path. None where
        # no rank ran its layers eagerly (a graph replay records nothing).
        own = [r["step:blocks"][2] * 1e3 / steps / layers for r in by_rank if "step:blocks" in r]
        return {
            "block_ms_per_step": {
                "communication": comm_ms,
                "compute_and_overhead": total_ms - comm_ms,
            },
            "block_compute_ms_per_step": max(own) if own else None,
            "block_compute_ms_per_step_by_rank": own,
            # The same step seen from rank 0 (its forward and sampling, without the
            # driver's scheduling and the messages to and from the ranks), per block.
            "rank_ms_per_step_per_block": rank_ms,
            "driver_ms_per_step": (total_ms - rank_ms) * layers,
            "elements_per_token_per_block": {k: v[1] / per_token for k, v in block.items()},
            "collectives_per_token_per_block": {k: v[0] / per_token for k, v in block.items()},
            "decode_steps": self.steps,
            "decode_tokens": self.tokens,
        }


def lockstep_breakdowns(
    llms: list[LLM],
    layers: list[int],
    cfg: BenchConfig,
    vocab: int,
    threads: list[int | None] | None = None,
) -> list[dict[str, Any]]:
    """Per engine, per block and decode step: communication time (timed collectives,
    timed for this run alone: their barriers slow steps), the rest (compute plus runtime
    overhead), the layers' own compute, and what each collective kind moved per token
    per block (to compare with the plan). The engines take their decode steps in turn,
    as ``lockstep_runs``: behind emulated links on this 2-core VM one engine's own
    compute moved up to 2x between breakdowns taken one after another. ``threads``: per
    engine, as in ``lockstep_runs``."""
    threads = threads or [None] * len(llms)
    for llm in llms:
        llm.workers.call("set_comm_stats", "timed")
    clocks = [
        _BreakdownClock(llm, cfg, vocab, n, t)
        for llm, n, t in zip(llms, layers, threads, strict=True)
    ]
    while any(c.busy for c in clocks):
        for c in clocks:
            if c.busy:
                c.step()
    out = [c.result() for c in clocks]
    for llm in llms:
        llm.workers.call("set_comm_stats", "off")
    return out


def timed_breakdown(llm: LLM, spec: Any, cfg: BenchConfig, vocab: int) -> dict[str, Any]:
    """One engine's breakdown run alone (``lockstep_breakdowns``)."""
    return lockstep_breakdowns([llm], [spec.model.num_layers], cfg, vocab)[0]


def median_breakdown(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One breakdown from a breakdown per repetition: each figure's median (lists
    element by element; counts, which every repetition shares, unchanged), with the
    layers' own compute of each repetition beside it."""

    def median(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: median([v[k] for v in values]) for k in first}
        if isinstance(first, list):
            return [median(list(column)) for column in zip(*values, strict=True)]
        if first is None:
            return None
        return statistics.median(values)

    out = median(runs)
    out["block_compute_ms_per_rep"] = [r["block_compute_ms_per_step"] for r in runs]
    return out
