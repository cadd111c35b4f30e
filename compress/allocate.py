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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import yaml

Key = tuple[int, str]  # (layer, matrix)


@dataclass(frozen=True)
class Allocation:
    ranks: dict[Key, int]
    budget: int  # parameters the uniform ranks used
    used: int  # parameters the allocated ranks use


def uniform_budget(ranks: dict[Key, int], shapes: dict[str, tuple[int, int]]) -> int:
    return sum(r * sum(shapes[m]) for (_, m), r in ranks.items())


def allocate_ranks(
    spectra: dict[Key, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    budget: int,
    multiple: int = 1,
    weights: dict[Key, float] | None = None,
) -> Allocation:
    """Ranks (multiples of ``multiple``, at least ``multiple``, at most min(in, out))
    whose parameters r·(in+out) sum to at most ``budget``. ``weights`` (default 1)
    scale each matrix's savings: how much a unit of its relative error costs."""
    ranks = {key: multiple for key in spectra}
    used = sum(multiple * sum(shapes[m]) for (_, m) in spectra)
    if used > budget:
        raise ValueError(f"budget {budget} is below the minimum ranks' {used} parameters")
    scores, owners, costs = [], [], []
    for key, sigma in spectra.items():
        energy = sigma.double() ** 2
        share = energy / energy.sum().clamp_min(1e-300)
        if weights is not None:
            share = share * weights[key]
        n_in, n_out = shapes[key[1]]
        top = min(n_in, n_out) // multiple * multiple
        # unit u covers directions u·multiple .. (u+1)·multiple - 1; the first is given
        units = share[:top].reshape(-1, multiple).sum(1)[1:]
        cost = multiple * (n_in + n_out)
        scores.append(units / cost)
        owners += [key] * len(units)
        costs += [cost] * len(units)
    order = torch.argsort(torch.cat(scores), descending=True, stable=True).tolist()
    for index in order:
        if used + costs[index] <= budget:
            ranks[owners[index]] += multiple
            used += costs[index]
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
