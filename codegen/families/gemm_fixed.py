"""Fixed-size GEMMs: one file, one kernel specialised per distinct (K, N) that any mode
multiplies by (plus the latent-cache reconstruction GEMMs)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile
from dsl import build_plan
from dsl.plan import MODES, UP_SHARDED

FILE_NAME = "gemm_fixed.py"


def gemm_shapes(ctx: GenContext) -> dict[tuple[int, int], list[str]]:
    """(K, N) -> uses, e.g. 'deinfer s0 o.v'. Concat down-projections and the latent
    up-projection have their own kernels; biases are not GEMMs."""
    uses: dict[tuple[int, int], list[str]] = {}
    # deinfer's other layout of the o/down up factors (split by columns) has GEMMs of its
    # own: the runtime may choose it (``RunnerConfig.up_layout``).
    sharded = build_plan(ctx.spec, ctx.tp, ("deinfer",), UP_SHARDED).modes["deinfer"]
    for lp in sharded.layer_plans:
        for f in lp.split_row_ups():
            k, n = f.local_shape(0)
            uses.setdefault((k, n), []).append(f"deinfer/sharded {lp.shape_id} {f.tensor}")
    for mode in MODES:
        for lp in ctx.layer_plans(mode):
            # In deinfer mode the up factors of a concat group run in the latent_up kernel.
            latent_up = (
                {n for c in lp.concats for n, _ in c.members} if mode == "deinfer" else set()
            )
            for f in lp.factors:
                if f.factor == "bias" or (f.factor == "up" and f.matrix in latent_up):
                    continue
                k, n = f.local_shape(0)
                uses.setdefault((k, n), []).append(f"{mode} {lp.shape_id} {f.tensor}")
            if mode == "deinfer" and lp.kv_latent_per_rank is not None:
                for name in ("k", "v"):  # reconstruction of the latent cache
                    k, n = lp.factor(f"{name}.u").local_shape(0)
                    uses.setdefault((k, n), []).append(
                        f"deinfer {lp.shape_id} {name}.u reconstruct"
                    )
    return dict(sorted(uses.items()))


def kernel_file(
    shapes: dict[tuple[int, int], list[str]],
    ctx: GenContext | None = None,
    choices: dict | None = None,
) -> KernelFile:
    """The one GEMM file for ``shapes``; meta-parameters from ``choices`` ((k, n) ->
    ConfigChoice) or, given ``ctx``, from the tuned-config store."""
    if choices is None:
        choices = {(k, n): ctx.meta("gemm_fixed", f"k{k}_n{n}", n, k) for k, n in shapes}
    entries = [
        {
            "k": k,
            "n": n,
            "used_by": ", ".join(sorted(set(uses))),
            "configs": choices[(k, n)].configs,
            "meta_source": choices[(k, n)].source,
        }
        for (k, n), uses in shapes.items()
    ]
    manifest = [
        {"shape_key": f"k{e['k']}_n{e['n']}", **{key: e[key] for key in ("configs", "meta_source")}}
        for e in entries
    ]
    return KernelFile("gemm_fixed", FILE_NAME, "gemm_fixed.py.j2", {"shapes": entries}, manifest)


def generate(ctx: GenContext) -> list[KernelFile]:
    shapes = gemm_shapes(ctx)
    return [kernel_file(shapes, ctx)] if shapes else []
