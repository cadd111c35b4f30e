"""Cut full factors into one rank's local tensors, exactly as the plan says.

Full factors are in math layout: ``<m>.v`` D [in, r], ``<m>.u`` U [r, out],
``<m>.weight`` W [in, out], ``<m>.bias`` [out]. Local tensors keep that layout,
zero-padded where the plan pads; concat-split down factors become ``attn.cat`` /
``mlp.cat`` [in, width] assembled from the plan's segments.
"""

from __future__ import annotations

import torch

from dsl.plan import LayerPlan
from dsl.sharding import COLS, ROWS, FactorShard


def slice_padded(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """t[start:stop] along ``dim``, zero rows past t's length (the plan's padding)."""
    n = t.shape[dim]
    part = t.narrow(dim, min(start, n), max(0, min(stop, n) - min(start, n)))
    missing = (stop - start) - part.shape[dim]
    if missing:
        shape = list(t.shape)
        shape[dim] = missing
        part = torch.cat([part, t.new_zeros(shape)], dim=dim)
    return part.contiguous()


def shard_factor(f: FactorShard, full: torch.Tensor, rank: int) -> torch.Tensor:
    start, stop = f.ranges[rank]
    if f.split == COLS:
        return slice_padded(full, full.dim() - 1, start, stop)
    if f.split == ROWS:
        return slice_padded(full, 0, start, stop)
    return full.contiguous()


def shard_layer(lp: LayerPlan, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Local tensors of rank ``rank`` for one layer; ``full`` holds every factor the
    plan names (and, for deinfer, the down factors of each concat member)."""
    local = {}
    for f in lp.factors:
        if f.tensor not in full:
            raise KeyError(f"missing tensor {f.tensor} for layer plan {lp.mode}")
        local[f.tensor] = shard_factor(f, full[f.tensor], rank)
    for cat in lp.concats:
        first = full[f"{cat.members[0][0]}.v"]
        w = first.new_zeros((cat.in_features, cat.width))
        for seg in cat.segments(rank):
            w[:, seg.dst_start : seg.dst_start + seg.width] = full[f"{seg.member}.v"][
                :, seg.src_start : seg.src_stop
            ]
        local[f"{cat.name}.cat"] = w
    return local
