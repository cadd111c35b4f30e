"""``--fisher``: which output channels of each projection the model's loss depends on.

A truncation method minimises its own error ‖X·(W − D·U)‖ (svd-llm) with every output
channel counted alike, but the model's next-token loss is far more sensitive to some
channels than to others. To second order, an error Δy on the output y of a projection
raises the loss by about ½·Σⱼ Fⱼ·Δyⱼ² with Fⱼ = E[(∂L/∂yⱼ)²], the (diagonal) Fisher
information of that output channel (Fisher-weighted SVD, Hsu et al. 2022, weighted it
per weight; here per output channel, so it composes with svd-llm's whitening of the
input side). ``output_fisher`` measures Fⱼ with one backward pass of the dense model's
cross-entropy over the calibration sequences: for sequences the model sampled itself
(``self:N``) that is the true Fisher, for a text file the empirical one. Nothing is
trained: the gradients are read, never applied.

``column_scale`` turns it into the weight the truncation applies to each output column
(``compress.factorize.full_svd``): the SVD of M·diag(c) is truncated and c is divided
back out of U. A refit of U (``refit_up``) is unchanged by it (each output column is
its own least-squares problem), so the weighting chooses D: the subspace the latent
keeps.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from compress.calibration import by_length
from dsl.spec import ModelConfig
from runtime.model.checkpoint import names_for

Key = tuple[int, str]  # (layer, matrix)

# Sequences per backward pass (8 × 128 tokens of SmolLM2-135M: activations of ~1 GB, so
# the pass runs before the calibration statistics are held: ``compress.pipeline``).
BATCH = 8
# c = (F / mean F)^(POWER / 2): the squared error of column j weighted by (F_j / mean F)^POWER,
# the second-order estimate of the loss at POWER 1. Measured on SmolLM2-135M at a 30 %
# parameter cut (svd-llm, sequential, refit, allocated; self:64 × 128 calibration): mean
# KL 0.885 at POWER 0.5, 0.840 at 1, 0.954 at 2, and 0.986 without.
POWER = 1.0
# Channels whose Fisher is below this fraction of the mean still count a little: a
# channel no calibration token moved must not get an infinite 1/c in U.
FLOOR = 1e-6


def output_fisher(
    model, config: ModelConfig, sequences: list[list[int]], progress: bool = True
) -> dict[Key, torch.Tensor]:
    """Per decomposable projection of ``model`` (a dense transformers model, left
    unchanged): Σ over calibration tokens of (∂L/∂yⱼ)² for each output channel j (fp64),
    L the summed next-token cross-entropy of ``sequences``."""
    names = names_for(config)
    sums: dict[Key, torch.Tensor] = {}
    handles = []
    for i in range(config.num_layers):
        for m in config.matrices:
            module = model.get_submodule(names.layer(i, m))
            sums[(i, m)] = torch.zeros(module.out_features, dtype=torch.float64)

            def hook(module, grad_input, grad_output, key=(i, m)):
                g = grad_output[0]
                sums[key] += g.reshape(-1, g.shape[-1]).to(torch.float64).square().sum(0)

            handles.append(module.register_full_backward_hook(hook))
    # Gradients flow from the loss to every projection's output, never into a weight:
    # only the embeddings' output needs to require them for autograd to run at all.
    embeddings = model.get_input_embeddings()
    wanted = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        starts = range(0, len(sequences), BATCH)
        for start in tqdm(starts, desc="fisher", unit="batch", disable=not progress):
            _backward(model, embeddings, sequences[start : start + BATCH])
    finally:
        for h in handles:
            h.remove()
        for p, flag in wanted.items():
            p.requires_grad_(flag)
    return sums


def _backward(model, embeddings, batch: list[list[int]]) -> None:
    """One batch's loss backwards (sequences of one length run together)."""
    with torch.enable_grad():
        for group in by_length(batch):
            ids = torch.tensor(group)
            hidden = embeddings(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=hidden, use_cache=False).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                ids[:, 1:].reshape(-1),
                reduction="sum",
            )
            loss.backward()


def column_scale(fisher: torch.Tensor, power: float = POWER) -> torch.Tensor:
    """The factor c [out] each output column of the truncated matrix is multiplied by
    (fp64, mean-normalised Fisher to the power ``power / 2``)."""
    f = fisher.to(torch.float64)
    relative = f / f.mean().clamp_min(1e-300)
    return relative.clamp_min(FLOOR) ** (power / 2)
