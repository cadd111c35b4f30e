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

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from bench import peer
from bench.baseline import hf_throughput, memory_bandwidth
from bench.config import PRESETS, BenchConfig, preset
from bench.measure import (
    lockstep_breakdowns,
    lockstep_runs,
    prompts_for,
    serving_run,
    throughput_run,
    timed_breakdown,
)
from bench.rank_alone import RankAloneLLM
from bench.ratios import add_ratios
from bench.rows import report_row, threads_per_rank
from bench.variants import (
    Variant,
    cpu_times,
    machine,
    max_batch,
    phases,
    steal_fraction,
    variant_spec,
    variants_of,
)
from dsl import Spec, load_spec
from dsl.errors import UserError
from runtime.dist.emulated_link import LinkSpec
from runtime.engine.config import EngineOptions, default_threads
from runtime.engine.llm import LLM
from runtime.tools.random_checkpoint import write_random_checkpoint

__all__ = ["PRESETS", "BenchConfig", "preset", "run_bench", "variants_of"]


class _Models:
    """Each row's spec, and random checkpoints in a temporary folder, one per ratio."""

    def __init__(self, cfg: BenchConfig, folder: Path) -> None:
        self.cfg, self.folder = cfg, folder
        self.base = load_spec(cfg.spec)
        self.checkpoints: dict[float | None, Path] = {}
        # llama.cpp's model file per ratio and the weight bytes its decode step streams
        self.gguf: dict[float | None, tuple[Path, int]] = {}

    def spec(self, v: Variant) -> Spec:
        spec = variant_spec(self.base, v, self.cfg)
        if v.ratio not in self.checkpoints:
            ckpt = self.folder / f"checkpoint-{len(self.checkpoints)}"
            write_random_checkpoint(spec, ckpt, self.cfg.seed)
            os.sync()  # its write-back must not run beside the next engine's tuning
            self.checkpoints[v.ratio] = ckpt
        return spec


class LinkPlanner(Protocol):
    """What turns ``BenchConfig.links`` entries into tc rates and predicts each row
    (``bench.link_planner`` has the one built on the cost model)."""

    def resolve(self, cfg: BenchConfig, fit: tuple[str, Any, float]) -> dict[str, str]: ...

    def describe(self) -> dict[str, Any]: ...

    def probe(self, engine: Any, v: Variant) -> None: ...

    def predict(self, spec: Any, v: Variant, cfg: BenchConfig, down_layout: str) -> dict: ...


FAST_LINK = "8000000000bit"  # far above what gloo over TCP carries here


def _fit_block(variants, engines, specs, cfg: BenchConfig, vocab: int) -> tuple:
    """(mode, engine, measured compute ms per block) of one linked engine — Base's where
    it runs — measured behind the fast link: what the planner fits its compute scale on."""
    linked = [v for v in variants if v.link and not v.external]
    v = next((v for v in linked if v.mode == "base"), linked[0])
    block = timed_breakdown(engines[v.engine], specs[v.engine], cfg, vocab)["block_ms_per_step"]
    return v.mode, engines[v.engine], block["compute_and_overhead"]


def _switch_link(v: Variant, engine, rates: dict[str, str], links: dict[str, Any]) -> None:
    """Reshape ``engine``'s links to ``v``'s; the first time a link is used, measure it."""
    if v.link is None or v.external:
        return
    want = LinkSpec.parse(rates[v.link])
    if engine.link != want:
        probe = engine.set_link(want, probe="probe" not in links[v.link])
        if probe:
            links[v.link]["probe"] = probe
    elif "probe" not in links[v.link]:
        links[v.link]["probe"] = engine.workers.link_probe


def _start(v: Variant, models: _Models, cfg: BenchConfig, link: str | None = None):
    spec = models.spec(v)
    ckpt = models.checkpoints[v.ratio]
    if v.mode == "hf":
        from runtime.tools.hf_reference import load_transformers

        return load_transformers(spec, ckpt), spec
    if v.mode == "llama.cpp":
        return _start_peer(v, spec, models, cfg), spec
    blocks = max_batch(cfg) * -(-(cfg.prompt_len + cfg.output_len) // spec.runtime.block_size)
    engine_class = RankAloneLLM if v.alone else LLM
    options = EngineOptions(
        mode=v.mode,
        kv_cache=v.kv_cache,
        backend=cfg.backend,
        num_blocks=blocks + 1,
        overlap=cfg.overlap,
        path=cfg.path,
        threads=threads_per_rank(cfg, v),
        link=link if v.tp > 1 else None,
        link_hosts=v.hosts,  # set only on linked rows whose tp it divides
        up_layout=v.up_layout,
        down_layout=v.down_layout,
        layout=v.layout,
        plan_batch=v.batch,  # the layout chosen for the row's decode batch
        pack_weights=cfg.pack_weights,
        # every row times its own products: no row's forms come from what an earlier
        # run measured on a machine that may have been busier
        tune_cache=False,
    )
    llm = engine_class(spec, ckpt, options)
    # the spec the engine executes (its merged matrices undecomposed): what its
    # collectives and the link planner's predictions follow
    return llm, llm.execution_spec


def _start_peer(v: Variant, spec: Spec, models: _Models, cfg: BenchConfig) -> peer.LlamaCpp:
    """llama.cpp on the row's weights (one fp32 GGUF per ratio, written once)."""
    if not peer.available():
        raise UserError("bench: the llama.cpp row needs llama-cpp-python (pip install it)")
    if v.ratio not in models.gguf:
        from runtime.tools.hf_reference import dense_state

        path = models.folder / f"peer-{len(models.gguf)}.gguf"
        streamed = peer.write_gguf(spec, dense_state(spec, models.checkpoints[v.ratio]), path)
        models.gguf[v.ratio] = path, streamed
    path, streamed = models.gguf[v.ratio]
    context = cfg.prompt_len + cfg.output_len
    return peer.LlamaCpp(path, max_batch(cfg), context, threads_per_rank(cfg, v), streamed)


def _use_threads(v: Variant, engine, cfg: BenchConfig) -> None:
    """A tp 1 engine (or a rank alone) runs in this process, whose thread count other
    rows may have changed: give it the row's own."""
    if v.in_process:
        engine.workers.call("threads", threads_per_rank(cfg, v))


def _measure(v: Variant, engine, cfg: BenchConfig, vocab: int) -> dict[str, Any]:
    """One throughput run (and a serving run for engines), at the row's thread count."""
    if v.external:
        prompts = prompts_for(cfg, v.batch or cfg.num_requests, vocab, cfg.seed)
        if v.mode == "llama.cpp":
            engine.set_threads(threads_per_rank(cfg, v))
            return {"throughput": engine.throughput(prompts, cfg.output_len)}
        torch.set_num_threads(threads_per_rank(cfg, v))
        return {"throughput": hf_throughput(engine, prompts, cfg.output_len)}
    _use_threads(v, engine, cfg)
    out = {"throughput": throughput_run(engine, cfg, vocab, v.batch)}
    if cfg.serving:
        out["serving"] = serving_run(engine, cfg, vocab)
    return out


class _Session:
    """The engines of one bench run, kept alive across repetitions, and its links."""

    def __init__(
        self, cfg: BenchConfig, planner: LinkPlanner | None, note, variants: list[Variant]
    ) -> None:
        self.cfg, self.planner, self.note = cfg, planner, note
        self.variants = variants
        self.tmp = tempfile.TemporaryDirectory(prefix="deinfer-bench-")
        self.models = _Models(cfg, Path(self.tmp.name))
        self.vocab = self.models.base.model.vocab_size
        self.engines: dict[tuple, Any] = {}
        self.specs: dict[tuple, Any] = {}
        self.start_seconds: dict[tuple, float] = {}  # each engine's construction
        # Engines start behind a fast link; links given as a ratio are resolved once the
        # planner has measured a block here (it needs the real compute to set the rate).
        self.rates = {link: link if planner is None else FAST_LINK for link in cfg.links}
        self.links: dict[str, Any] = {}

    def start(self) -> None:
        for v in self.variants:
            if v.engine not in self.engines:
                self.note(f"start {v.label}")
                link = self.rates[v.link] if v.link else None
                began = time.perf_counter()
                self.engines[v.engine], self.specs[v.engine] = _start(
                    v, self.models, self.cfg, link
                )
                self.start_seconds[v.engine] = time.perf_counter() - began

    def resolve_links(self, results: dict[str, Any]) -> None:
        if not self.cfg.links:
            return
        if self.planner:
            self.note("calibrate the cost model on a measured block")
            fit = _fit_block(self.variants, self.engines, self.specs, self.cfg, self.vocab)
            self.rates = self.planner.resolve(self.cfg, fit)
            results["planner"] = self.planner.describe()
        self.links = {link: {"rate": self.rates[link]} for link in self.cfg.links}
        results["links"] = self.links

    def engine(self, v: Variant):
        """``v``'s engine, behind ``v``'s link."""
        engine = self.engines[v.engine]
        _switch_link(v, engine, self.rates, self.links)
        return engine

    def measure(self) -> dict[Variant, list[dict[str, Any]]]:
        short = replace(self.cfg, num_requests=1, output_len=2, serving=False)
        for v in self.variants:  # warm-up, excluded
            _measure(replace(v, batch=1), self.engine(v), short, self.vocab)
        raw: dict[Variant, list[dict[str, Any]]] = {v: [] for v in self.variants}
        for rep in range(self.cfg.reps):
            if self.cfg.lockstep:
                self._lockstep(rep, raw)
                continue
            for v in self.variants:
                self.note(f"rep {rep + 1}/{self.cfg.reps} {v.label}")
                raw[v].append(_measure(v, self.engine(v), self.cfg, self.vocab))
                if self.planner and v.link:
                    self.planner.probe(self.engines[v.engine], v)
                self._break_down([v], [raw[v][-1]])
        return raw

    def _lockstep(self, rep: int, raw: dict[Variant, list[dict[str, Any]]]) -> None:
        """One repetition: transformers' rows alone, then the engine rows of each batch
        (and link) in lockstep, their breakdowns in lockstep too, and, if the bench
        serves, each of those rows' serving run alone."""
        groups: dict[tuple[str | None, int | None], list[Variant]] = {}
        for v in self.variants:
            if v.external:
                self.note(f"rep {rep + 1}/{self.cfg.reps} {v.label}")
                raw[v].append(_measure(v, self.engines[v.engine], self.cfg, self.vocab))
            else:  # rows of one group have engines of their own (``Variant.engine``)
                groups.setdefault((v.link, v.batch), []).append(v)
        for (_, batch), rows in groups.items():
            self.note(
                f"rep {rep + 1}/{self.cfg.reps} in lockstep: " + ", ".join(v.label for v in rows)
            )
            # Each repetition starts the round at the next row: the row first in every
            # round ran ~5% slower than an identical plan after it (cpu-demo at
            # param_count 40 %, tp 2, batch 16: 162.3 vs 170.4 tok/s, either order), so
            # with as many repetitions as rows each takes the first place once.
            shift = rep % len(rows)
            rows = rows[shift:] + rows[:shift]
            engines = [self.engine(v) for v in rows]  # each behind its row's link
            runs = lockstep_runs(engines, self.cfg, self.vocab, batch, self._own_threads(rows))
            for v, run in zip(rows, runs, strict=True):
                raw[v].append({"throughput": run})
                if self.planner and v.link:
                    self.planner.probe(self.engines[v.engine], v)
                if self.cfg.serving:
                    _use_threads(v, self.engines[v.engine], self.cfg)
                    raw[v][-1]["serving"] = serving_run(
                        self.engines[v.engine], self.cfg, self.vocab
                    )
            self._break_down(rows, [raw[v][-1] for v in rows])

    def _break_down(self, rows: list[Variant], runs: list[dict[str, Any]]) -> None:
        """The per-block breakdowns of ``rows``, once per repetition (each row gives its
        medians), their steps in turn (``lockstep_breakdowns``); not for other programs'
        rows or a rank alone (no collectives)."""
        if not self.cfg.breakdown:
            return
        pairs = zip(rows, runs, strict=True)
        timed = [(v, run) for v, run in pairs if not (v.external or v.alone)]
        engines = [self.engine(v) for v, _ in timed]
        layers = [self.specs[v.engine].model.num_layers for v, _ in timed]
        threads = self._own_threads([v for v, _ in timed])
        outs = lockstep_breakdowns(engines, layers, self.cfg, self.vocab, threads)
        for (_, run), out in zip(timed, outs, strict=True):
            run["breakdown"] = out

    def _own_threads(self, rows: list[Variant]) -> list[int | None]:
        """tp 1 engines (and ranks alone) run in this process, whose thread count they
        share: each row's own, given before each of its steps (None: ranks elsewhere)."""
        return [threads_per_rank(self.cfg, v) if v.in_process else None for v in rows]

    def row(self, v: Variant, runs: list[dict[str, Any]]) -> dict[str, Any]:
        row = report_row(v, runs, self.engine(v), self.specs[v.engine], self.cfg)
        row["start_seconds"] = self.start_seconds.get(v.engine)
        if self.planner and v.link:
            spec, down = self.specs[v.engine], row["down_layout_used"]
            row["predicted"] = self.planner.predict(spec, v, self.cfg, down)
        return row

    def close(self) -> None:
        for key, engine in self.engines.items():
            if key[0] != "hf":  # llama.cpp's rows close their model and context too
                engine.close()
        self.tmp.cleanup()


def run_bench(
    cfg: BenchConfig,
    progress: Callable[[str], None] | None = None,
    planner: LinkPlanner | None = None,
) -> dict[str, Any]:
    """Measure every variant of ``cfg``. Links given as plain tc rates need no
    ``planner``; others (e.g. ``ratio:5.2``) are resolved by it, which also predicts
    each row."""
    cores = default_threads(1)
    cpu_before = cpu_times()
    results: dict[str, Any] = {"config": asdict(cfg), "machine": machine(), "variants": []}
    results["machine"]["memory_bandwidth_bytes_per_s"] = memory_bandwidth(cores)
    results["machine"]["bandwidth_threads"] = cores
    rows: dict[Variant, dict[str, Any]] = {}
    for phase in phases(cfg):
        session = _Session(cfg, planner, progress or (lambda message: None), phase)
        try:
            session.start()
            session.resolve_links(results)
            raw = session.measure()
            rows.update({v: session.row(v, raw[v]) for v in session.variants})
            if planner:
                results["planner"] = planner.describe()
        finally:
            session.close()
    results["variants"] = [rows[v] for v in variants_of(cfg)]
    results["machine"]["cpu_steal_fraction"] = steal_fraction(cpu_before, cpu_times())
    add_ratios(results)
    return results
