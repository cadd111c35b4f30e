"""Rotary-embedding frequencies (with the spec's scaling), shared by every layer."""

from __future__ import annotations

import math

import torch

from dsl.spec import Positions


def inv_freq(positions: Positions, head_dim: int) -> torch.Tensor:
    """fp32 [head_dim / 2] inverse frequencies, scaled as transformers does."""
    freq = 1.0 / (positions.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    s = positions.scaling
    if s is None:
        return freq.float()
    if s.type == "linear":
        return (freq / s.factor).float()
    # llama3: long wavelengths scaled by factor, short ones kept, smooth in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()
