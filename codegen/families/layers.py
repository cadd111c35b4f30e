"""The registry of a generated folder: which kernel file serves which shape, and the
layer -> layer-shape map. The layer dataflow itself is hand-written in
``runtime.model.layers`` (it does not depend on the spec); this file binds it to kernels."""

from __future__ import annotations

from codegen.families import down_proj, gemm_fixed, kv_copy, latent_up, paged_attention, rope
from codegen.families.context import GenContext
from codegen.render import KernelFile


def _module(file_name: str) -> str:
    return file_name.removesuffix(".py")


def generate(ctx: GenContext) -> list[KernelFile]:
    spec = ctx.spec
    concat_kernels = []
    for lp in ctx.layer_plans("deinfer"):
        sid = lp.shape_id
        for cat in lp.concats:
            concat_kernels.append(
                (
                    cat.name,
                    sid,
                    _module(down_proj.file_name(sid, cat.name)),
                    _module(latent_up.file_name(sid, cat.name)),
                )
            )
    d, bs = spec.model.head_dim, spec.runtime.block_size
    values = {
        "concat_kernels": concat_kernels,
        "gemms": list(gemm_fixed.gemm_shapes(ctx)),
        "gemm_module": _module(gemm_fixed.FILE_NAME),
        "ropes": [(h, _module(rope.rope_file_name(h, d))) for h in rope.rope_head_counts(ctx)]
        if spec.model.positions.kind == "rope"
        else [],
        "attentions": [
            (h, kv, _module(paged_attention.file_name(h, kv, d, bs)))
            for h, kv in paged_attention.head_layouts(ctx)
        ],
        "kv_copies": [
            (w, _module(kv_copy.copy_file_name(w, bs))) for w in kv_copy.latent_widths(ctx)
        ],
    }
    return [KernelFile("registry", "kernels.py", "kernels.py.j2", values)]
