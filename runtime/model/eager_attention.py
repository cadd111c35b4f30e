"""Attention over the tokens that exist: the dynamic (CPU) path.

The static path attends over fixed buffers sized for the largest batch and the
longest sequence, so that a CUDA graph can replay it. Here every shape follows the
step: keys are gathered for each sequence's real length (padded only to the batch's
longest), a latent cache is reconstructed for the batch's tokens only, and V is
never reconstructed in decode: softmax(q·Kᵀ)·(z_v·U_v) = (softmax(q·Kᵀ)·z_v)·U_v.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.kernels.eager import grouped_attention, matmul, normalize, rope_tables, rotate
from runtime.model.paged_cache import LayerCache


@dataclass(frozen=True)
class CacheContext:
    """Where the cached tokens of each sequence of a step live.

    slots long [B, L]: cache slot of token j of sequence b (L: the longest sequence;
    slot 0 past a sequence's length); valid bool [B, L]; cos, sin [L, head_dim]: RoPE
    tables (``eager.rope_tables``) of positions 0..L-1 (None without RoPE), for keys
    rebuilt from a latent cache, which holds pre-RoPE latents."""

    slots: torch.Tensor
    valid: torch.Tensor
    mask_bias: torch.Tensor  # [B, L]: 0 where valid, -inf past a sequence's length
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    # The same tables transposed, [head_dim, L] contiguous, once per step: rotating keys
    # built as [.., head_dim, L] against a transposed *view* took 0.76 ms per layer here
    # (batch 8, context 256, 3 KV heads) against 0.15 ms with these.
    cos_t: torch.Tensor | None = None
    sin_t: torch.Tensor | None = None


def cache_context(
    block_tables: list[list[int]],
    lengths: list[int],
    block_size: int,
    inv_freq: torch.Tensor | None,
    device: torch.device,
    rope_style: str = "neox",
) -> CacheContext:
    longest = max(lengths)
    blocks = -(-longest // block_size)
    table = torch.zeros(len(lengths), blocks, dtype=torch.long)
    for b, t in enumerate(block_tables):
        used = t[:blocks]
        table[b, : len(used)] = torch.tensor(used, dtype=torch.long)
    offsets = torch.arange(block_size)
    slots = (table[:, :, None] * block_size + offsets).flatten(1)[:, :longest]
    positions = torch.arange(longest)
    valid = positions[None, :] < torch.tensor(lengths)[:, None]
    slots = torch.where(valid, slots, 0)
    cos = sin = None
    if inv_freq is not None:
        cos, sin = rope_tables(positions.to(device), inv_freq, rope_style)
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    cos_t = sin_t = None
    if cos is not None:
        cos_t, sin_t = cos.t().contiguous(), sin.t().contiguous()
    return CacheContext(slots.to(device), valid.to(device), bias.to(device), cos, sin, cos_t, sin_t)


@dataclass(frozen=True)
class LatentFactors:
    """One layer's up factors of k and v as a latent cache needs them (this rank's
    heads): z_k [.., r_k] -> K [.., kv_heads, head_dim] and z_v -> V likewise."""

    r_k: int
    kv_heads: int
    head_dim: int
    u_k: torch.Tensor  # [r_k, kv_heads · head_dim]
    u_v: torch.Tensor  # [r_v, kv_heads · head_dim]
    bias_k: torch.Tensor | None
    bias_v: torch.Tensor | None
    k_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm weight
    eps: float
    rope_style: str
    # The layouts decode multiplies by, made once: U_kᵀ [kv_heads · head_dim, r_k]
    # contiguous (the keys' left factor) and U_v per KV head [kv_heads, r_v, head_dim].
    u_k_rows: torch.Tensor = field(init=False, repr=False)
    u_v_heads: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        heads = self.u_v.reshape(-1, self.kv_heads, self.head_dim).permute(1, 0, 2)
        object.__setattr__(self, "u_k_rows", self.u_k.t().contiguous())
        object.__setattr__(self, "u_v_heads", heads.contiguous())

    def keys(self, zk: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """zk [..., L, r_k] -> post-RoPE keys [..., L, kv_heads, head_dim]."""
        k = matmul(zk, self.u_k)
        if self.bias_k is not None:
            k = k + self.bias_k
        k = k.unflatten(-1, (self.kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = normalize(k, self.k_norm, None, norm="rms", eps=self.eps)
        if cos is not None:
            k = rotate(k, cos[:, None, :], sin[:, None, :], self.rope_style).to(zk.dtype)
        return k

    def keys_transposed(
        self, zk: torch.Tensor, cos_t: torch.Tensor | None, sin_t: torch.Tensor | None
    ) -> torch.Tensor:
        """zk [B, L, r_k] -> post-RoPE keys [B, kv_heads, head_dim, L], the layout the
        scores' batched matmul reads without a copy. Built as Uᵀ·zkᵀ per sequence, RoPE
        along head_dim with the transposed tables cos_t, sin_t [head_dim, L]: fewer passes
        over the keys than rebuilding [B, L, ...] and permuting (decode with a latent cache
        is bound by them)."""
        batch, length, _ = zk.shape
        kt = torch.matmul(self.u_k_rows, zk.transpose(1, 2))  # [B, KV·D, L]
        if self.bias_k is not None:
            kt = kt + self.bias_k[:, None]
        kt = kt.view(batch, self.kv_heads, self.head_dim, length)
        if self.k_norm is not None:
            inv = torch.rsqrt(kt.float().pow(2).mean(-2, keepdim=True) + self.eps)
            kt = (kt * inv * self.k_norm.float()[:, None]).to(zk.dtype)
        if cos_t is None:
            return kt
        if self.rope_style != "neox":
            rotated = kt.unflatten(-2, (-1, 2)).flip(-2).flatten(-3, -2)
            return rotated.mul_(sin_t).addcmul_(kt, cos_t)
        # neox rotates the two halves of head_dim into each other (sin_t carries the
        # sign): three passes over the keys, no rotated copy.
        half = self.head_dim // 2
        keys = kt * cos_t
        keys[..., :half, :].addcmul_(kt[..., half:, :], sin_t[:half])
        keys[..., half:, :].addcmul_(kt[..., :half, :], sin_t[half:])
        return keys

    def values(self, zv: torch.Tensor) -> torch.Tensor:
        v = zv @ self.u_v
        if self.bias_v is not None:
            v = v + self.bias_v
        return v.unflatten(-1, (self.kv_heads, self.head_dim))


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` [...] of a paged cache [blocks, block_size, ...] -> [..., ...].
    (index_select: 2x faster than advanced indexing for these sizes, measured here.)"""
    rows = cache.view(-1, *cache.shape[2:])
    return rows.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:])


def decode_dense(
    q: torch.Tensor, cache: LayerCache, ctx: CacheContext, scale: float
) -> torch.Tensor:
    """q [B, H, D] against the dense shard of each sequence's cached tokens."""
    k, v = gather(cache.k, ctx.slots), gather(cache.v, ctx.slots)
    return grouped_attention(q, k, v, ctx.valid, scale)


def decode_latent(
    q: torch.Tensor, cache: LayerCache, ctx: CacheContext, f: LatentFactors, scale: float
) -> torch.Tensor:
    """q [B, H, D] against keys rebuilt from the batch's cached latents; V absorbed.

    One gather of whole [z_k | z_v] rows (two strided ones before), RoPE without a
    rotated copy, U_v per KV head laid out once: a latent decode step 5% shorter here
    (cpu-135m at 40%, batch 8, context 256; median of 16 interleaved pairs against the
    previous form, 11 of them faster; greedy tokens the same)."""
    batch, heads, d = q.shape
    rows = cache.latent.view(-1, cache.latent.shape[-1])
    length, group = ctx.slots.shape[1], heads // f.kv_heads
    z = rows.index_select(0, ctx.slots.flatten()).view(batch, length, -1)
    keys_t = f.keys_transposed(z[..., : f.r_k], ctx.cos_t, ctx.sin_t)  # [B, KV, D, L]
    qg = (q * scale).reshape(batch, f.kv_heads, group, d)
    scores = (qg @ keys_t).float().add_(ctx.mask_bias[:, None, None, :])  # [B, KV, G, L]
    probs = torch.softmax(scores, dim=-1).to(z.dtype).reshape(batch, heads, length)
    pz = probs @ z[..., f.r_k :]  # [B, H, r_v]
    # per KV head: its query rows of every sequence times that head's U_v
    pz = pz.view(batch, f.kv_heads, group, -1).transpose(0, 1).reshape(f.kv_heads, -1, pz.shape[-1])
    out = torch.bmm(pz, f.u_v_heads).view(f.kv_heads, batch, group, d).transpose(0, 1)
    if f.bias_v is not None:
        out = out + f.bias_v.view(f.kv_heads, 1, d)
    return out.reshape(batch, heads, d)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Queries at positions start.. (q [n, H, D]) against keys 0..start+n-1 (k, v
    [start + n, KVH, D]); causal; GQA without repeating K/V."""
    n, context = q.shape[0], k.shape[0]
    mask = None
    if start:
        mask = torch.arange(context, device=q.device)[None, :] <= (
            start + torch.arange(n, device=q.device)[:, None]
        )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=not start,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
