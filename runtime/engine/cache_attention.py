"""Attention over one rank's paged KV caches, made once per rank: for each forward, the
callable its layers attend with (``Batch.attention``).

- ``prefill``: a chunk of prompts, causal within each; a chunk that continues a prompt
  also reads the prompt's cached part (its keys rebuilt where the cache is latent).
- ``decode``: one new token per sequence at the batch's real lengths (the dynamic path;
  the static path's graph-safe decode is ``runtime.engine.static_decode``'s).
Every forward writes its new tokens' K and V (or latent) into the cache first."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.engine.step_io import Piece, SeqInput
from runtime.kernels.latent_operands import LatentStep
from runtime.model.eager_attention import (
    CacheContext,
    LatentFactors,
    cache_context,
    causal_attention,
    decode_dense,
    decode_dense_native,
    decode_latent,
    decode_latent_native,
    gather,
    latent_step,
)
from runtime.model.execution import AttentionFn
from runtime.model.paged_cache import (
    DecodeCache,
    DenseDecodeCache,
    LatentDecodeCache,
    LayerCache,
)


class CacheAttention:
    def __init__(
        self,
        caches: list[LayerCache],
        latent_factors: dict[int, LatentFactors],
        block_size: int,
        scale: float,
        inv_freq: torch.Tensor | None,
        rope_style: str,
        device: torch.device,
    ) -> None:
        self.caches, self.latent_factors = caches, latent_factors
        self.block_size, self.scale = block_size, scale
        self.inv_freq, self.rope_style, self.device = inv_freq, rope_style, device

    def slot(self, table: list[int], position: int) -> int:
        """The cache slot of token ``position`` of a sequence with block table ``table``."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _context(self, tables: list[list[int]], lengths: list[int]) -> CacheContext:
        return cache_context(
            tables, lengths, self.block_size, self.inv_freq, self.device, self.rope_style
        )

    def prefill(self, seqs: list[SeqInput], chunk: list[Piece]) -> AttentionFn:
        slots = [
            self.slot(seqs[p.seq].block_table, i) for p in chunk for i in range(p.start, p.stop)
        ]
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        # keys 0..stop-1 from the cache (this chunk's included) for a continued prompt
        contexts = {
            i: self._context([seqs[p.seq].block_table], [p.stop])
            for i, p in enumerate(chunk)
            if p.start
        }

        def attention(index, q, k, v, latent):
            self.caches[index].write(slot_t, k, v, latent)
            out, row = torch.empty_like(q), 0
            for i, p in enumerate(chunk):
                rows = slice(row, row + p.stop - p.start)
                row = rows.stop
                if i in contexts:
                    k_ctx, v_ctx = self._cached_kv(index, contexts[i])
                else:
                    k_ctx, v_ctx = k[rows], v[rows]
                out[rows] = causal_attention(q[rows], k_ctx, v_ctx, p.start, self.scale)
            return out

        return attention

    def _cached_kv(self, index: int, ctx: CacheContext) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, kv_heads, head_dim] of one sequence's cached tokens."""
        cache, slots = self.caches[index], ctx.slots[0]
        if cache.kind == "dense":
            return gather(cache.k, slots), gather(cache.v, slots)
        f = self.latent_factors[index]
        z = gather(cache.latent, slots)
        return f.keys(z[:, : f.r_k], ctx.cos, ctx.sin), f.values(z[:, f.r_k :])

    def decode(
        self, seqs: list[SeqInput]
    ) -> tuple[AttentionFn, Callable[[int], DecodeCache | None]]:
        """The step's attention, and its layer caches by index as the native decode block
        reads them (``Batch.decode_cache``)."""
        slots = torch.tensor(
            [self.slot(s.block_table, s.length - 1) for s in seqs],
            dtype=torch.long,
            device=self.device,
        )
        ctx = self._context([s.block_table for s in seqs], [s.length for s in seqs])

        checked: list[bool] = []  # the slots' range, checked on first use
        steps: list[LatentStep] = []  # the latent caches' tokens, made on first use

        def tokens() -> LatentStep:
            if not steps:
                steps.append(latent_step(slots, ctx))
            return steps[0]

        def decode_cache(index: int) -> DecodeCache | None:
            cache = self.caches[index]
            if cache.kind == "latent":  # where its attention is native
                scores, rows = self.latent_factors[index].native_scores, cache.latent_rows
                if scores is None or rows.dtype != torch.float32 or not rows.is_cpu:
                    return None
                return LatentDecodeCache(rows, tokens(), scores, self.scale)
            if not checked:
                DenseDecodeCache.checked(slots, ctx.slots, cache.k_rows.shape[0])
                checked.append(True)
            return DenseDecodeCache(
                cache.k_rows, cache.v_rows, slots, ctx.slots, ctx.lengths, self.scale
            )

        def attention(index, q, k, v, latent):
            cache = self.caches[index]
            if cache.kind == "dense":  # written and attended in one native pass where it can
                out = decode_dense_native(q, k, v, decode_cache(index))
            else:  # likewise, in one native call
                f = self.latent_factors[index]
                out = decode_latent_native(q, latent, tokens(), cache, f, self.scale)
            if out is not None:
                return out
            cache.write(slots, k, v, latent)
            if cache.kind == "dense":
                return decode_dense(q, cache, ctx, self.scale)
            return decode_latent(q, cache, ctx, self.latent_factors[index], self.scale)

        return attention, decode_cache
