"""Row buckets: the batch sizes meta-parameters are tuned for (and CUDA graphs
captured at); a launch takes the nearest one."""

from __future__ import annotations

from collections.abc import Iterable


def nearest_bucket(buckets: Iterable[int], rows: int) -> int:
    """The bucket closest to ``rows``; ties go to the larger one (a config tuned for
    more rows is the safer choice)."""
    return min(buckets, key=lambda b: (abs(b - rows), -b))
