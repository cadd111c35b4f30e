"""The paged KV cache of one rank and the host-side plan that lets latent decode run
with fixed buffers (docs/METHOD.md, "Latent decode that a CUDA graph can replay")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.plan import LayerPlan
from runtime.model.paged_cache import LayerCache


def bytes_per_block(
    plans: list[LayerPlan], kinds: list[str], block_size: int, dtype_bytes: int
) -> int:
    total = 0
    for lp, kind in zip(plans, kinds, strict=True):
        per_token = lp.kv_latent_per_rank if kind == "latent" else lp.kv_dense_per_rank
        total += per_token * block_size * dtype_bytes
    return total


def allocate(
    plans: list[LayerPlan],
    kinds: list[str],
    num_blocks: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[LayerCache]:
    caches = []
    for lp, kind in zip(plans, kinds, strict=True):
        if kind == "latent":
            shape = (num_blocks + 1, block_size, lp.kv_latent_per_rank)
            caches.append(
                LayerCache("latent", latent=torch.zeros(shape, dtype=dtype, device=device))
            )
        else:
            kv = lp.kv_dense_per_rank // (2 * head_dim)
            shape = (num_blocks + 1, block_size, kv, head_dim)
            caches.append(
                LayerCache(
                    "dense",
                    k=torch.zeros(shape, dtype=dtype, device=device),
                    v=torch.zeros(shape, dtype=dtype, device=device),
                )
            )
    return caches


@dataclass(frozen=True)
class Compaction:
    """What the copy kernel and the attention over the compact buffer need.

    copy_list [max_runs, 3] (src block, dst block, count) and num_runs [1]; remap
    [batch, max_blocks]: the compact blocks of each sequence in order; positions
    [max_rows]: the true position of each compact row; n_rows [1]: valid rows."""

    copy_list: torch.Tensor
    num_runs: torch.Tensor
    remap: torch.Tensor
    positions: torch.Tensor
    n_rows: torch.Tensor


def plan_compaction(
    block_tables: list[list[int]],
    seq_lens: list[int],
    block_size: int,
    max_blocks: int,
    max_compact_blocks: int,
    batch_rows: int,
) -> Compaction:
    """Scan the batch's block tables (host side): each (physical block, logical index)
    gets one compact block, shared blocks included, and runs of consecutive physical
    blocks that land on consecutive compact blocks become one copy."""
    assigned: dict[tuple[int, int], int] = {}
    order: list[tuple[int, int]] = []  # (physical, logical) per compact block
    remap = torch.zeros(batch_rows, max_blocks, dtype=torch.int32)
    for b, (table, length) in enumerate(zip(block_tables, seq_lens, strict=True)):
        for i in range(-(-length // block_size)):
            key = (table[i], i)
            if key not in assigned:
                assigned[key] = len(order)
                order.append(key)
            remap[b, i] = assigned[key]
    if len(order) > max_compact_blocks:
        raise ValueError(
            f"batch needs {len(order)} compact blocks, buffer has {max_compact_blocks}"
        )
    runs: list[list[int]] = []
    for c, (phys, _) in enumerate(order):
        if runs and runs[-1][0] + runs[-1][2] == phys and runs[-1][1] + runs[-1][2] == c:
            runs[-1][2] += 1
        else:
            runs.append([phys, c, 1])
    copy_list = torch.zeros(max_compact_blocks, 3, dtype=torch.int32)
    if runs:
        copy_list[: len(runs)] = torch.tensor(runs, dtype=torch.int32)
    positions = torch.zeros(max_compact_blocks * block_size, dtype=torch.int32)
    for c, (_, logical) in enumerate(order):
        positions[c * block_size : (c + 1) * block_size] = torch.arange(
            logical * block_size, (logical + 1) * block_size, dtype=torch.int32
        )
    return Compaction(
        copy_list=copy_list,
        num_runs=torch.tensor([len(runs)], dtype=torch.int32),
        remap=remap,
        positions=positions,
        n_rows=torch.tensor([len(order) * block_size], dtype=torch.int32),
    )
