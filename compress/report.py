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

from compress.allocate import Allocation
from compress.calibration import CalibrationSource
from compress.factorize import METHODS
from compress.fidelity import EvalConfig, Reference, dense_reference, evaluate
from compress.output import OWNER_FILE, check_output_folder
from compress.pipeline import Calibrated, Calibration, allocate, allocated_spec
from dsl import parse_spec
from dsl.errors import UserError
from dsl.folders import write_atomically


@dataclass(frozen=True)
class Variant:
    """A method and its training-free corrections, written ``svd-llm+seq+refit+fisher``."""

    method: str
    sequential: bool = False
    refit: bool = False
    fisher: bool = False

    @staticmethod
    def parse(text: str) -> Variant:
        method, *flags = text.split("+")
        unknown = set(flags) - {"seq", "refit", "fisher"}
        if method not in METHODS or unknown or len(set(flags)) != len(flags):
            raise UserError(
                f"--methods {text}: expected a method ({', '.join(METHODS)}) with optional "
                "+seq, +refit and +fisher"
            )
        return Variant(method, "seq" in flags, "refit" in flags, "fisher" in flags)

    @property
    def label(self) -> str:
        flags = "+seq" * self.sequential + "+refit" * self.refit + "+fisher" * self.fisher
        return self.method + flags


@dataclass(frozen=True)
class FidelityConfig:
    model: Path
    methods: tuple[str, ...] = ("svd", "asvd", "svd-llm")  # Variant texts
    cuts: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
    rule: str = "smaller_dim_fraction"  # or param_count: a real parameter cut
    allocate_cuts: tuple[float, ...] = (0.2,)  # every method with --allocate at these too
    rank_multiple: int = 1
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
    """(parameters the projections keep: factors, or the matrix where a layer keeps it
    dense; the same projections all dense)."""
    kept = dense = 0
    for layer in spec.decomposition.layers:
        for m in spec.model.matrices:
            r = layer.rank(m)
            n_in, n_out = spec.model.matrix_shape(m)
            kept += n_in * n_out if r is None else r * (n_in + n_out)
            dense += n_in * n_out
    return kept, dense


@dataclass(frozen=True)
class _Planned:
    """One row to make: its spec, how it is factorised, and the seconds its ranks took
    (the allocation; 0 for uniform ranks)."""

    spec: Any
    spec_text: str
    variant: Variant
    label: str
    cut: float
    allocate_s: float = 0.0


def _one(
    cfg: FidelityConfig,
    ecfg: EvalConfig,
    ref: Reference,
    calibrated: Calibrated,
    planned: _Planned,
    work: Path,
) -> dict[str, Any]:
    from compress.decompose import decompose
    from runtime.engine.llm import LLM

    spec, variant, label = planned.spec, planned.variant, planned.label
    spec_path = work / f"{spec.name}.yaml"
    spec_path.write_text(planned.spec_text)
    start = time.perf_counter()
    how = calibrated.factorization(
        spec, variant.method, cfg.alpha, variant.sequential, variant.refit, variant.fisher
    )
    checkpoint = decompose(
        cfg.model,
        spec,
        work / spec.name,
        progress=cfg.progress,
        how=how,
        record=calibrated.record,
        force=cfg.force,
    )
    made = time.perf_counter()
    with LLM(spec_path, checkpoint, tp=cfg.tp, mode=cfg.mode, kv_cache=cfg.kv_cache) as llm:
        metrics = evaluate(llm, ref, ecfg)
    factors, dense = factor_parameters(spec)
    row = {
        "method": label,
        "rule": cfg.rule,
        "cut": planned.cut,
        "factor_params": factors,
        "dense_params": dense,
        **metrics,
        "decompose_s": made - start + planned.allocate_s,
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
    from compress.decompose import read_hf_config

    for v in cfg.methods:
        Variant.parse(v)  # every name checked before any work
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
            "peak_rss_gib": _peak_rss_gib(),
        }
        files = {"results.json": json.dumps(result, indent=2), "results.md": markdown(result)}
        write_atomically(files | {OWNER_FILE: _owned_record()}, out_dir)

    with tempfile.TemporaryDirectory(prefix="deinfer-fidelity-") as scratch:
        work = cfg.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        (work / OWNER_FILE).write_text(_owned_record())
        for planned in _variants(cfg, hf, calibrated):
            rows.append(_one(cfg, ecfg, ref, calibrated, planned, work))
            write(rows)
    return [out_dir / "results.json", out_dir / "results.md"]


def _variants(cfg: FidelityConfig, hf: dict, calibrated: Calibrated):
    """Every row, in table order: at each cut every variant with uniform ranks, then (at
    ``allocate_cuts``) with allocated ones; each allocated row is charged its allocation's
    seconds (one allocation per method, with or without --fisher, serves all its
    variants)."""
    from compress.decompose import spec_yaml

    variants = [Variant.parse(v) for v in cfg.methods]
    for cut in cfg.cuts:
        tag = f"{cfg.rule.replace('_', '-')}{round(cut * 100)}"
        for variant in variants:
            name = f"fidelity-{variant.label.replace('+', '-')}-{tag}"
            text = spec_yaml(hf, name, cut, cfg.rule, cfg.rank_multiple, cfg.tp)
            yield _Planned(parse_spec(text, default_name=name), text, variant, variant.label, cut)
        if cut not in cfg.allocate_cuts:
            continue
        base_text = spec_yaml(hf, f"fidelity-{tag}", cut, cfg.rule, cfg.rank_multiple, cfg.tp)
        base = parse_spec(base_text, default_name=f"fidelity-{tag}")
        allocations: dict[tuple[str, bool], tuple[Allocation, float]] = {}
        for variant in variants:
            how = (variant.method, variant.fisher)
            if how not in allocations:
                start = time.perf_counter()
                allocation = allocate(
                    calibrated, base, variant.method, cfg.alpha, cfg.rank_multiple, variant.fisher
                )
                allocations[how] = allocation, time.perf_counter() - start
            label = f"{variant.label}+allocate"
            name = f"fidelity-{label.replace('+', '-')}-{tag}"
            allocation, seconds = allocations[how]
            spec, text = allocated_spec(base, base_text, allocation, name, variant.method)
            yield _Planned(spec, text, variant, label, cut, seconds)


def _peak_rss_gib() -> float:
    """This process's peak resident memory (Linux reports KiB): decomposition runs here."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _first(items: list[Any]) -> Any:
    return items[0] if items else ""


def _num(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _cut(row: dict[str, Any]) -> str:
    """Rows written before cuts had a rule were rank cuts (smaller_dim_fraction)."""
    if row.get("rule") == "param_count":
        return f"{row['cut']:.0%} params"
    return f"{row['cut']:.0%} rank"


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
        "| method | cut | params kept / dense | ppl (held-out samples) | ppl (text) "
        "| KL vs dense | top-1 agree | greedy continuation | decompose s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in result["rows"]:
        text = str(_first(r["continuations"])).replace("\n", "⏎").replace("|", "\\|")
        lines.append(
            f"| {r['method']} | {_cut(r)} | {r['factor_params'] / r['dense_params']:.2f} "
            f"| {_num(r['ppl_sampled'], '.2f')} | {_num(r['ppl_text'], '.2f')} "
            f"| {_num(r.get('kl'), '.3f')} | {_num(r.get('top1'), '.3f')} | `{text}` "
            f"| {_num(r.get('decompose_s'), '.0f')} |"
        )
    if "peak_rss_gib" in result:
        lines += ["", f"Peak resident memory of the whole run: {result['peak_rss_gib']:.2f} GiB."]
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
