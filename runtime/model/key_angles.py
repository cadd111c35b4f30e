"""The RoPE angles of a latent layer's key pairs, kept between decode steps.

A latent decode step rebuilds every cached key and rotates it at its position. Decode
lays a layer's key pairs out in its own order (``LatentFactors.layout``), so each pair's
angle is gathered from the frequencies: ``rotation[:, idx]`` over the step's positions,
in every layer of every step. A profile on an AMD EPYC VM put that gather at 3.5 ms of
a latent step (cpu-135m at 40%, batch 8, context 256); with this table the step was
0.970x and 0.936x in two one-process runs of 96 steps alternated with an engine that
gathers (greedy tokens the same). Positions only grow, so the table is made once and
grown ``GROWTH`` positions at a time.

Its memory: 8 bytes per key pair and position, as much as one sequence's fp32 keys of
this rank at the longest context seen; the native kernel's real tables (cos and sin per
key column) twice that (a latent cache saves (r_k + r_v) against 2·KV·D values per token
of every sequence in the pool).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.eager import rope_rotation, rope_tables_of

# positions added per growth: the table is remade ~max_seq_len / GROWTH times in all
GROWTH = 256


class KeyAngles:
    """e^(i·position·frequency[index[j]]) [positions, len(index)] (complex64) for
    positions 0..length-1; or, for the native kernel, as real tables (``tables``). Each
    form is made on first use: a layer keeps only the one its decode reads."""

    def __init__(self, inv_freq: torch.Tensor, index: torch.Tensor) -> None:
        self.inv_freq, self.index = inv_freq, index
        self.table = torch.empty(0, index.numel(), dtype=torch.complex64, device=index.device)
        self.real: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rotation(self, length: int) -> torch.Tensor:
        rows = -(-length // GROWTH) * GROWTH
        return rope_rotation(torch.arange(rows, device=self.index.device), self.inv_freq)[
            :, self.index
        ]

    def __call__(self, length: int) -> torch.Tensor:
        if self.table.shape[0] < length:
            self.table = self._rotation(length)
        return self.table[:length]

    def tables(self, length: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [≥ length, width] (fp32): pair j's angle at columns 2j and
        2j + 1, so that rotating x is x·cos + swap(x)·sin; zero past 2·len(index)."""
        if self.real is None or self.real[0].shape[0] < length or self.real[0].shape[1] != width:
            # gptj's tables: each pair's two columns side by side, as the layout has them
            cos, sin = rope_tables_of(self._rotation(length), "gptj")
            pad = (0, width - cos.shape[1])
            self.real = (F.pad(cos, pad), F.pad(sin, pad))
        return self.real
