"""What the native latent attention reads that stays from call to call, laid out and
checked once (``runtime.kernels.latent_scores``): a layer's operands (``LatentLayer``)
and a decode step's tokens (``LatentStep``), each with the C descriptor the call takes;
and the checks of a call's operands, each as one boolean for the call and by name for
the error message where one does not hold."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


class _LayerDescriptor(ctypes.Structure):
    """``latent_layer_t`` of the C file."""

    _fields_ = [
        ("key_dims", ctypes.c_void_p),
        ("key_heads", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("width", "r_k", "r_v", "copy_from", "copies")),
        ("u", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("upad", "wpad", "kv_heads")),
        ("u_v", ctypes.c_void_p),
        ("value_rows", ctypes.c_void_p),
        ("bias_v", ctypes.c_void_p),
    ]


class _StepDescriptor(ctypes.Structure):
    """``latent_step_t`` of the C file."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("new_slots", "slots", "lengths")]
    _fields_ += [(name, ctypes.c_int64) for name in ("batch", "length")]


@dataclass(frozen=True)
class LatentLayer:
    """A layer's operands of ``latent_attention`` that stay from step to step, laid out
    and checked once (``LatentScoresLibrary.layer``): the keys are z_k's columns
    ``copied`` (first, count), then row[:r_k] · u_rest [r_k, upad]; each key column's dim
    and KV head (int64 [width]); U_v per KV head [kv_heads, r_v, d] and its bias
    [kv_heads · d] or None; ``wpad``: the key columns padded (the RoPE tables' width);
    ``value_rows`` (int64 [kv_heads, 2]): per KV head (first, count), the rows of its U_v
    that are not zero, hence the only z_v columns its query heads mix (one whole head's
    in the copy basis of ``runtime.model.latent_basis``: a third of r_v at full rank).
    Holds the C descriptor (``address``), which points into these tensors."""

    r_k: int
    copied: tuple[int, int]
    u_rest: torch.Tensor
    dims: torch.Tensor
    heads: torch.Tensor
    u_v: torch.Tensor
    bias_v: torch.Tensor | None
    wpad: int
    value_rows: torch.Tensor

    def __post_init__(self) -> None:
        (first, copies), (kv_heads, r_v, _) = self.copied, self.u_v.shape
        described = _LayerDescriptor(
            self.dims.data_ptr(), self.heads.data_ptr(), self.dims.numel(), self.r_k, r_v,
            first, copies, self.u_rest.data_ptr(), self.u_rest.shape[1], self.wpad, kv_heads,
            self.u_v.data_ptr(), self.value_rows.data_ptr(),
            None if self.bias_v is None else self.bias_v.data_ptr(),
        )  # fmt: skip
        object.__setattr__(self, "descriptor", described)
        object.__setattr__(self, "address", ctypes.addressof(described))


@dataclass(frozen=True)
class LatentStep:
    """A decode step's tokens as ``latent_attention`` reads them, the same in every
    layer, checked once per step: sequence b's new latent goes to cache row
    ``new_slots`` [B][b], its first ``lengths`` [B][b] tokens are at rows ``slots`` [B,
    L][b] (int64). Holds the C descriptor (``address``); the slots' range is checked
    against each layer's cache by the call."""

    new_slots: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor

    def __post_init__(self) -> None:
        (batch, length), index = self.slots.shape, (self.new_slots, self.slots, self.lengths)
        checks = {
            "contiguous int64 slots [B, L], new slots and lengths [B]": all(
                t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu"
                for t in index
            )
            and self.new_slots.shape == (batch,) == self.lengths.shape,
        }
        check("latent attention", checks)
        pointers = (t.data_ptr() for t in index)
        described = _StepDescriptor(*pointers, batch, length)
        object.__setattr__(self, "descriptor", described)
        object.__setattr__(self, "address", ctypes.addressof(described))


def call_fits(q, latents, rows, layer: LatentLayer, step: LatentStep, tables) -> bool:
    """``attention``'s checks as one boolean (``call_checks`` names them)."""
    batch, u_v = step.slots.shape[0], layer.u_v
    return (
        q.dtype == latents.dtype == torch.float32
        and q.dim() == 3
        and q.is_contiguous()
        and q.shape[0] == batch
        and latents.shape == (batch, layer.r_k + u_v.shape[1])
        and latents.stride(1) == 1
        and cache_fits(rows, layer, step, tables, q.shape[1], q.shape[2])
    )


def call_checks(q, latents, rows, layer: LatentLayer, step: LatentStep, tables) -> dict:
    """``attention``'s checks by name, for its message."""
    batch, u_v = step.slots.shape[0], layer.u_v
    return {
        "fp32 q and new latents": q.dtype == latents.dtype == torch.float32,
        "contiguous q [B, H, d]": q.is_contiguous() and q.dim() == 3 and q.shape[0] == batch,
        "row-contiguous new latents [B, r_k + r_v]": latents.shape
        == (batch, layer.r_k + u_v.shape[1])
        and latents.stride(1) == 1,
    } | cache_checks(rows, layer, step, tables, q.shape[-2], q.shape[-1])


def cache_fits(
    rows: torch.Tensor,
    layer: LatentLayer,
    step: LatentStep,
    tables: tuple[torch.Tensor, torch.Tensor],
    heads: int,
    d: int,
) -> bool:
    """Whether ``latent_attention`` takes a layer's cache ``rows``, the keys' ``tables``
    at ``step``'s length and queries of ``heads`` heads of ``d`` (``cache_checks``
    names the checks, for a message)."""
    (cos, sin), length, u_v = tables, step.slots.shape[1], layer.u_v
    return (
        rows.dtype == cos.dtype == sin.dtype == torch.float32
        and heads % u_v.shape[0] == 0
        and d == u_v.shape[2]
        and rows.dim() == 2
        and rows.shape[1] == layer.r_k + u_v.shape[1]
        and rows.stride(1) == 1
        and rows.is_cpu
        and cos.shape == sin.shape
        and cos.shape[0] >= length
        and cos.shape[1] == layer.wpad
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def cache_checks(
    rows: torch.Tensor,
    layer: LatentLayer,
    step: LatentStep,
    tables: tuple[torch.Tensor, torch.Tensor],
    heads: int,
    d: int,
) -> dict[str, bool]:
    """``cache_fits``' checks by name."""
    (cos, sin), length, u_v = tables, step.slots.shape[1], layer.u_v
    return {
        "fp32 cache rows and tables": rows.dtype == cos.dtype == sin.dtype == torch.float32,
        "whole KV head groups of head_dim": heads % u_v.shape[0] == 0 and d == u_v.shape[2],
        "cache rows of r_k + r_v": rows.dim() == 2 and rows.shape[-1] == layer.r_k + u_v.shape[1],
        "row-contiguous cache rows on the CPU": rows.stride(-1) == 1 and rows.is_cpu,
        "contiguous tables [≥ L, wpad]": cos.shape == sin.shape
        and cos.shape[0] >= length
        and cos.shape[1] == layer.wpad
        and cos.is_contiguous()
        and sin.is_contiguous(),
    }


def check(what: str, checks: dict[str, bool]) -> None:
    """A ValueError naming each check of ``checks`` that does not hold."""
    wrong = [name for name, holds in checks.items() if not holds]
    if wrong:
        raise ValueError(f"{what}: need {', '.join(wrong)}")


def row_checks(rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, r_k: int):
    return {
        "row-contiguous cache rows [slots, ·] on the CPU": rows.dim() == 2
        and rows.stride(1) == 1
        and rows.device.type == "cpu",
        "rows of at least r_k": rows.shape[-1] >= r_k,
        "int64 slots [B, L]": slots.dtype == torch.int64 and slots.dim() == 2,
        "one length per sequence": lengths.shape == slots.shape[:1],
    }
