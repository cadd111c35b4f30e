"""The search space of meta-parameters per kernel family, pruned by shape and by the
device's shared memory."""

from __future__ import annotations

import itertools

from tune.store import clamp_meta, next_pow2, normalise_device_name

TUNABLE_FAMILIES = ("down_proj", "latent_up", "gemm_fixed")
BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (32, 64, 128, 256)
BLOCK_K = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)

# Shared memory per block (bytes, opt-in maximum) by normalised device name; the
# default is the 99 KiB of the smallest current parts (sm_86/sm_89).
SHARED_MEMORY = {
    "NVIDIA_H200": 232448,
    "NVIDIA_H100": 232448,
    "NVIDIA_A100": 166912,
    "NVIDIA_A800": 166912,
    "NVIDIA_RTX_A6000": 101376,
    "NVIDIA_L40S": 101376,
}
DEFAULT_SHARED_MEMORY = 101376


def shared_memory_limit(device: str | None) -> int:
    return SHARED_MEMORY.get(normalise_device_name(device or ""), DEFAULT_SHARED_MEMORY)


def shared_memory_bytes(meta: dict[str, int], dtype_bytes: int) -> int:
    """Pipelined A and B tiles: num_stages · (BM·BK + BK·BN) elements."""
    m, n, k = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    return meta["num_stages"] * (m * k + k * n) * dtype_bytes


def search_space(
    n: int, k: int, rows: int, device: str | None, dtype_bytes: int = 2
) -> list[dict[str, int]]:
    """Candidates for an [rows, k] · [k, n] tile loop: no block larger than the padded
    dimension (BLOCK_M by the row bucket), within the device's shared memory."""
    limit = shared_memory_limit(device)
    max_m = max(16, next_pow2(rows))
    seen, out = set(), []
    for bm, bn, bk, warps, stages in itertools.product(
        BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES
    ):
        if bm > max_m:
            continue
        meta = clamp_meta(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages},
            n,
            k,
        )
        key = tuple(meta.values())
        if key in seen or shared_memory_bytes(meta, dtype_bytes) > limit:
            continue
        seen.add(key)
        out.append(meta)
    return out
