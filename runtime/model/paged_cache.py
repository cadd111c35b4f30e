"""One layer's paged KV cache on one rank: a dense K/V shard or the latent [z_k | z_v]
rows (``runtime.engine.kv_cache`` allocates them and plans latent decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCache:
    """Dense: post-RoPE K and V shards [blocks, block_size, kv_heads, head_dim].
    Latent: pre-RoPE [z_k | z_v] [blocks, block_size, r_k + r_v], the same on every rank.
    The last block is scratch: padded batch rows write there."""

    kind: str
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    latent: torch.Tensor | None = None

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, latent: torch.Tensor | None
    ) -> None:
        if self.kind == "latent":
            self.latent.view(-1, self.latent.shape[-1]).index_copy_(0, slots, latent)
        else:
            self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slots, k)
            self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slots, v)
