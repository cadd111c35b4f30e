"""How one factor or one concatenation is laid out over ``tp`` ranks.

Index space conventions: a factor is in math layout (D: in × r, U: r × out,
W: in × out). A split along ``cols`` cuts the output dimension, along ``rows``
the contracting dimension. Ranges are in *padded* coordinates: a dimension of
length n is padded with zeros to ``ceil(n / tp) · tp`` and every rank gets
an equal slice, so the last rank(s) hold the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

COLS, ROWS, REPLICATED = "cols", "rows", "replicated"


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def even_ranges(n: int, tp: int) -> tuple[tuple[int, int], ...]:
    """Equal slices of ``n`` padded to a multiple of ``tp``."""
    width = pad_to(n, tp) // tp
    return tuple((i * width, (i + 1) * width) for i in range(tp))


def head_ranges(num_heads: int, head_dim: int, tp: int) -> tuple[tuple[int, int], ...]:
    """Columns of each rank's heads; fewer heads than ranks means each head is replicated
    on ``tp / num_heads`` consecutive ranks."""
    if num_heads >= tp:
        per = num_heads // tp
        return tuple((i * per * head_dim, (i + 1) * per * head_dim) for i in range(tp))
    group = tp // num_heads
    return tuple(((i // group) * head_dim, (i // group + 1) * head_dim) for i in range(tp))


@dataclass(frozen=True)
class FactorShard:
    """One factor matrix of one projection and the slice each rank holds.

    ``tensor`` is the checkpoint name stem (``q.u``, ``q.v``, ``o.weight``...);
    ``length`` the real length of the split dimension, ``padded`` its padded length.
    """

    tensor: str
    matrix: str
    factor: str  # "down" | "up" | "weight" (undecomposed)
    shape: tuple[int, int]  # math layout (in, out) of the whole factor
    split: str  # COLS | ROWS | REPLICATED
    ranges: tuple[tuple[int, int], ...]  # per rank, padded coordinates along ``split``

    @property
    def length(self) -> int:
        return {COLS: self.shape[1], ROWS: self.shape[0]}.get(self.split, 0)

    @property
    def padded(self) -> int:
        return max(stop for _, stop in self.ranges) if self.split != REPLICATED else 0

    def local_shape(self, rank: int) -> tuple[int, int]:
        """Shape of rank ``rank``'s slice, padding included."""
        start, stop = self.ranges[rank]
        rows, cols = self.shape
        if self.split == COLS:
            return rows, stop - start
        if self.split == ROWS:
            return stop - start, cols
        return rows, cols

    def real_range(self, rank: int) -> tuple[int, int]:
        """The slice of real (unpadded) indices on ``rank``; may be empty."""
        start, stop = self.ranges[rank]
        return min(start, self.length), min(stop, self.length)


@dataclass(frozen=True)
class Segment:
    """A run of concat columns on one rank: ``member`` rows [src_start, src_stop)
    of its factor land at local columns [dst_start, dst_start + width)."""

    member: str
    src_start: int
    src_stop: int
    dst_start: int

    @property
    def width(self) -> int:
        return self.src_stop - self.src_start


@dataclass(frozen=True)
class ConcatSplit:
    """Down factors concatenated along the rank dimension and split evenly by columns
    (DeInfer's "concat-split"): one all-gather then yields the full latent in the
    natural order ``[z_q | z_k | z_v]``. ``whole``: every rank holds the whole
    concatenation instead and computes the whole latent itself (no all-gather; the
    down factors' bytes on every rank)."""

    name: str  # "attn" | "mlp"
    members: tuple[tuple[str, int], ...]  # (matrix, rank) in concat order
    in_features: int
    tp: int
    whole: bool = False

    @property
    def length(self) -> int:
        return sum(r for _, r in self.members)

    @property
    def padded(self) -> int:
        return self.length if self.whole else pad_to(self.length, self.tp)

    @property
    def padding(self) -> int:
        return self.padded - self.length

    @property
    def width(self) -> int:
        """Columns per rank (padding included); the all-gather chunk size."""
        return self.padded if self.whole else self.padded // self.tp

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        if self.whole:
            return tuple((0, self.length) for _ in range(self.tp))
        return even_ranges(self.length, self.tp)

    def member_offset(self, member: str) -> int:
        offset = 0
        for name, rank in self.members:
            if name == member:
                return offset
            offset += rank
        raise KeyError(member)

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """Which member rows rank ``rank``'s columns hold; columns not covered are padding.

        The same table says, for all-gather chunk ``rank``, which rows of which up
        factor the chunk multiplies (the overlapped up-projection's split-K table).
        """
        start, stop = self.ranges[rank]
        out = []
        offset = 0
        for name, r in self.members:
            lo, hi = max(start, offset), min(stop, offset + r)
            if lo < hi:
                out.append(Segment(name, lo - offset, hi - offset, lo - start))
            offset += r
        return tuple(out)
