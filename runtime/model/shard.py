"""Cut a layer's factors into one rank's local tensors, exactly as the plan says.

Local tensors are in math layout (D [in, r], U [r, out], W [in, out], bias [out]),
zero-padded where the plan pads; the down factors of a concat-split become
``attn.cat`` / ``mlp.cat`` [in, width], assembled from the plan's segments. Where the
factors come from is a ``FactorSource``: full tensors in memory (tests) or a
checkpoint read slice by slice (``runtime.model.weights``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from dsl.plan import LayerPlan
from dsl.sharding import COLS, ROWS


class FactorSource(Protocol):
    def factor(self, tensor: str, split: str, start: int, stop: int) -> torch.Tensor:
        """Math-layout slice [start, stop) of ``tensor`` along ``split`` (cols / rows;
        anything else: the whole tensor), zero-padded past its end."""
        ...


def pad_dim(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` extended with zeros along ``dim`` to ``length`` (the plan's padding)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def slice_padded(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """t[start:stop] along ``dim``, zero rows past t's length."""
    n = t.shape[dim]
    part = t.narrow(dim, min(start, n), max(0, min(stop, n) - min(start, n)))
    return pad_dim(part, dim, stop - start).contiguous()


class DictSource:
    """Full math-layout tensors held in memory."""

    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        self.full = full

    def factor(self, tensor: str, split: str, start: int, stop: int) -> torch.Tensor:
        if tensor not in self.full:
            raise KeyError(f"missing tensor {tensor}")
        t = self.full[tensor]
        if split == COLS:
            return slice_padded(t, t.dim() - 1, start, stop)
        if split == ROWS:
            return slice_padded(t, 0, start, stop)
        return t.contiguous()


def shard_layer(lp: LayerPlan, source: FactorSource, rank: int) -> dict[str, torch.Tensor]:
    """Local tensors of rank ``rank`` for one layer."""
    local = {}
    for f in lp.factors:
        start, stop = f.ranges[rank]
        local[f.tensor] = source.factor(f.tensor, f.split, start, stop).contiguous()
    for cat in lp.concats:
        parts = []
        for seg in cat.segments(rank):
            d = source.factor(f"{seg.member}.v", COLS, seg.src_start, seg.src_stop)
            parts.append((seg.dst_start, d))
        # A rank can hold padding only (a latent narrower than tp): zeros, in fp32.
        dtype = parts[0][1].dtype if parts else torch.float32
        w = torch.zeros((cat.in_features, cat.width), dtype=dtype)
        for dst, d in parts:
            w[:, dst : dst + d.shape[1]] = d
        local[f"{cat.name}.cat"] = w
    return local
