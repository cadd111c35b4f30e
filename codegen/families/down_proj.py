"""Fused concat-split down-projection: one file for every (layer shape, group), the
sides launch arguments of one kernel (the file count does not grow with the layers)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile

FILE_NAME = "down_proj.py"
NORM_KIND = {"rms": 1, "layer": 2}


def generate(ctx: GenContext) -> list[KernelFile]:
    norm = ctx.spec.model.norm
    shapes = []
    for lp in ctx.layer_plans("deinfer"):
        for cat in lp.concats:
            key = f"k{cat.in_features}_n{cat.width}"
            choice = ctx.meta("down_proj", key, cat.width, cat.in_features)
            shapes.append(
                {
                    "group": cat.name,
                    "shape_id": lp.shape_id,
                    "shape_key": key,
                    "in_features": cat.in_features,
                    "width": cat.width,
                    "members": " | ".join(f"D_{n} ({r})" for n, r in cat.members),
                    "concat_length": cat.length,
                    "concat_padded": cat.padded,
                    "configs": choice.configs,
                    "meta_source": choice.source,
                }
            )
    if not shapes:
        return []
    values = {
        "norm": norm.kind,
        "norm_kind": NORM_KIND[norm.kind],
        "eps": norm.eps,
        "shapes": shapes,
    }
    manifest = [
        {k: s[k] for k in ("group", "shape_id", "shape_key", "configs", "meta_source")}
        for s in shapes
    ]
    return [KernelFile("down_proj", FILE_NAME, "down_proj.py.j2", values, manifest)]
