"""One rank's weights, read slice by slice from a decomposed checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dsl.plan import ModePlan
from dsl.sharding import COLS, ROWS, pad_to
from dsl.spec import LayerRanks, Spec
from runtime.model.checkpoint import CheckpointReader, Names, names_for, validate
from runtime.model.latent_basis import CopyBasisSource, copies_usable
from runtime.model.shard import shard_layer


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab_padded / tp, h]: this rank's rows of the vocabulary
    lm_head: torch.Tensor  # [vocab_padded / tp, h] (the embedding when tied)
    positions: torch.Tensor | None  # learned positions [max_pos + offset, h], replicated
    final_norm: dict[str, torch.Tensor]
    layers: list[dict[str, torch.Tensor]]


class CheckpointSource:
    """Math-layout slices of one layer's factors, read from the checkpoint. In dense
    mode a decomposed matrix's ``<m>.weight`` slice is formed as the product D·U."""

    def __init__(self, reader: CheckpointReader, names: Names, layer: int, ranks: LayerRanks):
        self.reader, self.names, self.layer, self.ranks = reader, names, layer, ranks

    def _stored(self, tensor: str) -> tuple[str, str]:
        matrix, part = tensor.split(".", 1)
        base = self.names.layer(self.layer, matrix)
        decomposed = self.ranks.is_decomposed(matrix)
        if part == "bias":
            return f"{base}.u.bias" if decomposed else f"{base}.bias", part
        return f"{base}.{part}.weight" if part in ("u", "v") else f"{base}.weight", part

    def _read_math(self, stored: str, split: str, start: int, stop: int) -> torch.Tensor:
        """Stored tensors are the transpose of the math layout: math columns are stored rows."""
        if split == COLS:
            t = self.reader.read(stored, rows=(start, stop))
        elif split == ROWS:
            t = self.reader.read(stored, cols=(start, stop))
        else:
            t = self.reader.read(stored)
        return t if t.dim() == 1 else t.t()

    def factor(self, tensor: str, split: str, start: int, stop: int) -> torch.Tensor:
        stored, part = self._stored(tensor)
        matrix = tensor.split(".", 1)[0]
        if part == "weight" and self.ranks.is_decomposed(matrix):
            base = self.names.layer(self.layer, matrix)
            d = self._read_math(f"{base}.v.weight", ROWS if split == ROWS else "", start, stop)
            u = self._read_math(f"{base}.u.weight", COLS if split == COLS else "", start, stop)
            return d @ u
        return self._read_math(stored, split, start, stop)


def load_rank_weights(
    folder: str | Path,
    spec: Spec,
    mode_plan: ModePlan,
    rank: int,
    dtype: torch.dtype,
    kv_cache: str = "dense",
    allow_extreme: bool = False,
) -> ModelWeights:
    """Validate the checkpoint against ``spec`` and read rank ``rank``'s slices; the
    layers whose cache is latent under ``kv_cache`` get k's and v's factors in their copy
    bases (``runtime.model.latent_basis``, where decode can use them), on every path, so that
    every path caches the same. ``allow_extreme``: absurd weight magnitudes are a
    warning, not an error (``CheckpointReader``)."""
    reader = CheckpointReader(folder, allow_extreme)
    validate(reader, spec)
    m, tp = spec.model, mode_plan.tp
    names = names_for(m)
    per_rank = pad_to(m.vocab_size, tp) // tp
    rows = (rank * per_rank, (rank + 1) * per_rank)
    embed = reader.read(names.embed, rows=rows)
    lm_head = embed if m.tie_word_embeddings else reader.read(names.lm_head, rows=rows)
    positions = reader.read(names.positions) if names.positions else None
    norm_parts = ("weight", "bias") if m.norm.kind == "layer" else ("weight",)
    final_norm = {p: reader.read(f"{names.final_norm}.{p}") for p in norm_parts}
    layers = []
    for index, (ranks, lp) in enumerate(
        zip(spec.decomposition.layers, mode_plan.per_layer(), strict=True)
    ):
        source = CheckpointSource(reader, names, index, ranks)
        if lp.cache_kind(kv_cache) == "latent" and copies_usable(m.head_dim, m.qk_norm):
            source = CopyBasisSource(source, lp, m.head_dim, m.positions.rope_style)
        local = shard_layer(lp, source, rank)
        for norm in ("input_norm", "post_norm"):
            for p in norm_parts:
                local[f"{norm}.{p}"] = reader.read(f"{names.layer(index, norm)}.{p}")
        if m.qk_norm:
            for norm in ("q_norm", "k_norm"):
                local[f"{norm}.weight"] = reader.read(f"{names.layer(index, norm)}.weight")
        layers.append({k: v.to(dtype) for k, v in local.items()})
    return ModelWeights(
        embed=embed.to(dtype),
        lm_head=lm_head.to(dtype),
        positions=None if positions is None else positions.to(dtype),
        final_norm={k: v.to(dtype) for k, v in final_norm.items()},
        layers=layers,
    )
