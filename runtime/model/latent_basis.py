"""A basis for k's latent in which rebuilding the keys is mostly a copy.

A decomposed k projection W_k = D_k·U_k (D_k [in, r], U_k [r, out]) is one of many
factor pairs: for any invertible S [r, r], (D_k·S)·(S⁻¹·U_k) is the same product. Take
S = r of U_k's own columns: then S⁻¹·U_k holds those columns as the identity, and the
latent z' = x·D_k·S *is* those columns of the pre-RoPE key. A latent KV cache decodes by
rebuilding every cached key at every step (z'·U'_k, then RoPE); in this basis the copied
columns cost nothing and the GEMM shrinks to the other out − r columns (none at full
rank, where the latent is the pre-RoPE key itself). The cache holds r elements per token
as before, and the product, hence every result, is unchanged up to rounding.

The copied columns are chosen so that the decode path can use them as they are:
- in whole RoPE pairs (``eager.rope_pair_order``), so that RoPE rotates them in place;
- in turn from each rank's heads (the ranks rebuild their own heads' keys), and ordered
  rank by rank, each rank's in its own pair order, so that the latent columns a rank
  copies are one contiguous range (``eager_attention.LatentFactors`` finds it);
- greedily by volume (pivoted Gram–Schmidt on pairs), so that S is well conditioned. A
  U_k that S would make ill conditioned keeps its factors.

v's factors take a copy basis too, for another reason: decode never rebuilds the
values (softmax·z_v is multiplied by U_v per KV head, ``eager_attention``), but each
query head mixes every latent column its KV head's U_v rows reach. With S = whole KV
heads' columns of U_v (in turn from each rank's heads, while one fits; then the
columns least in the span of those, as many as r needs), such a head's U_v rows are its
own head_dim latent columns and the identity: its query heads mix head_dim columns of
z_v instead of r_v (``latent_scores.value_rows``), and at full rank every head does, as
with a dense cache (cpu-135m: 64 of 192).
"""

from __future__ import annotations

from itertools import chain, zip_longest

import torch

from dsl.plan import LayerPlan
from runtime.kernels.eager import rope_pair_order
from runtime.model.shard import DictSource, FactorSource

# The largest |entry| of S⁻¹·U_k for which the basis is changed: each rebuilt key column
# sums latent columns times these entries, so their rounding grows with them (the greedy
# choice keeps them near 1–3 on random and SVD factors; an ill-conditioned S would not).
MAX_ENTRY = 64.0


def copies_usable(head_dim: int, qk_norm: bool) -> bool:
    """Whether decode can take key columns from the latent as they are: whole RoPE pairs
    need an even head_dim, and a per-head k norm needs each head's columns together
    (decode keeps them head by head there). Elsewhere the factors are left as stored."""
    return head_dim % 2 == 0 and not qk_norm


def rank_pairs(
    groups: tuple[tuple[int, int], ...], head_dim: int, rope_style: str
) -> list[list[tuple[int, int]]]:
    """Per group (a rank's columns [start, stop)), its RoPE pairs of U_k's columns in the
    decode layout's order: head by head, each head's pairs in ``rope_pair_order``."""
    order = rope_pair_order(head_dim, rope_style).tolist()
    pairs = []
    for start, stop in groups:
        pairs.append(
            [
                (head + order[i], head + order[i + 1])
                for head in range(start, stop, head_dim)
                for i in range(0, head_dim - 1, 2)  # no RoPE, odd head_dim: one unpaired
            ]
        )
    return pairs


def _choose(u: torch.Tensor, pairs: list[list[tuple[int, int]]]) -> list[list[int]] | None:
    """Indices into each group's pairs: r // 2 pairs taken in turn from the group with the
    fewest so far, each the one whose columns, less their projection on the span of the
    pairs taken before, span the largest area; None where U_k's columns do not span r
    dimensions.

    The residual columns are never formed: with Q an orthonormal basis of the span taken
    so far, a new basis vector q is orthogonal to Q, so q·(a − QQᵀa) = q·a, and each
    step updates every column's squared residual norm and every pair's residual dot
    product from one product qᵀU of the fixed U (0.14 s against 0.35 s for updating a
    residual matrix, at Llama-3-70B's r_k = 614 over 8 ranks' 1024 columns)."""
    r = u.shape[0]
    a_cols = torch.tensor([a for group in pairs for a, _ in group])  # every group's pairs
    b_cols = torch.tensor([b for group in pairs for _, b in group])  # one after another
    starts = [0]
    for group in pairs:
        starts.append(starts[-1] + len(group))
    norms = (u * u).sum(0)  # per column: squared norm of its residual
    cross = (u[:, a_cols] * u[:, b_cols]).sum(0)  # per pair: its residual columns' dot
    scale = float(norms.max())
    q = torch.zeros(r, r, dtype=u.dtype)  # orthonormal basis of the span taken, by column
    taken: list[list[int]] = [[] for _ in pairs]
    for step in range(r // 2):
        g = min(
            (g for g in range(len(pairs)) if len(taken[g]) < len(pairs[g])),
            key=lambda g: len(taken[g]),
        )
        lo, hi = starts[g], starts[g + 1]
        area = norms[a_cols[lo:hi]] * norms[b_cols[lo:hi]] - cross[lo:hi] ** 2
        area[taken[g]] = -1.0
        best = int(area.argmax())
        if area[best] <= 1e-20 * scale * scale:
            return None
        taken[g].append(best)
        done = q[:, : 2 * step]
        for j, column in enumerate((int(a_cols[lo + best]), int(b_cols[lo + best]))):
            v = u[:, column]
            for _ in range(2):  # Gram–Schmidt twice keeps q orthonormal in float64
                v = v - done @ (done.t() @ v)
                if j:
                    v = v - q[:, 2 * step] * (q[:, 2 * step] @ v)
            q[:, 2 * step + j] = v / v.norm()
        proj = q[:, 2 * step : 2 * step + 2].t() @ u  # [2, out]
        norms -= (proj * proj).sum(0)
        cross -= (proj[:, a_cols] * proj[:, b_cols]).sum(0)
    return taken


def basis_columns(
    u: torch.Tensor, groups: tuple[tuple[int, int], ...], head_dim: int, rope_style: str
) -> list[int] | None:
    """The r columns of u [r, out] that ``copy_basis`` makes S of: whole RoPE pairs shared
    out over the ranks (``_choose``), and for odd r one more, the column least in the
    span of the others; None where r > out, r < 2 or U_k spans fewer than r dimensions."""
    r, out = u.shape
    if r > out or r < 2:
        return None
    u64 = u.double()
    pairs = rank_pairs(groups, head_dim, rope_style)
    taken = _choose(u64, pairs)
    if taken is None:
        return None
    columns = [c for g, chosen in enumerate(taken) for i in sorted(chosen) for c in pairs[g][i]]
    return _extended(u64, columns, r)  # for odd r one more, least in the span of the others


def copy_basis(
    d: torch.Tensor,
    u: torch.Tensor,
    groups: tuple[tuple[int, int], ...],
    head_dim: int,
    rope_style: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(D_k·S, S⁻¹·U_k) for d [in, r], u [r, out], with S the chosen columns of u (see the
    module); None where there is no such basis (r > out, U_k of lower rank, entries
    of S⁻¹·U_k over ``MAX_ENTRY``): the factors stay as they are."""
    columns = basis_columns(u, groups, head_dim, rope_style)
    return None if columns is None else in_basis(d, u, columns)


def in_basis(
    d: torch.Tensor, u: torch.Tensor, columns: list[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(D·S, S⁻¹·U) with S = u's ``columns`` (S⁻¹·U's there set to the identity
    exactly); None where S⁻¹·U has an entry over ``MAX_ENTRY`` (or S is singular)."""
    u64 = u.double()
    r = u.shape[0]
    s = u64[:, columns]
    u_new, info = torch.linalg.solve_ex(s, u64)
    if int(info) or not bool(u_new.abs().max() <= MAX_ENTRY):  # NaN too
        return None
    u_new[:, columns] = torch.eye(r, dtype=torch.float64)
    return (d.double() @ s).to(d.dtype), u_new.to(u.dtype)


def value_columns(
    u: torch.Tensor, groups: tuple[tuple[int, int], ...], head_dim: int
) -> list[int] | None:
    """The r columns of U_v [r, out] that v's S is made of: whole KV heads (each head's
    columns in order), a head from each group (rank) in turn while one more fits, then
    the r − taken columns left (``_extended``); None where no head fits whole (r <
    head_dim), r > out, or U_v's columns do not span r dimensions."""
    r, out = u.shape
    if r > out or r < head_dim:
        return None
    starts = [range(lo, hi - head_dim + 1, head_dim) for lo, hi in groups]
    turns = [h for h in chain.from_iterable(zip_longest(*starts)) if h is not None]
    heads = turns[: r // head_dim]
    return _extended(u.double(), [c for h in heads for c in range(h, h + head_dim)], r)


def _extended(u64: torch.Tensor, columns: list[int], r: int) -> list[int] | None:
    """``columns`` of u64 [r, out] and r − len(columns) more, each the one least in the
    span of those before it (pivoted Gram–Schmidt, the residuals' norms updated from one
    product per column as in ``_choose``); None where they span fewer than r dimensions."""
    q, tri = torch.linalg.qr(u64[:, columns])
    scale = float((u64 * u64).sum(0).max())
    if bool((tri.diagonal().abs() <= 1e-10 * scale**0.5).any()):
        return None
    norms = (u64 * u64).sum(0) - ((q.t() @ u64) ** 2).sum(0)  # residuals' squared norms
    columns = list(columns)
    while len(columns) < r:
        norms[columns] = -1.0
        best = int(norms.argmax())
        if norms[best] <= 1e-20 * scale:
            return None
        v = u64[:, best]
        for _ in range(2):  # Gram–Schmidt twice keeps q orthonormal in float64
            v = v - q @ (q.t() @ v)
        v = v / v.norm()
        q = torch.cat([q, v[:, None]], 1)
        norms -= (v @ u64) ** 2
        columns.append(best)
    return columns


class CopyBasisSource:
    """A ``FactorSource`` that hands out k's and v's factors in their copy bases (where
    one exists) and every other tensor as ``source`` has it."""

    def __init__(
        self, source: FactorSource, plan: LayerPlan, head_dim: int, rope_style: str
    ) -> None:
        self.source = source
        choose = {  # each projection's columns of S
            "k": lambda u, groups: basis_columns(u, groups, head_dim, rope_style),
            "v": lambda u, groups: value_columns(u, groups, head_dim),
        }
        changed: dict[str, torch.Tensor] = {}
        for name, columns_of in choose.items():
            d, u = source.factor(f"{name}.v", "", 0, 0), source.factor(f"{name}.u", "", 0, 0)
            # ranks that share heads (fewer KV heads than ranks) share a group
            groups = tuple(dict.fromkeys(plan.factor(f"{name}.u").ranges))
            if any(stop > u.shape[1] or (stop - start) % head_dim for start, stop in groups):
                groups = ((0, u.shape[1]),)
            columns = columns_of(u, groups)
            basis = None if columns is None else in_basis(d, u, columns)
            if basis is not None:
                changed |= {f"{name}.v": basis[0], f"{name}.u": basis[1]}
        self.changed = DictSource(changed)

    def factor(self, tensor: str, split: str, start: int, stop: int) -> torch.Tensor:
        if tensor not in self.changed.full:
            return self.source.factor(tensor, split, start, stop)
        return self.changed.factor(tensor, split, start, stop)


def latent_layout(
    u_k: torch.Tensor, kv_heads: int, order: torch.Tensor, copies_allowed: bool = True
) -> tuple[int, int, torch.Tensor]:
    """(copy_from, copies, layout) of U_k [r_k, kv_heads · head_dim]: the key columns
    in pair order (``order``: ``eager.rope_pair_order``), head by head, except that the
    RoPE pairs whose two columns are U_k's identity columns of latent columns
    copy_from, copy_from + 1, .. (``runtime.model.latent_basis`` makes them) come first;
    ``copies`` of them (0: none, where they are not one such range or not
    ``copies_allowed``: ``latent_basis.copies_usable``)."""
    head_dim = order.numel()
    pairs = (torch.arange(kv_heads, device=order.device)[:, None] * head_dim + order).flatten()
    plain = (0, 0, pairs)
    if not copies_allowed:
        return plain
    unit = ((u_k != 0).sum(0) == 1) & (u_k.amax(0) == 1)
    source = u_k.argmax(0)
    a, b = pairs.view(-1, 2).unbind(1)
    copied = unit[a] & unit[b] & (source[b] == source[a] + 1)
    copy_columns = pairs.view(-1, 2)[copied].flatten()
    if copy_columns.numel() == 0:
        return plain
    sources = source[copy_columns]
    first = int(sources[0])
    if not torch.equal(sources, torch.arange(first, first + len(sources), device=order.device)):
        return plain
    rest = pairs.view(-1, 2)[~copied].flatten()
    return first, copy_columns.numel(), torch.cat([copy_columns, rest])
