"""A summand of the next norm still to be multiplied (``PendingUp``): across ranks a
low-rank row group's reduced latent and its up factor, which every rank holds whole;
the next half's native call multiplies it (``runtime.model.decode_block``), the ops that
add summands one by one take it multiplied (``summed``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels.decode_block import Projection, decode_block_library


@dataclass(frozen=True)
class PendingUp:
    """A summand of the next norm still to be multiplied: across ranks a low-rank row
    group's reduced latent [m, r] and its up factor (panels), which every rank holds
    whole. The next half's first call multiplies it (its ``after``), so the product takes
    no call of its own. cpu-demo at param_count 40 %, tp 2, batch 16 (AMD EPYC VM, one
    thread a rank): on rank 0 alone the Python between the all-reduce and that product's
    native call took 110-170 µs a row group (cold after the weights streamed through the
    caches), and the host time between a step's native calls fell from 7.4 to 4.9 ms;
    the two ranks behind an 8 Gbit/s emulated link, in lockstep with dense, layers' own
    compute over dense's 0.715-0.748 against 0.734-0.794 before (six repetitions each,
    processes alternated). Elsewhere ``summed`` multiplies it first."""

    latent: torch.Tensor
    up: Projection

    @property
    def operands(self) -> tuple[torch.Tensor, Projection]:
        """As a native call's ``after`` takes it."""
        return self.latent, self.up

    def product(self) -> torch.Tensor:
        return decode_block_library().norm_project(self.latent, [], None, self.up)


Summand = torch.Tensor | PendingUp


def summed(summands: list[Summand]) -> list[torch.Tensor]:
    """The summands as tensors (each ``PendingUp`` multiplied), for the ops that add them
    one by one."""
    return [s.product() if isinstance(s, PendingUp) else s for s in summands]


def apart(summands: list[Summand]) -> tuple[list[torch.Tensor], PendingUp | None]:
    """The tensors, and the one ``PendingUp`` among them (None if none)."""
    pending = [s for s in summands if isinstance(s, PendingUp)]
    if not pending:  # one rank, or a merged row: as they came
        return summands, None
    if len(pending) > 1:
        raise ValueError("decode block: one pending up product at a time")
    tensors = [s for s in summands if not isinstance(s, PendingUp)]
    return tensors, pending[0]
