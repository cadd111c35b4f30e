"""A decode step's layers in one native call on one rank (``runtime.kernels.decode_stack``):
where every layer decodes through native halves — its decode block (``DecodeBlock``) over
a dense cache, or a latent cache's attention half and MLP half (``LatentAttentionHalf``,
``MlpHalf``) — the model hands the step to this instead of calling each layer's halves
from Python.

Why: each half streams MBs of weights through the caches, so the Python between two
halves runs cold — 90 us a layer, 2.6 ms of a 45 ms batch-1 step of cpu-135m with one
thread on the AMD EPYC VM (``docs/bench/cpu-peer``). What is left of the step's Python
runs once, before the first half, on warm caches. Across ranks the halves are cut at
their collectives and the layers keep their own calls; so does a step whose statistics
are counted (each layer counts the collectives it skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.kernels import latent_operands
from runtime.kernels.decode_stack import (
    DenseOperands,
    LatentOperands,
    StackLayer,
    StepTokens,
    decode_layers,
    layer_array,
)
from runtime.model.decode_block import DecodeBlock, LatentAttentionHalf, MlpHalf
from runtime.model.execution import Batch
from runtime.model.paged_cache import DecodeCache, DenseDecodeCache, LatentDecodeCache

# A layer's native halves: its decode block, or a latent cache's attention and MLP halves
Halves = DecodeBlock | tuple[LatentAttentionHalf, MlpHalf]


def _settings(halves: Halves) -> tuple:
    """What the one call shares between layers: (eps of each norm, head_dim, RoPE pairs,
    hidden size)."""
    if isinstance(halves, DecodeBlock):
        d, mlp = halves.heads[2], halves.mlp_half
        return halves.eps, mlp.eps, d, halves.half, halves.input_norm.shape[0]
    attention, mlp = halves
    return attention.eps, mlp.eps, *attention.rope, attention.input_norm.shape[0]


def _whole(halves: Halves, h: int) -> bool:
    """Every projection one call's (no latent to gather), the MLP's output of width h (no
    shard to reduce), and a dense cache's W_o's too."""
    block = halves if isinstance(halves, DecodeBlock) else None
    mlp = halves.mlp_half if block else halves[1]
    attention_whole = block is None or (block.qkv.ups is None and block.o.out_width == h)
    return attention_whole and mlp.gate_up.ups is None and mlp.down.out_width == h


def _mlp(halves: Halves) -> MlpHalf:
    return halves.mlp_half if isinstance(halves, DecodeBlock) else halves[1]


@dataclass(frozen=True, eq=False)
class DecodeStack:
    layers: tuple[Halves, ...]
    heads: tuple[int, int, int]  # a dense cache's layers' (query heads, KV heads, head_dim)
    # the C descriptors of the layers for the cache rows and tables they were made for:
    # [(key, array, layers)], made on the first step (the caches are the engine's)
    described: list = field(default_factory=list, repr=False)

    @staticmethod
    def of(layers: Sequence[Halves | None]) -> DecodeStack | None:
        """The layers' halves as one call, or None where a layer has none, a projection is
        cut across ranks, or the layers differ in norms' eps, head_dim, RoPE or width."""
        if not layers or any(halves is None for halves in layers):
            return None
        settings = _settings(layers[0])
        if any(
            _settings(halves) != settings or not _whole(halves, settings[-1]) for halves in layers
        ):
            return None
        blocks = {halves.heads for halves in layers if isinstance(halves, DecodeBlock)}
        if len(blocks) > 1:
            return None
        return DecodeStack(tuple(layers), blocks.pop() if blocks else (1, 1, settings[2]))

    def run(self, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """x [m, h] (updated in place) through every layer, and the last layer's MLP output
        (which the final norm adds); None where the step is not a decode step with RoPE
        tables over caches the layers' halves read natively (they then run it themselves)."""
        if batch.decode_cache is None or batch.rope_tables is None:
            return None
        caches = [batch.decode_cache(i) for i in range(len(self.layers))]
        if not all(map(_reads, self.layers, caches)):
            return None
        operands = [
            self._operands(x, halves, c) for halves, c in zip(self.layers, caches, strict=True)
        ]
        dense = next((c for c in caches if isinstance(c, DenseDecodeCache)), None)
        latent = next((c for c in caches if isinstance(c, LatentDecodeCache)), None)
        tokens = StepTokens(
            dense and (dense.new_slots, dense.slots, dense.lengths), latent and latent.step
        )
        cos, sin = batch.rope_tables
        eps, _, d, half, _ = _settings(self.layers[0])
        if cos.numel() != x.shape[0] * d or sin.numel() != cos.numel():
            raise ValueError(f"decode layers: RoPE tables {tuple(cos.shape)} for {x.shape[0]} rows")
        attend = latent and latent.scores.library.attention_address
        library, scale = _mlp(self.layers[0]).library, caches[0].scale
        array = self._array(operands)
        return decode_layers(
            library, x, eps, array, self.heads, (cos, sin, half), tokens, scale, attend
        )

    def _operands(self, x: torch.Tensor, halves: Halves, cache: DecodeCache) -> StackLayer:
        mlp = _mlp(halves)
        if isinstance(halves, DecodeBlock):
            _, kv_heads, d = halves.heads
            want = (cache.k_rows.shape[0], kv_heads, d)
            if not all(t.shape == want and t.is_contiguous() for t in (cache.k_rows, cache.v_rows)):
                found = tuple(cache.k_rows.shape)
                raise ValueError(f"decode layers: cache rows {found}, want {want}")
            attention = DenseOperands(halves.qkv.first, halves.o, cache.k_rows, cache.v_rows)
            norm = halves.input_norm
        else:
            attention, norm = _latent_operands(x, halves[0], cache), halves[0].input_norm
        return StackLayer(norm, attention, mlp.post_norm, mlp.gate_up.first, mlp.inter, mlp.down)

    def _array(self, layers: list[StackLayer]):
        """The layers' C descriptors (made again where a cache or table moved)."""
        key = tuple(_addresses(layer.attention) for layer in layers)
        if not self.described or self.described[0][0] != key:
            self.described[:] = [(key, layer_array(layers), layers)]
        return self.described[0][1]


def _reads(halves: Halves, cache: DecodeCache | None) -> bool:
    """Whether the layer's halves read this cache natively."""
    kind = DenseDecodeCache if isinstance(halves, DecodeBlock) else LatentDecodeCache
    return isinstance(cache, kind)


def _latent_operands(
    x: torch.Tensor, half: LatentAttentionHalf, cache: LatentDecodeCache
) -> LatentOperands:
    """A latent cache layer's attention operands this step, checked as
    ``DecodeBlockLibrary.latent_attention`` checks them."""
    scores, step = cache.scores, cache.step
    tables = scores.angles.tables(step.slots.shape[1], scores.layer.wpad)
    kv_first, d = half.kv[0], half.rope[0]
    width = (half.q or half.qkv).out_width
    fits = scores.layer.r_k + scores.layer.u_v.shape[1] + kv_first <= half.qkv.columns
    fits = fits and x.shape[0] == step.slots.shape[0]
    layer, rows = scores.layer, cache.rows
    if not (fits and latent_operands.cache_fits(rows, layer, step, tables, width // d, d)):
        checks = {"k|v columns within the latent, one row per sequence": fits}
        checks |= latent_operands.cache_checks(rows, layer, step, tables, width // d, d)
        latent_operands.check("latent attention", checks)
    return LatentOperands(half.q, half.qkv, kv_first, layer, rows, tables, half.o)


def _addresses(a: DenseOperands | LatentOperands) -> tuple:
    if isinstance(a, DenseOperands):
        return a.k_rows.data_ptr(), a.v_rows.data_ptr()
    return a.rows.data_ptr(), a.rows.shape[0], a.tables[0].data_ptr(), a.tables[1].data_ptr()
