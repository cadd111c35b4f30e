"""Latent all-gather overlapped with the up-projection: one file per (layer shape, group),
carrying the per-chunk segment table."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile

SLOTS = 3  # at most q, k, v (or gate, up) per group


def file_name(shape_id: str, group: str) -> str:
    return f"latent_up_{group}_{shape_id}.py"


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
    files = []
    for lp in ctx.layer_plans("deinfer"):
        shape_id = lp.shape_id
        for cat in lp.concats:
            widths = [lp.factor(f"{name}.u").local_shape(0)[1] for name, _ in cat.members]
            key = f"c{cat.width}_" + "_".join(
                f"{n}{r}x{w}" for (n, r), w in zip(cat.members, widths, strict=True)
            )
            widths += [0] * (SLOTS - len(widths))
            choice = ctx.meta("latent_up", key, max(widths), cat.width)
            values = {
                "group": cat.name,
                "shape_id": shape_id,
                "tp": ctx.tp,
                "chunk": cat.width,
                "out_widths": widths,
                "ranks": tuple(r for _, r in cat.members),
                "members_doc": " | ".join(f"z_{n} ({r})" for n, r in cat.members),
                "slots_doc": ", ".join(f"{i} = U_{n}" for i, (n, _) in enumerate(cat.members)),
                "segments": segment_table(cat, ctx.tp),
                "configs": choice.configs,
                "meta_source": choice.source,
            }
            files.append(
                KernelFile(
                    "latent_up",
                    file_name(shape_id, cat.name),
                    "latent_up.py.j2",
                    values,
                    {"shape_key": key, "configs": choice.configs, "meta_source": choice.source},
                )
            )
    return files
