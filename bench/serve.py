"""``deinfer bench --serve``: the serving benchmark through HTTP.

``--serve URL`` loads a running OpenAI-compatible server. ``--serve start`` starts
``deinfer serve`` itself for each mode (a random checkpoint of the spec), loads it
through HTTP at each rate, stops it, then runs the same workload on the same engine
in-process (the server's ``EngineLoop``, no HTTP) — HTTP's overhead, measured."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.http import (
    Workload,
    fetch_model,
    http_sender,
    inprocess_sender,
    run_load,
)
from dsl import Spec, load_spec, with_runtime, with_tp
from dsl.dump import dump_spec
from dsl.errors import UserError
from runtime.dist.launcher import free_port

INF = float("inf")


@dataclass(frozen=True)
class ServeBenchConfig:
    spec: str = "specs/cpu-smoke.yaml"
    modes: tuple[str, ...] = ("deinfer", "base", "dense")
    tp: int = 2
    rates: tuple[float, ...] = (2.0, 8.0, INF)  # requests/s, Poisson; inf: all at once
    num_prompts: int = 16
    prompt_len: int = 32
    output_len: int = 32
    max_batch: int = 8
    reps: int = 3
    seed: int = 0
    dataset: str | None = None  # JSONL of {"prompt", "max_tokens"}; None: seeded ids
    inprocess: bool = True  # also the same load on the engine in-process


class ServerProcess:
    """``deinfer serve ARGS`` on 127.0.0.1 and a free port, up once /health answers."""

    def __init__(self, args: list[str], log: Path, timeout_s: float = 300.0) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "cli.main", "serve", *args, "--port", str(self.port)]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"deinfer serve exited: {self._last_line()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop(signal.SIGKILL)
        raise UserError(f"deinfer serve did not answer /health within {timeout_s:.0f} s")

    def _last_line(self) -> str:
        lines = self.log.read_text().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number the median over the repetitions."""
    out: dict[str, Any] = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        elif isinstance(value, float) and key != "request_rate":
            out[key] = statistics.median(r[key] for r in runs)
    out["errors"] = sorted({e for r in runs for e in r["errors"]})
    return out


def _workload(cfg: ServeBenchConfig, vocab: int) -> Workload:
    if cfg.dataset:
        return Workload.from_jsonl(Path(cfg.dataset), cfg.output_len)
    return Workload.seeded(cfg.num_prompts, cfg.prompt_len, cfg.output_len, vocab, cfg.seed)


async def _load_rates(send, work: Workload, cfg: ServeBenchConfig, progress, label: str):
    """reps × rates, the rates interleaved within each repetition."""
    runs: dict[float, list[dict[str, Any]]] = {r: [] for r in cfg.rates}
    for rep in range(cfg.reps):
        for rate in cfg.rates:
            runs[rate].append(await run_load(send, work, rate, cfg.seed + rep))
            progress(f"{label} rate {rate:g} rep {rep + 1}")
    return [{"rate": r, **_median_run(runs[r]), "reps": len(runs[r])} for r in cfg.rates]


async def _http_rows(url: str, work: Workload, cfg: ServeBenchConfig, progress, label: str):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = await fetch_model(client, url)
        return await _load_rates(http_sender(client, url, model), work, cfg, progress, label)


def bench_url(url: str, cfg: ServeBenchConfig, progress: Callable[[str], None]) -> dict:
    """Load a running server (its vocabulary unknown: seeded prompts use ids below 256)."""
    work = _workload(cfg, vocab=256)
    rows = asyncio.run(_http_rows(url.rstrip("/"), work, cfg, progress, url))
    return {"config": asdict(cfg), "url": url, "rows": [{"transport": "http", **r} for r in rows]}


def bench_spec(cfg: ServeBenchConfig) -> Spec:
    """The served spec: the bench's tp and batch size."""
    return with_runtime(
        with_tp(load_spec(cfg.spec), cfg.tp),
        max_batch_size=cfg.max_batch,
        cuda_graph_batch_sizes=[b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.max_batch],
    )


async def _inprocess_rows(llm, work: Workload, cfg: ServeBenchConfig, progress, label: str):
    from runtime.serve.engine_loop import EngineLoop
    from runtime.serve.metrics import ServerMetrics

    engine = EngineLoop(llm, ServerMetrics(), max_in_flight=1 << 30)
    engine.start()
    try:
        return await _load_rates(inprocess_sender(engine), work, cfg, progress, label)
    finally:
        engine.stop()


def bench_modes(cfg: ServeBenchConfig, progress: Callable[[str], None]) -> dict:
    """Start a server per mode, load it through HTTP, then the same load in-process."""
    from bench.variants import machine
    from runtime.engine.llm import LLM
    from runtime.tools.random_checkpoint import write_random_checkpoint

    spec = bench_spec(cfg)
    work = _workload(cfg, spec.model.vocab_size)
    longest = max(len(p) if isinstance(p, list) else 0 for p in work.prompts)
    if longest + max(work.output_lens) > spec.runtime.max_seq_len:
        raise UserError(
            f"prompt {longest} + output {max(work.output_lens)} tokens exceed the spec's "
            f"max_seq_len {spec.runtime.max_seq_len}"
        )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="deinfer-bench-serve-") as tmp:
        folder = Path(tmp)
        spec_path = folder / f"{spec.name}.yaml"
        spec_path.write_text(dump_spec(spec))  # the server reads a spec file
        ckpt = write_random_checkpoint(spec, folder / "checkpoint", cfg.seed)
        for mode in cfg.modes:
            args = ["--spec", str(spec_path), "--checkpoint", str(ckpt), "--mode", mode]
            args += ["--tp", str(cfg.tp), "--max-queue", str(len(work.prompts))]
            with ServerProcess(args, folder / f"serve-{mode}.log") as server:
                label = f"{mode} http"
                http = asyncio.run(_http_rows(server.url, work, cfg, progress, label))
                rows += [{"mode": mode, "transport": "http", **r} for r in http]
                if server.stop() != 0:
                    raise UserError(f"deinfer serve ({mode}) did not exit cleanly")
            if cfg.inprocess:
                with LLM(spec_path, ckpt, mode=mode) as llm:
                    label = f"{mode} in-process"
                    local = asyncio.run(_inprocess_rows(llm, work, cfg, progress, label))
                rows += [{"mode": mode, "transport": "in-process", **r} for r in local]
    return {
        "machine": machine(),
        "threads_per_rank": max(1, (os.cpu_count() or 1) // cfg.tp),
        "config": asdict(cfg),
        "rows": rows,
        "http_overhead": http_overhead(rows),
    }


def http_overhead(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and rate: output tok/s through HTTP over in-process (1.0: no cost)."""
    local = {(r["mode"], r["rate"]): r for r in rows if r["transport"] == "in-process"}
    out = []
    for r in rows:
        twin = local.get((r.get("mode"), r["rate"])) if r["transport"] == "http" else None
        if twin:
            out.append(
                {
                    "mode": r["mode"],
                    "rate": r["rate"],
                    "tokens_per_s_ratio": r["output_tokens_per_s"] / twin["output_tokens_per_s"],
                    "ttft_ms_added": r["ttft_ms"]["median"] - twin["ttft_ms"]["median"],
                    "itl_ms_added": r["itl_ms"]["median"] - twin["itl_ms"]["median"],
                }
            )
    return out
