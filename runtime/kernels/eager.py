"""Plain-torch kernels at the real shapes: the ``eager`` backend of the dynamic path.

Each function has the signature of the generated launcher and of its reference in
``runtime.kernels.reference``, and the same result. The difference is cost: a reference is
written for CUDA graphs (no host synchronisation, so counts in device memory become
masks over the whole static buffer), while these read the counts on the host and do
work only for rows, runs and positions that exist. That is free on a CPU, where host
and device are the same memory, and it is what the CPU path runs. An fp32 RMSNorm (also
fused with the residual add before it) and RoPE run as one native pass each
(``row_ops``) where it built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.kernels import reference
from runtime.kernels.reference import Segments, apply_norm
from runtime.kernels.row_ops import row_ops_library

# oneDNN's linear reads an [out, in] weight. Measured on an AMD EPYC (AVX2; 2 threads,
# the 30 layers of the 135M model, weights streamed from memory, median of 15
# interleaved runs): 84 ms at 16 rows against 121 ms for MKL through F.linear and 143 ms
# for ``a @ b`` with b [in, out]; 10 vs 17 ms for the 49152-row LM head at one row. So
# the dynamic path stores every matrix transposed and multiplies through it.
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_DTYPES = (torch.float32,) + (
    (torch.bfloat16,)
    if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # needs AVX-512 BF16/AMX
    else ()
)


def stored_transposed(b: torch.Tensor) -> bool:
    """b [in, out] is a view of a contiguous [out, in] tensor."""
    return b.dim() == 2 and b.stride(0) == 1 and b.stride(1) == b.shape[0]


# Between 16 and 64 rows, computing the product transposed, (W · aᵀ)ᵀ with W [out, in],
# was faster still there (same 30 layers: 63 vs 76 ms at 16 rows, 116 vs 127 at 32, 141
# vs 177 at 64; equal at 12, slower below). This is the untuned default; the runner
# replaces it with the forms it measures on the machine (``runtime.kernels.cpu_gemm``).
_TRANSPOSED_ROWS = range(16, 65)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., in] · b [in, out]; through oneDNN or a transposed product when b is
    stored transposed (the result may then be a transposed view)."""
    if a.device.type != "cpu" or a.dtype != b.dtype or not stored_transposed(b):
        return a @ b
    if a.dim() == 2 and a.shape[0] in _TRANSPOSED_ROWS:
        return transposed_product(a, b)
    return onednn_linear(a, b)


def transposed_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, in] · b [in, out] computed as (W · aᵀ)ᵀ, W = bᵀ; the result is a transposed view."""
    return torch.mm(b.t(), a.t()).t()


def onednn_linear(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b through oneDNN's linear (b stored transposed), where torch has it."""
    if _ONEDNN and a.dtype in ONEDNN_DTYPES:
        return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.t(), None, "none", [], "")
    return a @ b


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    norm: str,
    eps: float,
) -> torch.Tensor:
    """``reference.apply_norm`` in x's dtype: an fp32 RMSNorm of rows in one native pass
    (``row_ops``) where it built, else in five torch ops (F.rms_norm is not fused on a
    CPU in torch 2.13: measured here it took 113 µs for [16, 576] against 77 µs for
    these five ops)."""
    if norm != "rms" or x.dtype != torch.float32:
        return apply_norm(x, weight, bias, norm=norm, eps=eps).to(x.dtype)
    native = row_ops_library()
    y = None if native is None else native.rms_norm(x, weight, eps)
    if y is not None:
        return y
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def add_and_normalize(
    x: torch.Tensor,
    summands: list[torch.Tensor],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    norm: str,
    eps: float,
) -> torch.Tensor:
    """The residual stream between two blocks: x += summands[0] + summands[1] + ... in
    place (an all-reduce's tensors in rank order, ``Comm.summands``, or one tensor), and
    ``normalize`` of the new x. One native pass per row for an fp32 RMSNorm: after a
    step's products have streamed their weights through the caches, each separate op
    pays for cold data and cold code again (``row_ops``)."""
    native = row_ops_library()
    if native is not None and norm == "rms" and bias is None:
        y = native.add_rms_norm(x, [_unit_rows(p) for p in summands], weight, eps)
        if y is not None:
            return y
    add_summands(x, summands)
    return normalize(x, weight, bias, norm=norm, eps=eps)


def add_summands(x: torch.Tensor, summands: list[torch.Tensor]) -> torch.Tensor:
    """x += summands[0] + summands[1] + ... in place (summed in that order first, as an
    all-reduce does, so the result has the bits of ``x + all_reduce(...)``)."""
    native = row_ops_library()
    if native is not None:
        parts = [_unit_rows(p) for p in summands]
        if native.add_rms_norm(x, parts, None, 0.0, normalize=False) is not None:
            return x
    total = summands[0]
    if len(summands) > 1:
        total = torch.add(summands[0], summands[1])
        for part in summands[2:]:
            total.add_(part)
    return x.add_(total)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def down_proj(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    meta: dict | None = None,
    *,
    norm: str,
    eps: float,
    gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = matmul,
) -> torch.Tensor:
    """out = norm(x) · weight (``gemm``: the runner's tuned products)."""
    out.copy_(gemm(normalize(x, norm_weight, norm_bias, norm=norm, eps=eps), weight))
    return out


def latent_up_chunk(
    chunk: torch.Tensor,
    chunk_index: int,
    u_factors: tuple[torch.Tensor, ...],
    accumulators: tuple[torch.Tensor, ...],
    meta: dict | None = None,
    *,
    segments: Segments,
    gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = matmul,
) -> None:
    """accumulators[slot] += chunk[:, dst:dst+w] · U_slot[src:src+w] per segment."""
    for slot, (dst, src, width) in enumerate(segments[chunk_index]):
        if width:
            u = u_factors[slot][src : src + width]
            accumulators[slot].add_(gemm(chunk[:, dst : dst + width].to(u.dtype), u))


def gemm_fixed(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    n_valid: torch.Tensor,
    work_counter: torch.Tensor | None = None,
    meta: dict | None = None,
) -> torch.Tensor:
    """out[:n] = a[:n] · b, n = n_valid[0]; rows past n untouched."""
    n = int(n_valid[0])
    if a.dtype == b.dtype:
        out[:n] = matmul(a[:n], b)
    else:
        out[:n] = (a[:n].float() @ b.float()).to(out.dtype)
    return out


def rope_rotation(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """e^(i·position·frequency) [T, head_dim / 2], complex64: RoPE as one complex product
    over a tensor whose rotation pairs are adjacent (``rope_pair_order``)."""
    cos, sin = reference.rope_cos_sin(positions, inv_freq)
    return torch.complex(cos, sin)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, style: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [T, head_dim] laid out so that RoPE is x·cos + swap(x)·sin."""
    return rope_tables_of(rope_rotation(positions, inv_freq), style)


def rope_tables_of(rotation: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables`` from the angles of ``rope_rotation`` (computed once for both)."""
    cos, sin = rotation.real, rotation.imag
    if style == "neox":
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)


def rope_pair_order(head_dim: int, style: str) -> torch.Tensor:
    """The order of head_dim that puts each RoPE pair side by side: neox rotates i with
    i + head_dim/2, gptj 2i with 2i+1 (already adjacent); any other style (no RoPE):
    head_dim as it is."""
    if style != "neox":
        return torch.arange(head_dim)
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], -1).flatten()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """RoPE of x [..., head_dim] with tables from ``rope_tables`` broadcast to it, in fp32,
    the result in x's dtype: one native pass (``row_ops``) for fp32 x [T, heads, d] and
    tables [T, 1, d] where it built, else ``torch_rotate``."""
    native = row_ops_library()
    y = None if native is None else native.rotate(x, cos, sin, style)
    return torch_rotate(x, cos, sin, style) if y is None else y


def torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """``rotate`` in torch: four ops in fp32 (the pairs of a rotation are swapped by a
    roll or a flip)."""
    if style == "neox":
        swapped = x.roll(x.shape[-1] // 2, -1)
    else:
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    if x.dtype == torch.float32:
        return (x * cos).add_(swapped * sin)
    return (x.float() * cos + swapped.float() * sin).to(x.dtype)


def rope_inplace(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    style: str,
) -> torch.Tensor:
    """Rotate x[:n] [rows, heads, head_dim] in place at ``positions``."""
    n = int(n_valid[0])
    cos, sin = rope_tables(positions[:n], inv_freq, style)
    x[:n] = rotate(x[:n], cos[:, None, :], sin[:, None, :], style)
    return x


def kv_block_copy(
    src: torch.Tensor, dst: torch.Tensor, copy_list: torch.Tensor, num_runs: torch.Tensor
) -> torch.Tensor:
    """Copy the first num_runs[0] runs (src block, dst block, count) of ``copy_list``."""
    for s, d, n in copy_list[: int(num_runs[0])].tolist():
        dst[d : d + n] = src[s : s + n]
    return dst


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence against its keys, GQA without repeating K/V.

    q [B, H, D]; k, v [B, L, KVH, D]; valid bool [B, L], or already as attention
    broadcasts it, [B, 1, 1, L], bool or an additive mask (0 and -inf). The H / KVH
    query heads that share a KV head become that head's query rows, so the grouped
    scores are one batched matmul over the real K. Every sequence needs a valid key
    (else NaN)."""
    batch, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, kv_heads, heads // kv_heads, d)
    mask = valid if valid.dim() == 4 else valid[:, None, None, :]
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(batch, heads, -1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Like the reference, over the batch's longest sequence instead of every block."""
    lens = seq_lens.long()
    longest = int(lens.max()) if lens.numel() else 0
    if longest == 0:
        return out.zero_()
    blocks = -(-longest // k_cache.shape[1])
    table = block_table[:, :blocks].long()
    k = k_cache[table].flatten(1, 2)[:, :longest]
    v = v_cache[table].flatten(1, 2)[:, :longest]
    valid = torch.arange(longest, device=q.device)[None, :] < lens[:, None]
    out.copy_(grouped_attention(q, k, v, valid, scale).nan_to_num_(0.0).to(out.dtype))
    return out
