"""Every generated kernel family against its plain-torch reference (TRITON_INTERPRET=1),
in fp32 and fp16, over hypothesis-generated specs and shapes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from codegen.families import down_proj, gemm_fixed, kv_copy, latent_up, paged_attention, rope
from runtime.kernels import pick_config, reference
from tests.kernel_utils import assert_close, context, import_kernel
from tests.strategies import spec_dicts
from tune.store import choose

DTYPES = st.sampled_from([torch.float32, torch.float16])


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _shapes(kernel_files) -> list[tuple[str, object]]:
    """Every (group, layer shape) entry of the generated files, with a name for messages."""
    return [
        (f"{kf.file_name} {key}", entry)
        for kf in kernel_files
        for key, entry in import_kernel(kf).SHAPES.items()
    ]


@given(spec_dicts(), st.integers(1, 40), DTYPES, st.integers(0, 2**31 - 1))
def test_down_proj_matches_reference(raw, m, dtype, seed):
    files = down_proj.generate(context(raw))
    for name, shape in _shapes(files):
        k, w = shape.in_features, shape.width
        x = _randn(m, k, dtype=dtype, seed=seed)
        weight = _randn(k, w, dtype=dtype, seed=seed + 1) / math.sqrt(k)
        nw = _randn(k, dtype=dtype, seed=seed + 2)
        nb = _randn(k, dtype=dtype, seed=seed + 3) if files[0].values["norm"] == "layer" else None
        got = shape.down_proj(x, weight, torch.empty(m, w, dtype=dtype), nw, nb)
        want = shape.torch_reference(x, weight, torch.empty(m, w, dtype=torch.float32), nw, nb)
        assert_close(got, want, dtype, name)


def test_down_proj_without_norm_weight_is_plain_norm():
    raw = {
        "model": {
            "family": "llama",
            "hidden_size": 40,
            "intermediate_size": 24,
            "num_layers": 1,
            "num_heads": 2,
            "vocab_size": 8,
            "max_position_embeddings": 16,
        },
        "decomposition": {"ranks": {n: 7 for n in ("q", "k", "v", "o", "gate", "up", "down")}},
    }
    shape = import_kernel(down_proj.generate(context(raw))[0]).SHAPES[("attn", "s0")]
    x, w = torch.randn(5, 40) * 3 + 1, torch.randn(40, 21)
    got = shape.down_proj(x, w, torch.empty(5, 21))
    want = (x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()) @ w  # independent RMSNorm
    assert_close(got, want, torch.float32)


@given(spec_dicts(), st.integers(1, 24), DTYPES, st.integers(0, 2**31 - 1))
def test_latent_up_chunks_sum_to_gather_then_gemm(raw, m, dtype, seed):
    ctx = context(raw)
    for name, shape in _shapes(latent_up.generate(ctx)):
        chunk, tp, ranks = shape.chunk, ctx.tp, shape.ranks
        widths = shape.out_widths[: len(ranks)]
        us = tuple(
            _randn(r, n, dtype=dtype, seed=seed + i) / math.sqrt(r)
            for i, (r, n) in enumerate(zip(ranks, widths, strict=True))
        )
        latent = _randn(m, chunk * tp, dtype=dtype, seed=seed + 7)
        latent[:, sum(ranks) :] = 0  # padding columns carry zeros
        accs = tuple(torch.zeros(m, n) for n in widths)
        ref_accs = tuple(torch.zeros(m, n) for n in widths)
        for j in range(tp):
            piece = latent[:, j * chunk : (j + 1) * chunk]  # a strided view, like a real chunk
            shape.latent_up_chunk(piece, j, us, accs)
            shape.torch_reference(piece, j, us, ref_accs)
        want = reference.latent_up_gathered(latent, us, ranks)
        for got, ref, w in zip(accs, ref_accs, want, strict=True):
            assert_close(got, w, dtype, name)
            assert_close(ref, w, torch.float32, "reference")


@given(
    st.integers(1, 70),
    st.integers(1, 70),
    st.integers(1, 200),
    st.integers(0, 200),
    DTYPES,
    st.integers(0, 2**31 - 1),
)
def test_gemm_fixed_respects_n_valid(k, n, rows, n_valid, dtype, seed):
    n_valid = min(n_valid, rows)
    choice = choose("gemm_fixed", f"k{k}_n{n}", n, k, None, (1,))
    kf = gemm_fixed.kernel_file({(k, n): ["test"]}, choices={(k, n): choice})
    mod = import_kernel(kf)
    a = _randn(rows, k, dtype=dtype, seed=seed) / math.sqrt(k)
    b = _randn(k, n, dtype=dtype, seed=seed + 1)
    sentinel = -12345.0
    out = torch.full((rows, n), sentinel, dtype=dtype)
    counter = torch.zeros(1, dtype=torch.int32)
    mod.gemm_fixed(a, b, out, torch.tensor([n_valid], dtype=torch.int32), counter)
    assert_close(out[:n_valid], a[:n_valid].float() @ b.float(), dtype)
    assert (out[n_valid:] == sentinel).all(), "rows past n_valid were written"
    meta = pick_config(mod.CONFIGS[(k, n)], rows)
    tiles_n = -(-n // meta["BLOCK_N"])
    assert counter.item() == -(-n_valid // meta["BLOCK_M"]) * tiles_n  # cost follows n_valid
    ref = torch.full((rows, n), sentinel, dtype=dtype)
    mod.torch_reference(a, b, ref, torch.tensor([n_valid], dtype=torch.int32))
    assert_close(out, ref, dtype)


# --- KV block copy --------------------------------------------------------------------

COPY_CASES = {
    "single block": ([(5, 0, 1)], 1),
    "all contiguous": ([(2, 0, 6)], 1),
    "all scattered": ([(7, 0, 1), (1, 1, 1), (4, 2, 1), (9, 3, 1)], 4),
    "shared by two sequences": ([(3, 0, 2), (3, 2, 2), (8, 4, 1)], 3),
}


def _copy_kernel(width: int, block_size: int):
    """The block copy of ``width`` from a file serving it and two other widths."""
    module = import_kernel(kv_copy.copy_kernel_file([width + 5, width, 3], block_size))
    return module.WIDTHS[width]


@pytest.mark.parametrize("case", list(COPY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_block_copy_cases(case, dtype):
    runs, n_runs = COPY_CASES[case]
    width, block_size, max_runs = 13, 4, 6
    mod = _copy_kernel(width, block_size)
    src = torch.randn(12, block_size, width).to(dtype)
    copy_list = torch.zeros(max_runs, 3, dtype=torch.int32)
    copy_list[: len(runs)] = torch.tensor(runs, dtype=torch.int32)
    copy_list[len(runs) :] = torch.tensor([0, 0, 5])  # garbage past num_runs must be ignored
    dst = torch.full((8, block_size, width), 7.0, dtype=dtype)
    mod.kv_block_copy(src, dst, copy_list, torch.tensor([n_runs], dtype=torch.int32))
    expected = torch.full_like(dst, 7.0)
    for s, d, n in runs[:n_runs]:
        expected[d : d + n] = src[s : s + n]
    assert torch.equal(dst, expected)
    ref = torch.full_like(dst, 7.0)
    mod.torch_reference(src, ref, copy_list, torch.tensor([n_runs], dtype=torch.int32))
    assert torch.equal(ref, expected)


@given(
    st.integers(1, 40),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.lists(st.integers(1, 3), min_size=1, max_size=5),
    st.integers(0, 2**31 - 1),
)
def test_kv_block_copy_random_runs(width, block_size, lengths, seed):
    mod = _copy_kernel(width, block_size)
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(20, block_size, width, generator=g)
    runs, d = [], 0
    for n in lengths:
        s = int(torch.randint(0, 20 - n + 1, (1,), generator=g))
        runs.append((s, d, n))
        d += n
    copy_list = torch.tensor(runs, dtype=torch.int32)
    dst = torch.zeros(d + 2, block_size, width)
    ref = torch.zeros_like(dst)
    n_runs = torch.tensor([len(runs)], dtype=torch.int32)
    mod.kv_block_copy(src, dst, copy_list, n_runs)
    mod.torch_reference(src, ref, copy_list, n_runs)
    assert torch.equal(dst, ref)


# --- RoPE ------------------------------------------------------------------------------


def _rope_kernel(heads: int, head_dim: int, style: str):
    return import_kernel(rope.rope_kernel_file(heads, head_dim, style))


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, style: str):
    """Independent oracle: rotation as complex multiplication."""
    xf = x.double()
    half = x.shape[-1] // 2
    if style == "neox":
        c = torch.complex(xf[..., :half], xf[..., half:])
    else:
        c = torch.complex(xf[..., 0::2], xf[..., 1::2])
    rot = torch.polar(torch.ones_like(inv_freq.double()), pos.double()[:, None] * inv_freq.double())
    r = c * rot[:, None, :]
    if style == "neox":
        return torch.cat([r.real, r.imag], -1)
    return torch.stack([r.real, r.imag], -1).flatten(-2)


@given(
    st.integers(1, 5),
    st.sampled_from([2, 4, 6, 8, 16, 20]),
    st.sampled_from(["neox", "gptj"]),
    st.integers(1, 40),
    st.integers(0, 40),
    DTYPES,
    st.integers(0, 2**31 - 1),
)
def test_rope_matches_reference_and_complex_rotation(heads, d, style, rows, n_valid, dtype, seed):
    n_valid = min(n_valid, rows)
    mod = _rope_kernel(heads, d, style)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, d, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (rows,), generator=g, dtype=torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    got = x.clone()
    mod.rope_inplace(got, pos, inv_freq, torch.tensor([n_valid], dtype=torch.int32))
    ref = x.clone()
    mod.torch_reference(ref, pos, inv_freq, torch.tensor([n_valid], dtype=torch.int32))
    assert_close(got[:n_valid], _rope_complex(x[:n_valid], pos[:n_valid], inv_freq, style), dtype)
    assert torch.equal(got[n_valid:], x[n_valid:])
    assert_close(ref, got, dtype)


# --- paged decode attention -----------------------------------------------------------


def _attention_kernel(heads, kv_heads, d, block_size):
    return import_kernel(paged_attention.kernel_file(heads, kv_heads, d, block_size))


@given(
    st.sampled_from([(1, 1), (4, 4), (4, 2), (6, 1), (8, 2)]),
    st.sampled_from([4, 6, 16]),
    st.sampled_from([1, 2, 4, 16]),
    st.lists(st.integers(0, 40), min_size=1, max_size=4),
    DTYPES,
    st.integers(0, 2**31 - 1),
)
def test_paged_attention_matches_contiguous_attention(heads_kv, d, block_size, lens, dtype, seed):
    heads, kv_heads = heads_kv
    mod = _attention_kernel(heads, kv_heads, d, block_size)
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(lens) // block_size))
    num_blocks = len(lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # non-contiguous tables
    table = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    mod.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, out)
    ref = torch.empty(len(lens), heads, d)
    mod.torch_reference(q, k_cache, v_cache, table, seq_lens, ref)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b].float(), torch.zeros(heads, d))
            continue
        k = (
            k_cache[table[b].long()]
            .flatten(0, 1)[:n]
            .float()
            .repeat_interleave(heads // kv_heads, dim=1)
        )
        v = (
            v_cache[table[b].long()]
            .flatten(0, 1)[:n]
            .float()
            .repeat_interleave(heads // kv_heads, dim=1)
        )
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b].float()[:, None, :], k.transpose(0, 1), v.transpose(0, 1)
        )[:, 0, :]
        assert_close(out[b], want, dtype, f"sequence {b}")
        assert_close(ref[b], want, torch.float32, "reference")
