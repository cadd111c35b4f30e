"""A decode step's layers in one native call (``decode_layers``, ``runtime.kernels.
decode_stack``) against the same layers' halves called one by one
(``DecodeBlockLibrary.attention`` and ``mlp``, which ``test_decode_block.py`` compares
with plain torch): over hypothesis-drawn layer counts, rows, heads, GQA groups, RoPE
styles and projections dense or low-rank with odd ranks, fp32 only. The same C calls in
the same order: x, the caches and the output bit-exact. And a whole model's decode steps
(``DecodeStack``) over a dense and a latent cache against its layers' own calls: the
same tokens and log-probabilities, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.generate import generate, write_atomically
from dsl import build_plan, parse_spec
from runtime.engine.config import EngineOptions, RunnerConfig, resolve
from runtime.engine.model_runner import ModelRunner, SeqInput
from runtime.engine.sequence import SamplingParams
from runtime.kernels import eager
from runtime.kernels.decode_block import decode_block_library
from runtime.kernels.decode_stack import (
    DenseOperands,
    StackLayer,
    StepTokens,
    decode_layers,
    layer_array,
)
from runtime.kernels.panel import panel_library
from runtime.model.decode_stack import DecodeStack
from tests.hf_models import TINY_LLAMA, TINY_RANKS, make_decomposed
from tests.test_decode_block import RANKS, _cache_slots, _projection
from tests.test_graph_safety import RUNTIME

pytestmark = pytest.mark.skipif(
    decode_block_library() is None or panel_library() is None,
    reason="no C compiler here: the decode block did not build",
)


def _layer(gen, hidden, heads, kv_heads, d, inter, ranks, cache_slots) -> StackLayer:
    q_ranks, o_ranks, mlp_ranks, down_ranks = ranks
    qkv, _ = _projection(gen, hidden, [heads * d, kv_heads * d, kv_heads * d], q_ranks)
    o, _ = _projection(gen, heads * d, [hidden], o_ranks and o_ranks[:1])
    gate_up, _ = _projection(gen, hidden, [inter, inter], mlp_ranks and mlp_ranks[:2])
    down, _ = _projection(gen, inter, [hidden], down_ranks and down_ranks[:1])
    norms = [1 + 0.1 * torch.randn(hidden, generator=gen) for _ in range(2)]
    rows = [torch.randn(cache_slots, kv_heads, d, generator=gen) for _ in range(2)]
    return StackLayer(norms[0], DenseOperands(qkv, o, *rows), norms[1], gate_up, inter, down)


@settings(max_examples=30, deadline=None)
@given(
    layers=st.integers(1, 3),
    m=st.integers(1, 18),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    half_dim=st.sampled_from([1, 3, 4, 8, 9]),
    hidden=st.integers(1, 40),
    inter=st.integers(1, 40),
    style=st.sampled_from(["neox", "gptj"]),
    ranks=st.tuples(RANKS, RANKS, RANKS, RANKS),
    seed=st.integers(0, 10_000),
)
def test_layers_in_one_call_equal_their_halves_one_by_one(
    layers, m, kv_heads, group, half_dim, hidden, inter, style, ranks, seed
):
    gen = torch.Generator().manual_seed(seed)
    d, heads = 2 * half_dim, kv_heads * group
    lengths, slots, new_slots, cache_slots = _cache_slots(gen, m)
    stack = [
        _layer(gen, hidden, heads, kv_heads, d, inter, ranks, cache_slots) for _ in range(layers)
    ]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = (t.contiguous() for t in eager.rope_tables(lengths - 1, inv_freq, style))
    rope, scale, eps = (cos, sin, half_dim if style == "neox" else 0), d**-0.5, 1e-5
    tokens = (new_slots, slots, lengths.long())
    x = torch.randn(m, hidden, generator=gen)
    caches = [(layer.attention.k_rows.clone(), layer.attention.v_rows.clone()) for layer in stack]

    # one by one: each half's output the next half's summand
    lib, x_want, summands = decode_block_library(), x.clone(), []
    for layer, (k_rows, v_rows) in zip(stack, caches, strict=True):
        a = layer.attention
        o = lib.attention(
            x_want, summands, (layer.input_norm, eps), a.qkv, (heads, kv_heads, d), rope,
            (k_rows, v_rows, *tokens), scale, a.o,
        )  # fmt: skip
        summands = [lib.mlp(x_want, [o], (layer.post_norm, eps), layer.gate_up, inter, layer.down)]

    step = StepTokens(tokens, None)
    out = decode_layers(lib, x, eps, layer_array(stack), (heads, kv_heads, d), rope, step, scale)
    assert torch.equal(x, x_want) and torch.equal(out, summands[0])
    for layer, (k_rows, v_rows) in zip(stack, caches, strict=True):
        a = layer.attention
        assert torch.equal(a.k_rows, k_rows) and torch.equal(a.v_rows, v_rows)


def test_operands_it_would_misread_are_refused():
    gen = torch.Generator().manual_seed(0)
    layer = _layer(gen, 8, 2, 1, 4, 8, (None,) * 4, 5)
    x, rope = torch.randn(2, 8), (torch.ones(2, 4), torch.zeros(2, 4), 2)
    index = (torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.ones(2))
    tokens = StepTokens(index, None)
    with pytest.raises(ValueError, match="int64 slots and lengths of 2 rows"):
        decode_layers(decode_block_library(), x, 1e-5, layer_array([layer]), (2, 1, 4), rope,
                      tokens, 0.5)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous fp32"):
        decode_layers(decode_block_library(), x.t(), 1e-5, layer_array([layer]), (2, 1, 4),
                      rope, tokens, 0.5)  # fmt: skip
    assert DecodeStack.of([]) is None and DecodeStack.of([None]) is None


@pytest.mark.parametrize("kv", ["dense", "latent"])
def test_a_models_decode_steps_in_one_call_equal_its_layers_calls(tmp_path, kv):
    spec_path, ckpt, _, _ = make_decomposed(tmp_path, "llama", TINY_LLAMA, TINY_RANKS, 1, RUNTIME)
    spec = parse_spec(spec_path.read_text(), "tiny-hf")
    write_atomically(generate(spec).files, tmp_path / "gen")

    def runner() -> ModelRunner:
        options = EngineOptions(path="dynamic", kv_cache=kv, cuda_graphs=False)
        facts = resolve(options, spec)
        plan = build_plan(spec, modes=("deinfer",), up_layout=facts.up_layout).modes["deinfer"]
        return ModelRunner(
            0, 1, RunnerConfig(spec, plan, str(tmp_path / "gen"), str(ckpt), 16, options, facts)
        )

    stacked, layered = runner(), runner()
    assert stacked.decode_stack_layers() == TINY_LLAMA["num_hidden_layers"]
    layered.model.decode_stack = None  # the same model, its layers called one by one
    params = SamplingParams(max_tokens=8, logprobs=3)
    prompts, tables = ([1, 2, 3, 4, 5], [6, 7]), ([3, 7, 9], [0, 1])
    got = {}
    for name, r in (("stacked", stacked), ("layered", layered)):
        pairs = enumerate(zip(prompts, tables, strict=True))
        seqs = [SeqInput(i, p, len(p), t, params) for i, (p, t) in pairs]
        steps = [r.step(seqs, True)]
        for _ in range(4):
            seqs = [
                SeqInput(s.id, [steps[-1].tokens[s.id]], s.length + 1, s.block_table, params)
                for s in seqs
            ]
            steps.append(r.step(seqs, False))
        got[name] = [(s.tokens, s.logprobs) for s in steps]
    assert stacked.model.decode_stack.described  # its decode steps ran as one call
    assert got["stacked"] == got["layered"]
