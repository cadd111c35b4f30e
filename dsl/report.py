"""Render a plan as JSON (machine-readable) or as a plain-text table."""

from __future__ import annotations

from typing import Any

from dsl.plan import ModePlan, Plan


def _num(x: float | None) -> int | float | None:
    """Integral figures print as integers; means over unequal layers keep their fraction."""
    if x is None:
        return None
    return int(x) if float(x).is_integer() else round(x, 3)


def mode_summary(mp: ModePlan) -> dict[str, Any]:
    kv = {kind: _num(mp.kv_elements(kind)) for kind in ("dense", "latent", "auto")}
    kv["auto_latent_layers"] = mp.auto_latent_layers()
    return {
        "comm_units_per_token_per_block": _num(mp.comm_units_per_token_per_block()),
        "collectives_per_block": _num(mp.collectives_per_block()),
        "ring_elements_per_rank_per_token_per_block": _num(
            mp.ring_elements_per_rank_per_token_per_block()
        ),
        "flops_per_token_per_rank": {
            "gemm": mp.gemm_flops_per_token_per_rank(),
            "attention_per_context_token": mp.attention_flops_per_context_token_per_rank(),
            "duplicated_attention_per_context_token": mp.duplicated_attention_flops(),
        },
        "weight_bytes_per_rank": mp.weight_bytes_per_rank(),
        "kv_elements_per_token_per_layer_per_rank": kv,
        "lm_head_gather_elements_per_token": mp.lm_head_gather_elements,
        "collectives": [
            {
                "layers": _layer_ranges(lp.layers),
                "ops": [
                    {"kind": c.kind, "what": c.what, "elements": c.elements} for c in lp.collectives
                ],
            }
            for lp in mp.layer_plans
        ],
        "padding": [
            {
                "layers": _layer_ranges(lp.layers),
                "concat": c.name,
                "length": c.length,
                "padded": c.padded,
                "pad": c.padding,
            }
            for lp in mp.layer_plans
            for c in lp.concats
            if c.padding
        ],
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "spec": plan.spec.name,
        "tp": plan.tp,
        "modes": {name: mode_summary(mp) for name, mp in plan.modes.items()},
    }


def _layer_ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def plan_table(plan: Plan) -> str:
    """A readable summary: one column per mode."""
    data = plan_json(plan)["modes"]
    modes = list(data)
    rows: list[tuple[str, list[str]]] = [
        (
            "comm units / token / block",
            [_fmt(data[m]["comm_units_per_token_per_block"]) for m in modes],
        ),
        ("collectives / block", [_fmt(data[m]["collectives_per_block"]) for m in modes]),
        (
            "ring elements / rank / token / block",
            [_fmt(data[m]["ring_elements_per_rank_per_token_per_block"]) for m in modes],
        ),
        (
            "GEMM FLOPs / token / rank",
            [_fmt(data[m]["flops_per_token_per_rank"]["gemm"]) for m in modes],
        ),
        (
            "attention FLOPs / context token / rank",
            [
                _fmt(data[m]["flops_per_token_per_rank"]["attention_per_context_token"])
                for m in modes
            ],
        ),
        (
            "  of which duplicated",
            [
                _fmt(data[m]["flops_per_token_per_rank"]["duplicated_attention_per_context_token"])
                for m in modes
            ],
        ),
        ("weights / rank", [_bytes(data[m]["weight_bytes_per_rank"]) for m in modes]),
        (
            "KV dense elems / token / layer / rank",
            [_fmt(data[m]["kv_elements_per_token_per_layer_per_rank"]["dense"]) for m in modes],
        ),
        (
            "KV latent elems / token / layer / rank",
            [_fmt(data[m]["kv_elements_per_token_per_layer_per_rank"]["latent"]) for m in modes],
        ),
        (
            "KV auto: latent layers",
            [
                str(data[m]["kv_elements_per_token_per_layer_per_rank"]["auto_latent_layers"])
                for m in modes
            ],
        ),
    ]
    label_w = max(len(r[0]) for r in rows)
    col_w = max(12, *(len(v) for _, vals in rows for v in vals))
    lines = [
        f"plan for {plan.spec.name} at tp={plan.tp}",
        f"{'':<{label_w}}  " + "  ".join(f"{m:>{col_w}}" for m in modes),
    ]
    lines += [
        f"{label:<{label_w}}  " + "  ".join(f"{v:>{col_w}}" for v in vals) for label, vals in rows
    ]
    for m in modes:
        for group in data[m]["collectives"]:
            ops = ", ".join(f"{o['kind']}({o['what']}, {o['elements']})" for o in group["ops"])
            lines.append(f"{m} layers {group['layers']}: {ops}")
        for pad in data[m]["padding"]:
            lines.append(
                f"{m} layers {pad['layers']}: {pad['concat']} latent {pad['length']} "
                f"padded to {pad['padded']} (+{pad['pad']})"
            )
    return "\n".join(lines)


def _fmt(x: int | float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.1f}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
