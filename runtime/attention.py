"""Prefill attention over a packed batch of sequences (no cache): causal within each
sequence. The paged decode path uses the generated paged-attention kernel."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def packed_causal_attention(cu_seqlens: list[int]):
    """An attention callback for ``runtime.layers.Batch``: tokens of sequence i are rows
    cu_seqlens[i]:cu_seqlens[i+1] of q, k, v."""

    def attention(index, q, k, v, latent):
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, stop in itertools.pairwise(cu_seqlens):
            qs = q[start:stop].transpose(0, 1).float()
            ks = k[start:stop].repeat_interleave(group, dim=1).transpose(0, 1).float()
            vs = v[start:stop].repeat_interleave(group, dim=1).transpose(0, 1).float()
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out[start:stop] = o.transpose(0, 1).to(q.dtype)
        return out

    return attention
