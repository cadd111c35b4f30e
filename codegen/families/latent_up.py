"""Latent all-gather overlapped with the up-projection: one file for every (layer shape,
group), each carrying its per-chunk segment table (the file count does not grow with the
layers)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile

FILE_NAME = "latent_up.py"
SLOTS = 3  # at most q, k, v (or gate, up) per group


def segment_table(cat, tp: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per chunk, per slot: (dst column in chunk, src row in factor, width)."""
    slot_of = {name: i for i, (name, _) in enumerate(cat.members)}
    table = []
    for chunk in range(tp):
        row = [(0, 0, 0)] * SLOTS
        for seg in cat.segments(chunk):
            row[slot_of[seg.member]] = (seg.dst_start, seg.src_start, seg.width)
        table.append(tuple(row))
    return tuple(table)


def generate(ctx: GenContext) -> list[KernelFile]:
    shapes = []
    for lp in ctx.layer_plans("deinfer"):
        for cat in lp.concats:
            widths = [lp.factor(f"{name}.u").local_shape(0)[1] for name, _ in cat.members]
            key = f"c{cat.width}_" + "_".join(
                f"{n}{r}x{w}" for (n, r), w in zip(cat.members, widths, strict=True)
            )
            choice = ctx.meta("latent_up", key, max(widths), cat.width)
            shapes.append(
                {
                    "group": cat.name,
                    "shape_id": lp.shape_id,
                    "shape_key": key,
                    "chunk": cat.width,
                    "ranks": tuple(r for _, r in cat.members),
                    "out_widths": tuple(widths + [0] * (SLOTS - len(widths))),
                    "members": " | ".join(f"z_{n} ({r})" for n, r in cat.members),
                    "segments": segment_table(cat, ctx.tp),
                    "configs": choice.configs,
                    "meta_source": choice.source,
                }
            )
    if not shapes:
        return []
    manifest = [
        {k: s[k] for k in ("group", "shape_id", "shape_key", "configs", "meta_source")}
        for s in shapes
    ]
    values = {"tp": ctx.tp, "shapes": shapes}
    return [KernelFile("latent_up", FILE_NAME, "latent_up.py.j2", values, manifest)]
