"""Prefill attention over a packed batch of whole sequences (no cache): causal within
each sequence, GQA without repeating K/V."""

from __future__ import annotations

import itertools

from runtime.model.eager_attention import causal_attention


def packed_causal_attention(cu_seqlens: list[int]):
    """An attention callback for ``runtime.model.layers.Batch``: tokens of sequence i are rows
    cu_seqlens[i]:cu_seqlens[i+1] of q, k, v."""

    def attention(index, q, k, v, latent):
        out = q.new_empty(q.shape)
        scale = q.shape[-1] ** -0.5
        for start, stop in itertools.pairwise(cu_seqlens):
            out[start:stop] = causal_attention(
                q[start:stop], k[start:stop], v[start:stop], 0, scale
            )
        return out

    return attention
