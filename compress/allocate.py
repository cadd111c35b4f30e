"""``--allocate``: per-matrix ranks that spend a global parameter budget where the
truncated spectrum, weighted by each matrix's measured sensitivity, says it matters most.

Each matrix m (shape in×out) offers its singular directions one by one (σ₁ ≥ σ₂ ≥ …
of the matrix its method truncates: W, the ASVD-scaled W, or the whitened SᵀW); keeping
direction j costs in+out parameters and saves w_m·σ_j² / Σσ², its share of the
matrix's (whitened) energy times the matrix's weight w_m (``compress.pipeline``
measures it: the model's KL per unit of dropped energy). Taking directions in order of
saving per parameter until the budget is spent is the greedy optimum of that linear
model of the loss, and keeps each matrix's directions a prefix (its savings only
decrease).

A matrix's rank stops at its break-even rank ⌊in·out / (in+out)⌋: beyond it the factors
would hold more parameters than the matrix. Once a matrix has every direction up to
there, it may instead be kept dense: the rest of its energy for the rest of its
parameters, offered no earlier than its own last direction so the choice stays a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import yaml

Key = tuple[int, str]  # (layer, matrix)


@dataclass(frozen=True)
class Allocation:
    ranks: dict[Key, int | None]  # None: the matrix is kept dense
    budget: int  # parameters the uniform ranks used
    used: int  # parameters the allocated ranks use


def uniform_budget(ranks: dict[Key, int | None], shapes: dict[str, tuple[int, int]]) -> int:
    """Parameters the ranks keep (a dense matrix: in·out)."""
    return sum(
        shapes[m][0] * shapes[m][1] if r is None else r * sum(shapes[m])
        for (_, m), r in ranks.items()
    )


def break_even_rank(n_in: int, n_out: int, multiple: int = 1) -> int:
    """The largest rank (a multiple of ``multiple``, at least one multiple) whose factors
    hold no more parameters than the in×out matrix."""
    return max(multiple, n_in * n_out // (n_in + n_out) // multiple * multiple)


def allocate_ranks(
    spectra: dict[Key, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    budget: int,
    multiple: int = 1,
    weights: dict[Key, float] | None = None,
) -> Allocation:
    """Ranks (multiples of ``multiple``, at least ``multiple``, at most the break-even
    rank; None: dense) whose parameters sum to at most ``budget``. ``weights`` (default
    1) scale each matrix's savings: how much a unit of its relative error costs."""
    ranks: dict[Key, int | None] = {key: multiple for key in spectra}
    used = sum(multiple * sum(shapes[m]) for (_, m) in spectra)
    if used > budget:
        raise ValueError(f"budget {budget} is below the minimum ranks' {used} parameters")
    scores, offers = [], []  # offer: (matrix, cost, whether it makes the matrix dense)
    tops: dict[Key, int] = {}
    for key, sigma in spectra.items():
        energy = sigma.double() ** 2
        share = energy / energy.sum().clamp_min(1e-300)
        if weights is not None:
            share = share * weights[key]
        n_in, n_out = shapes[key[1]]
        top = tops[key] = min(
            break_even_rank(n_in, n_out, multiple), len(share) // multiple * multiple
        )
        # unit u covers directions u·multiple .. (u+1)·multiple - 1; the first is given
        units = share[:top].reshape(-1, multiple).sum(1)[1:]
        cost = multiple * (n_in + n_out)
        unit_scores = units / cost
        # negative where even the least rank holds more than the matrix: dense then saves
        rest_cost = n_in * n_out - top * (n_in + n_out)
        dense_score = float(share[top:].sum()) / max(rest_cost, 1)
        if len(unit_scores):
            dense_score = min(dense_score, float(unit_scores[-1]))
        scores += [unit_scores, torch.tensor([dense_score], dtype=unit_scores.dtype)]
        offers += [(key, cost, False)] * len(units) + [(key, rest_cost, True)]
    order = torch.argsort(torch.cat(scores), descending=True, stable=True).tolist()
    for index in order:
        key, cost, dense = offers[index]
        if dense and ranks[key] != tops[key]:
            continue  # a direction of it did not fit: no jump to the whole matrix
        if ranks[key] is not None and used + cost <= budget:
            ranks[key] = None if dense else ranks[key] + multiple
            used += cost
    return Allocation(ranks, budget, used)


def allocated_spec_yaml(
    spec_text: str, name: str, layers: list[dict[str, int | None]], note: str
) -> str:
    """The spec of ``spec_text`` with explicit per-layer ranks (layer 0's as the
    defaults, every other layer that differs as an override) and a new name."""
    raw = yaml.safe_load(spec_text)
    raw["name"] = name
    defaults = layers[0]
    overrides = [
        {"layers": [i], "ranks": {m: ("dense" if r is None else r) for m, r in ranks.items()}}
        for i, ranks in enumerate(layers)
        if i and ranks != defaults
    ]
    raw["decomposition"] = {
        "ranks": {m: ("dense" if r is None else r) for m, r in defaults.items()},
        "overrides": overrides,
    }
    return f"# {note}\n" + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)
