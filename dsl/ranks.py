"""Rank rules: turn a compression ratio into a rank for an (in, out) matrix.

``ratio`` is the fraction of the matrix that is removed (0.4 = "40% compression").

* ``smaller_dim_fraction`` — the paper's rule: keep ``(1 - ratio)`` of the smaller
  dimension, rounded to the nearest multiple of ``rank_multiple``. With multiple 2
  it gives the paper's ranks for LLaMA-3-70B at 40%: 0.6·8192 = 4915.2 → 4916 and
  0.6·1024 = 614.4 → 614 (no single plain rounding gives both).
* ``param_count`` — keep ``(1 - ratio)`` of the parameters:
  r·(in + out) ≈ (1 - ratio)·in·out, rounded down to a multiple of ``rank_multiple``.
"""

from __future__ import annotations

import math

RULES = ("smaller_dim_fraction", "param_count")


def rank_from_ratio(rule: str, ratio: float, shape: tuple[int, int], multiple: int = 1) -> int:
    """Rank of an (in, out) matrix under ``rule`` at ``ratio``; at least ``multiple``."""
    n_in, n_out = shape
    keep = 1.0 - ratio
    if rule == "smaller_dim_fraction":
        exact = keep * min(n_in, n_out)
        # Round half up on the multiple grid; math.floor(x + 0.5) avoids banker's rounding.
        rank = multiple * math.floor(exact / multiple + 0.5)
    elif rule == "param_count":
        exact = keep * n_in * n_out / (n_in + n_out)
        rank = multiple * math.floor(exact / multiple)
    else:
        raise ValueError(f"unknown rank rule {rule!r}; expected one of {', '.join(RULES)}")
    return max(multiple, min(rank, min(n_in, n_out)))
