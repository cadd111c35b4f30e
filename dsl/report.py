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
                "layers": layer_ranges(lp.layers),
                "ops": [
                    {"kind": c.kind, "what": c.what, "elements": c.elements} for c in lp.collectives
                ],
            }
            for lp in mp.layer_plans
        ],
        "shards": shards_json(mp),
        "padding": [
            {
                "layers": layer_ranges(lp.layers),
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


def shards_json(mp: ModePlan) -> list[dict[str, Any]]:
    """The exact shard of every factor on every rank, per distinct layer shape."""
    out = []
    for lp in mp.layer_plans:
        factors = [
            {
                "tensor": f.tensor,
                "factor": f.factor,
                "shape": list(f.shape),
                "split": f.split,
                "length": f.length,
                "padded": f.padded,
                "ranges": [list(r) for r in f.ranges],
            }
            for f in lp.factors
        ]
        concats = [
            {
                "name": c.name,
                "members": [list(m) for m in c.members],
                "length": c.length,
                "padded": c.padded,
                "ranges": [list(r) for r in c.ranges],
                "segments": [
                    [[s.member, s.src_start, s.src_stop, s.dst_start] for s in c.segments(rank)]
                    for rank in range(mp.tp)
                ],
            }
            for c in lp.concats
        ]
        out.append({"layers": layer_ranges(lp.layers), "factors": factors, "concats": concats})
    return out


def shards_table(plan: Plan) -> str:
    lines = []
    for name, mp in plan.modes.items():
        for group in shards_json(mp):
            lines.append(f"{name} layers {group['layers']}:")
            for f in group["factors"]:
                ranges = " ".join(f"{a}:{b}" for a, b in f["ranges"])
                pad = (
                    f" (padded {f['length']} -> {f['padded']})" if f["padded"] > f["length"] else ""
                )
                lines.append(f"  {f['tensor']:<12} {f['split']:<10} {ranges}{pad}")
            for c in group["concats"]:
                lines.append(
                    f"  {c['name']}.cat (concat-split of "
                    + " | ".join(f"{m}:{r}" for m, r in c["members"])
                    + f", {c['length']} -> {c['padded']})"
                )
                for rank, segs in enumerate(c["segments"]):
                    parts = ", ".join(f"{m}[{a}:{b}]@{d}" for m, a, b, d in segs) or "padding"
                    lines.append(f"    rank {rank}: {parts}")
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "spec": plan.spec.name,
        "tp": plan.tp,
        "modes": {name: mode_summary(mp) for name, mp in plan.modes.items()},
    }


def layer_ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


# (label, path into a mode's plan_json, formatter): the rows of ``plan_table``.
_KV = "kv_elements_per_token_per_layer_per_rank"
_FLOPS = "flops_per_token_per_rank"
TABLE_ROWS = (
    ("comm units / token / block", ("comm_units_per_token_per_block",), "n"),
    ("collectives / block", ("collectives_per_block",), "n"),
    (
        "ring elements / rank / token / block",
        ("ring_elements_per_rank_per_token_per_block",),
        "n",
    ),
    ("GEMM FLOPs / token / rank", (_FLOPS, "gemm"), "n"),
    ("attention FLOPs / context token / rank", (_FLOPS, "attention_per_context_token"), "n"),
    ("  of which duplicated", (_FLOPS, "duplicated_attention_per_context_token"), "n"),
    ("weights / rank", ("weight_bytes_per_rank",), "bytes"),
    ("KV dense elems / token / layer / rank", (_KV, "dense"), "n"),
    ("KV latent elems / token / layer / rank", (_KV, "latent"), "n"),
    ("KV auto: latent layers", (_KV, "auto_latent_layers"), "str"),
)


def _cell(data: dict, path: tuple[str, ...], kind: str) -> str:
    for key in path:
        data = data[key]
    return {"n": _fmt, "bytes": _bytes, "str": str}[kind](data)


def plan_table(plan: Plan) -> str:
    """A readable summary: one column per mode."""
    data = plan_json(plan)["modes"]
    modes = list(data)
    rows = [
        (label, [_cell(data[m], path, kind) for m in modes]) for label, path, kind in TABLE_ROWS
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
