"""``deinfer fidelity``: every method at every cut, each checkpoint evaluated through the
engine against the dense model, written as results.json and a markdown table."""

from __future__ import annotations

import json
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compress.calibration import CalibrationSource
from compress.fidelity import EvalConfig, Reference, dense_reference, evaluate
from compress.output import OWNER_FILE, check_output_folder
from compress.pipeline import Calibrated, Calibration, allocate, allocated_spec
from dsl import parse_spec
from dsl.errors import UserError
from dsl.folders import write_atomically


@dataclass(frozen=True)
class FidelityConfig:
    model: Path
    methods: tuple[str, ...] = ("svd", "asvd", "svd-llm")
    cuts: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
    allocate_cut: float | None = 0.2  # svd-llm with --allocate at this cut too
    calib: str = "self:16"
    calib_len: int = 96
    seed: int = 0
    alpha: float = 0.5
    tp: int = 1
    mode: str = "deinfer"
    kv_cache: str | None = None
    keep: Path | None = None
    progress: bool = True
    force: bool = False  # replace --out / --keep even if another tool's files are there


def factor_parameters(spec) -> tuple[int, int]:
    """(parameters of the decomposed matrices' factors, of the same matrices dense)."""
    factors = dense = 0
    for layer in spec.decomposition.layers:
        for m in spec.model.matrices:
            r = layer.rank(m)
            n_in, n_out = spec.model.matrix_shape(m)
            if r is not None:
                factors += r * (n_in + n_out)
                dense += n_in * n_out
    return factors, dense


def _one(
    cfg: FidelityConfig,
    ecfg: EvalConfig,
    ref: Reference,
    calibrated: Calibrated,
    spec,
    spec_text: str,
    method: str,
    work: Path,
    label: str,
    cut: float,
) -> dict[str, Any]:
    from compress.decompose import decompose
    from runtime.engine.llm import LLM

    spec_path = work / f"{spec.name}.yaml"
    spec_path.write_text(spec_text)
    start = time.perf_counter()
    stats = calibrated.stats_for(spec, method)
    checkpoint = decompose(
        cfg.model,
        spec,
        work / spec.name,
        progress=cfg.progress,
        method=method,
        stats=stats,
        alpha=cfg.alpha,
        record=calibrated.record,
        force=cfg.force,
    )
    made = time.perf_counter()
    with LLM(spec_path, checkpoint, tp=cfg.tp, mode=cfg.mode, kv_cache=cfg.kv_cache) as llm:
        metrics = evaluate(llm, ref, ecfg)
    factors, dense = factor_parameters(spec)
    row = {
        "method": label,
        "cut": cut,
        "factor_params": factors,
        "dense_params": dense,
        **metrics,
        "decompose_s": made - start,
        "eval_s": time.perf_counter() - made,
    }
    if cfg.keep is None:
        import shutil

        shutil.rmtree(checkpoint, ignore_errors=True)
    print(
        f"{label:>18} cut {row['cut']:.2f}: KL {row.get('kl', float('nan')):.3f}, "
        f"top-1 {row.get('top1', float('nan')):.3f}, {_first(row['continuations'])!r}",
        flush=True,
    )
    return row


TOOL = "deinfer fidelity"


def _owned_record() -> str:
    return json.dumps({"written_by": TOOL}, indent=2) + "\n"


def fidelity_table(cfg: FidelityConfig, ecfg: EvalConfig, out_dir: Path) -> list[Path]:
    """The table in ``out_dir`` (replaced whole after every row) and, with ``cfg.keep``,
    the checkpoints and specs in that folder; both checked before any work."""
    from compress.decompose import read_hf_config, spec_yaml

    if cfg.keep and out_dir.resolve() in (cfg.keep.resolve(), *cfg.keep.resolve().parents):
        raise UserError(f"--keep {cfg.keep} must lie outside --out {out_dir} (replaced whole)")
    for folder in (out_dir, cfg.keep) if cfg.keep else (out_dir,):
        check_output_folder(folder, TOOL, (cfg.model,), cfg.force)
    hf = read_hf_config(cfg.model)
    ref = dense_reference(cfg.model, ecfg)
    calibrated = Calibrated(
        cfg.model,
        Calibration(CalibrationSource.parse(cfg.calib), cfg.calib_len, cfg.seed),
        progress=cfg.progress,
    )
    rows: list[dict[str, Any]] = []

    def write(rows: list[dict[str, Any]]) -> None:
        """After every row, so a long run that fails late keeps what it measured."""
        result = {
            "model": str(cfg.model.name),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "eval": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(ecfg).items()},
            "calibration": calibrated.record,
            "dense": ref.metrics,
            "rows": rows,
        }
        files = {"results.json": json.dumps(result, indent=2), "results.md": markdown(result)}
        write_atomically(files | {OWNER_FILE: _owned_record()}, out_dir)

    with tempfile.TemporaryDirectory(prefix="deinfer-fidelity-") as scratch:
        work = cfg.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        (work / OWNER_FILE).write_text(_owned_record())
        for cut in cfg.cuts:
            for method in cfg.methods:
                name = f"fidelity-{method}-cut{round(cut * 100)}"
                text = spec_yaml(hf, name, cut, "smaller_dim_fraction", 1, cfg.tp)
                spec = parse_spec(text, default_name=name)
                rows.append(_one(cfg, ecfg, ref, calibrated, spec, text, method, work, method, cut))
                write(rows)
        if cfg.allocate_cut is not None:
            base_name = f"fidelity-uniform-cut{round(cfg.allocate_cut * 100)}"
            text = spec_yaml(hf, base_name, cfg.allocate_cut, "smaller_dim_fraction", 1, cfg.tp)
            base = parse_spec(text, default_name=base_name)
            allocation = allocate(calibrated, base, "svd-llm", cfg.alpha, 1)
            name = f"fidelity-svd-llm-alloc-cut{round(cfg.allocate_cut * 100)}"
            spec, spec_text = allocated_spec(base, text, allocation, name, "svd-llm")
            label = "svd-llm+allocate"
            cut = cfg.allocate_cut
            rows.append(
                _one(cfg, ecfg, ref, calibrated, spec, spec_text, "svd-llm", work, label, cut)
            )
            write(rows)
    return [out_dir / "results.json", out_dir / "results.md"]


def _first(items: list[Any]) -> Any:
    return items[0] if items else ""


def _num(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(result: dict[str, Any]) -> str:
    dense = result["dense"]
    ev = result["eval"]
    lines = [
        f"# Fidelity of decomposed {result['model']}",
        "",
        f"Calibration: {result['calibration'].get('calibration')} "
        f"({result['calibration'].get('calibration_tokens')} tokens, seed "
        f"{result['calibration'].get('calibration_seed')}). Held out: {ev['self_samples']} "
        f"sequences of {ev['length']} tokens sampled from the dense model (seed {ev['seed']})"
        + (f", and {ev['text']}" if ev["text"] else "")
        + f". Engine: mode {result['config']['mode']}, tp {result['config']['tp']}.",
        "",
        f"Dense: perplexity {_num(dense['ppl_sampled'], '.2f')} on the held-out samples"
        + (f", {_num(dense['ppl_text'], '.2f')} on the text" if dense["ppl_text"] else "")
        + f"; greedy: {_first(dense['continuations'])!r}.",
        "",
        "| method | cut | factor params / dense | ppl (held-out samples) | ppl (text) "
        "| KL vs dense | top-1 agree | greedy continuation |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        text = str(_first(r["continuations"])).replace("\n", "⏎").replace("|", "\\|")
        lines.append(
            f"| {r['method']} | {r['cut']:.0%} | {r['factor_params'] / r['dense_params']:.2f} "
            f"| {_num(r['ppl_sampled'], '.2f')} | {_num(r['ppl_text'], '.2f')} "
            f"| {_num(r.get('kl'), '.3f')} | {_num(r.get('top1'), '.3f')} | `{text}` |"
        )
    return "\n".join(lines) + "\n"


def eval_lines(dense: dict[str, Any], metrics: dict[str, Any], cfg: EvalConfig) -> list[str]:
    lines = [
        f"perplexity, held-out samples: {_num(metrics['ppl_sampled'], '.3f')} "
        f"(dense {_num(dense['ppl_sampled'], '.3f')})",
    ]
    if cfg.text:
        lines.append(
            f"perplexity, {cfg.text}: {_num(metrics['ppl_text'], '.3f')} "
            f"(dense {_num(dense['ppl_text'], '.3f')})"
        )
    if "kl" in metrics:
        lines.append(f"mean KL(dense || checkpoint): {metrics['kl']:.4f} nats")
        lines.append(f"top-1 agreement: {metrics['top1']:.4f}")
    for prompt, ours, theirs in zip(
        cfg.prompts, metrics["continuations"], dense["continuations"], strict=False
    ):
        lines.append(f"{prompt!r}: checkpoint {ours!r} | dense {theirs!r}")
    return lines
