"""One layer's paged KV cache on one rank: a dense K/V shard or the latent [z_k | z_v]
rows (``runtime.engine.kv_cache`` allocates them and plans latent decode)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.kernels.latent_operands import LatentStep
from runtime.model.native_key_scores import NativeKeyScores


def _rows(pool: torch.Tensor | None) -> torch.Tensor | None:
    """A paged pool [blocks, block_size, ...] as one row per slot [slots, ...] (a view)."""
    return None if pool is None else pool.view(-1, *pool.shape[2:])


@dataclass
class LayerCache:
    """Dense: post-RoPE K and V shards [blocks, block_size, kv_heads, head_dim].
    Latent: pre-RoPE [z_k | z_v] [blocks, block_size, r_k + r_v], the same on every rank.
    The last block is scratch: padded batch rows write there. ``*_rows``: the same
    memory one row per slot, made once (every decode step writes and gathers by slot)."""

    kind: str
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    latent: torch.Tensor | None = None
    k_rows: torch.Tensor | None = field(init=False, repr=False)
    v_rows: torch.Tensor | None = field(init=False, repr=False)
    latent_rows: torch.Tensor | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.k_rows, self.v_rows = _rows(self.k), _rows(self.v)
        self.latent_rows = _rows(self.latent)

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, latent: torch.Tensor | None
    ) -> None:
        if self.kind == "latent":
            self.latent_rows.index_copy_(0, slots, latent)
        else:
            self.k_rows.index_copy_(0, slots, k)
            self.v_rows.index_copy_(0, slots, v)


@dataclass(frozen=True)
class DenseDecodeCache:
    """What a decode step's native attention (``runtime.model.decode_block``) reads of one
    dense layer cache: its K and V rows, each row's new slot [B], the slots of its
    tokens [B, L] (new one included; 0 past its length) and lengths [B], all int64, and
    the attention's scale. The slots are the same for every layer of a step: their range
    is checked once, when the step makes them (``checked``)."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    new_slots: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    scale: float

    @staticmethod
    def checked(new_slots: torch.Tensor, slots: torch.Tensor, cache_slots: int) -> None:
        """A slot past the cache would be read or written out of bounds by native code."""
        low = min(int(new_slots.min()), int(slots.min()))
        high = max(int(new_slots.max()), int(slots.max()))
        if low < 0 or high >= cache_slots:
            raise ValueError(f"decode slots {low}..{high} outside a cache of {cache_slots}")


@dataclass(frozen=True)
class LatentDecodeCache:
    """What a decode step's native latent attention (``LatentAttentionHalf.attention``)
    reads of one latent layer cache: its rows [slots, r_k + r_v], the step's tokens
    (``LatentStep``, the same for every layer), the layer's native scores (its
    descriptor and the keys' RoPE tables) and the attention's scale."""

    rows: torch.Tensor
    step: LatentStep
    scores: NativeKeyScores
    scale: float


# A decode step's layer cache as the native decode block reads it.
DecodeCache = DenseDecodeCache | LatentDecodeCache
