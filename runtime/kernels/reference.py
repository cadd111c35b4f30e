"""Plain-torch references of every generated kernel family.

Each function has the signature of the generated launcher (spec constants such as
``norm`` or ``segments`` are keyword-only and bound by the generated module; ``meta``,
the launch's meta-parameters, does not change a result and is ignored here). They
are the test oracle and the ``torch`` backend of CPU runs, so they are written
without host synchronisation (no ``.item()``, no data-dependent shapes): counts that
live in device memory are applied as masks.
"""

from __future__ import annotations

import torch

# Per all-gather chunk, per up-factor slot: (dst column in the chunk, src row of the
# factor, width); width 0 means the chunk holds nothing of that slot.
Segments = tuple[tuple[tuple[int, int, int], ...], ...]


def apply_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    norm: str,
    eps: float,
) -> torch.Tensor:
    """RMSNorm or LayerNorm in fp32 (``norm='none'`` returns x as fp32)."""
    xf = x.float()
    if norm == "rms":
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    elif norm == "layer":
        mean = xf.mean(-1, keepdim=True)
        xf = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = xf * weight.float()
    if bias is not None:
        xf = xf + bias.float()
    return xf


def down_proj(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    meta: dict | None = None,
    *,
    norm: str,
    eps: float,
) -> torch.Tensor:
    """out = norm(x) · weight, weight [in, width]: this rank's slice of [D_q|D_k|D_v]."""
    out.copy_(apply_norm(x, norm_weight, norm_bias, norm=norm, eps=eps) @ weight.float())
    return out


def latent_up_chunk(
    chunk: torch.Tensor,
    chunk_index: int,
    u_factors: tuple[torch.Tensor, ...],
    accumulators: tuple[torch.Tensor, ...],
    meta: dict | None = None,
    *,
    segments: Segments,
) -> None:
    """Split-K step of the up-projection: for each segment of all-gather chunk
    ``chunk_index``, accumulators[slot] += chunk[:, dst:dst+w] · U_slot[src:src+w]."""
    for slot, (dst, src, width) in enumerate(segments[chunk_index]):
        if width:
            part = chunk[:, dst : dst + width].float() @ u_factors[slot][src : src + width].float()
            accumulators[slot].add_(part)


def latent_up_gathered(
    latent: torch.Tensor, u_factors: tuple[torch.Tensor, ...], ranks: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """Gather-then-GEMM: the full latent [z_0 | z_1 | ...] times each up factor."""
    outs, offset = [], 0
    for u, r in zip(u_factors, ranks, strict=True):
        outs.append(latent[:, offset : offset + r].float() @ u.float())
        offset += r
    return tuple(outs)


def gemm_fixed(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    n_valid: torch.Tensor,
    work_counter: torch.Tensor | None = None,
    meta: dict | None = None,
) -> torch.Tensor:
    """out[:n] = a[:n] · b with n = n_valid[0] read from device memory; rows past n
    are left untouched. (The reference computes every row and masks.)"""
    rows = torch.arange(a.shape[0], device=a.device)[:, None]
    result = (a.float() @ b.float()).to(out.dtype)
    out.copy_(torch.where(rows < n_valid[0], result, out))
    return out


def kv_block_copy(
    src: torch.Tensor, dst: torch.Tensor, copy_list: torch.Tensor, num_runs: torch.Tensor
) -> torch.Tensor:
    """Copy runs of contiguous blocks: run j (j < num_runs[0]) moves
    src[s : s+n] to dst[d : d+n] where copy_list[j] = (s, d, n).
    src [num_blocks, block_size, width], dst [max_blocks, block_size, width]."""
    runs = copy_list.long()
    s, d, n = runs[:, 0], runs[:, 1], runs[:, 2]
    j = torch.arange(dst.shape[0], device=dst.device)[:, None]
    live = torch.arange(runs.shape[0], device=dst.device)[None, :] < num_runs[0]
    hit = live & (j >= d[None, :]) & (j < (d + n)[None, :])
    src_block = (hit * (s[None, :] + j - d[None, :])).sum(1)
    covered = hit.any(1)
    gathered = src[src_block.clamp(0, src.shape[0] - 1)]
    dst.copy_(torch.where(covered[:, None, None], gathered, dst))
    return dst


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos(), angles.sin()


def rope_inplace(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    style: str,
) -> torch.Tensor:
    """Rotate x [rows, heads, head_dim] in place at ``positions`` for rows < n_valid[0].
    ``neox`` rotates (first half, second half) pairs, ``gptj`` (even, odd) pairs."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if style == "neox":
        half = x.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    rows = torch.arange(x.shape[0], device=x.device)[:, None, None]
    x.copy_(torch.where(rows < n_valid[0], rotated.to(x.dtype), x))
    return x


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its paged K/V.
    q [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_table [B, max_blocks];
    seq_lens [B]; out [B, H, D]. A sequence of length 0 gets zeros."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    k = k_cache[block_table.long()].flatten(1, 2).float()  # [B, T, KVH, D]
    v = v_cache[block_table.long()].flatten(1, 2).float()
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    t = torch.arange(k.shape[1], device=q.device)[None, None, :]
    valid = t < seq_lens[:, None, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out.copy_(torch.einsum("bht,bthd->bhd", probs, v).to(out.dtype))
    return out
