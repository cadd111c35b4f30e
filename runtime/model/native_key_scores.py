"""A latent layer's operands for the native latent scores (``runtime.kernels.
latent_scores``), laid out once: U_k's rebuilt columns padded to the kernel's vector
width, and the RoPE tables of the layout's pairs (kept between steps, ``KeyAngles``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.kernels.latent_operands import LatentLayer, LatentStep
from runtime.kernels.latent_scores import LatentScoresLibrary, latent_scores_library
from runtime.model.key_angles import KeyAngles


@dataclass(frozen=True)
class NativeKeyScores:
    library: LatentScoresLibrary
    r_k: int
    copied: tuple[int, int]  # (first, count): z_k's columns that are key columns
    u_rest: torch.Tensor  # [r_k, upad]: the other key columns' U_k, zero past them
    width: int  # key columns in all (copied and rebuilt)
    angles: KeyAngles  # one per layout pair
    layer: LatentLayer  # the same, with the key columns' dims and heads and U_v, checked

    def __call__(
        self, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor
    ) -> torch.Tensor:
        """Scores [B, H, L] (-inf past ``lengths``) of queries [B, H, width] (in the
        layout's column order) against the keys of the latents at cache rows ``slots``
        [B, L] of ``rows`` [slots, ≥ r_k] (read in place)."""
        wpad = self.library.padded(self.width)
        cos, sin = self.angles.tables(slots.shape[1], wpad)
        padded = F.pad(queries, (0, wpad - self.width))
        operands = (self.r_k, self.copied, self.u_rest, cos, sin, padded)
        return self.library.scores(rows, slots, lengths, *operands)

    def attention(
        self,
        q: torch.Tensor,
        latents: torch.Tensor,
        rows: torch.Tensor,
        step: LatentStep,
        scale: float,
    ) -> torch.Tensor:
        """The layer's decode attention [B, H, d] in one call (``LatentScoresLibrary.
        attention``): ``latents`` [B, r_k + r_v] written to ``rows`` at ``step``'s new
        slots, then queries q [B, H, d] against ``step``'s tokens."""
        tables = self.angles.tables(step.slots.shape[1], self.layer.wpad)
        return self.library.attention(q, latents, rows, self.layer, step, tables, scale)

    def values(
        self, probs: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """probs [B, H, L] · the same tokens' z_v (``rows``' columns r_k..) [B, H, r_v]."""
        return self.library.values(probs, rows, slots, lengths, self.r_k)


def native_key_scores(
    u_k_rest: torch.Tensor,
    copied: tuple[int, int],
    angles: KeyAngles | None,
    plain: bool,
    columns: tuple[torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor | None],
) -> NativeKeyScores | None:
    """The native form of a latent layer's scores, or None where the library did not
    build or the layer is one it does not take: ``u_k_rest`` [rest, r_k] (the rebuilt
    columns' U_k, ``LatentFactors.u_k_rest``) not fp32 on the CPU, no RoPE (``angles``
    None), or not ``plain`` (a bias or a norm on k). ``columns``: each key column's dim
    and KV head; ``values``: U_v per KV head [kv_heads, r_v, d] and its bias or None."""
    library = latent_scores_library()
    fp32_cpu = u_k_rest.dtype == torch.float32 and u_k_rest.device.type == "cpu"
    if library is None or angles is None or not plain or not fp32_cpu:
        return None
    rest, r_k = u_k_rest.shape
    upad = library.padded(rest)
    if copied[1] + upad > library.max_width:
        return None
    u_rest = torch.zeros(r_k, upad)
    u_rest[:, :rest] = u_k_rest.t()
    layer = library.layer(r_k, copied, u_rest, *columns, *values)
    return NativeKeyScores(library, r_k, copied, u_rest, copied[1] + rest, angles, layer)
