"""Fused concat-split down-projection: one file per (layer shape, group)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile

NORM_KIND = {"rms": 1, "layer": 2}


def file_name(shape_id: str, group: str) -> str:
    return f"down_proj_{group}_{shape_id}.py"


def generate(ctx: GenContext) -> list[KernelFile]:
    norm = ctx.spec.model.norm
    files = []
    for lp in ctx.layer_plans("deinfer"):
        shape_id = lp.shape_id
        for cat in lp.concats:
            key = f"k{cat.in_features}_n{cat.width}"
            choice = ctx.meta("down_proj", key, cat.width, cat.in_features)
            values = {
                "group": cat.name,
                "shape_id": shape_id,
                "in_features": cat.in_features,
                "width": cat.width,
                "members_doc": " | ".join(f"D_{n} ({r})" for n, r in cat.members),
                "concat_length": cat.length,
                "concat_padded": cat.padded,
                "norm": norm.kind,
                "norm_kind": NORM_KIND[norm.kind],
                "eps": norm.eps,
                "configs": choice.configs,
                "meta_source": choice.source,
            }
            files.append(
                KernelFile(
                    "down_proj",
                    file_name(shape_id, cat.name),
                    "down_proj.py.j2",
                    values,
                    {"shape_key": key, "configs": choice.configs, "meta_source": choice.source},
                )
            )
    return files
