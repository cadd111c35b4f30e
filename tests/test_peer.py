"""The llama.cpp row of `deinfer bench` (``bench.peer``): the GGUF it writes holds the
engine's weights in llama.cpp's layout, its rows sit at the thread counts of the tp 1
engine rows, and every tp 1 row is set against the one of its thread count. The test
that loads the file into llama.cpp itself needs llama-cpp-python (marker ``peer``, not in
the default run: ``python -m pytest -m peer tests/test_peer.py``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import peer
from bench.config import BenchConfig
from bench.ratios import add_ratios
from bench.report import markdown
from bench.variants import variants_of
from dsl import load_spec
from dsl.errors import UserError
from runtime.kernels import eager
from tests.conftest import SPECS


def _with_model(spec, **changes):
    """The spec with model fields replaced (shapes for a small test model)."""
    return replace(spec, model=replace(spec.model, **changes))


@settings(max_examples=20, deadline=None)
@given(
    heads=st.integers(1, 4),
    half=st.integers(1, 8),
    inputs=st.integers(1, 9),
    position=st.integers(0, 500),
)
def test_reordered_rows_rotated_in_adjacent_pairs_equal_rotate_half_of_the_original(
    heads, half, inputs, position
):
    """llama.cpp rotates (2i, 2i + 1); transformers (i, i + d/2). A projection whose rows
    ``rope_pairs_adjacent`` reordered, rotated llama.cpp's way, gives the original's
    rotate-half result in the same reordered places (so q·k is unchanged)."""
    d = 2 * half
    gen = torch.Generator().manual_seed(heads * 1000 + d * 10 + inputs)
    weight = torch.randn(heads * d, inputs, generator=gen, dtype=torch.float64)
    x = torch.randn(inputs, generator=gen, dtype=torch.float64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    positions = torch.tensor([position])

    def rope(vec: torch.Tensor, style: str) -> torch.Tensor:
        cos, sin = eager.rope_tables(positions, inv_freq, style)
        return eager.torch_rotate(vec.reshape(1, heads, d), cos[:, None], sin[:, None], style)

    theirs = rope(peer.rope_pairs_adjacent(weight, heads) @ x, "gptj")
    ours = rope(weight @ x, "neox").reshape(heads * d, 1)
    assert torch.allclose(theirs.reshape(-1), peer.rope_pairs_adjacent(ours, heads).reshape(-1))


def test_the_gguf_holds_every_tensor_in_llama_cpps_names_and_counts_the_streamed_bytes(
    tmp_path,
):
    gguf = pytest.importorskip("gguf")  # a dependency of the [compress] extra
    spec = load_spec(SPECS / "cpu-135m.yaml")
    m = spec.model
    h, inter, vocab = 8, 12, 10
    spec = _with_model(
        spec,
        hidden_size=h,
        intermediate_size=inter,
        vocab_size=vocab,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    m = spec.model
    state = {
        "model.embed_tokens.weight": torch.randn(vocab, h),
        "model.norm.weight": torch.ones(h),
        "model.layers.0.input_layernorm.weight": torch.ones(h),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, h),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, h),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, h),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(h, 8),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(h),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(inter, h),
        "model.layers.0.mlp.up_proj.weight": torch.randn(inter, h),
        "model.layers.0.mlp.down_proj.weight": torch.randn(h, inter),
    }
    path = tmp_path / "m.gguf"
    streamed = peer.write_gguf(spec, state, path)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data).reshape(t.data.shape) for t in reader.tensors}
    assert set(tensors) == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.0.{n}" for n in peer._LAYER_NAMES.values()
    }
    assert streamed == sum(t.size * 4 for t in tensors.values())  # tied: the output too
    assert np.array_equal(
        tensors["blk.0.ffn_down.weight"], state["model.layers.0.mlp.down_proj.weight"]
    )
    q = peer.rope_pairs_adjacent(state["model.layers.0.self_attn.q_proj.weight"], m.num_heads)
    assert np.array_equal(tensors["blk.0.attn_q.weight"], q.numpy())
    assert reader.fields["tokenizer.ggml.model"].contents() == "none"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 1


def test_a_model_the_writer_does_not_cover_is_refused_by_name():
    spec = _with_model(load_spec(SPECS / "cpu-135m.yaml"), family="qwen3", qk_norm=True)
    with pytest.raises(UserError, match=r"llama\.cpp peer: model\.family"):
        peer.check_supported(spec)


def test_peer_rows_sit_at_each_tp1_thread_count_and_tp1_rows_are_set_against_theirs():
    cfg = BenchConfig(
        spec="specs/cpu-135m.yaml",
        modes=("dense",),
        tps=(1,),
        batches=(1,),
        tp1_threads=(1,),
        peer=True,
        hf=False,
    )
    labels = [v.label for v in variants_of(cfg)]
    assert labels == [
        "dense kv=dense tp1 b1",
        "dense kv=dense tp1 b1 threads=1",
        "llama.cpp tp1 b1",
        "llama.cpp tp1 b1 threads=1",
    ]

    def row(mode: str, threads: int | None, rates: list[float]) -> dict:
        return {
            "mode": mode,
            "kv_cache": "-" if mode == "llama.cpp" else "dense",
            "tp": 1,
            "ratio": None,
            "batch": 1,
            "max_seq_len": None,
            "threads": threads,
            "label": f"{mode} {threads}",
            "throughput": [{"decode_tokens_per_s": r, "output_tokens_per_s": r} for r in rates],
        }

    results = {
        "config": {
            "num_requests": 1,
            "max_batch": 1,
            "prompt_len": 4,
            "output_len": 4,
            "reps": 2,
            "spec": "s",
        },
        "machine": {"cpu": "c", "cores": 2, "gpu": None, "torch": "t", "triton": "t"},
        "variants": [
            row("dense", None, [30.0, 36.0]),
            row("dense", 1, [20.0, 22.0]),
            row("llama.cpp", None, [50.0, 48.0]),
            row("llama.cpp", 1, [25.0, 22.0]),
        ],
    }
    add_ratios(results)
    two, one = results["variants"][:2]
    assert two["decode_speedup_vs_peer"] == pytest.approx(33.0 / 49.0)
    assert two["decode_speedup_vs_peer_per_rep"]["min"] == pytest.approx(30.0 / 50.0)
    assert one["decode_speedup_vs_peer"] == pytest.approx(21.0 / 23.5)
    assert one["decode_speedup_vs_peer_per_rep"]["max"] == pytest.approx(1.0)
    table = markdown(results)
    assert "| vs llama.cpp |" in table and "0.67x (0.60–0.75)" in table


@pytest.mark.peer
def test_llama_cpp_reads_the_written_gguf_as_transformers_computes_the_checkpoint(tmp_path):
    """The weights written for llama.cpp are the checkpoint's: its logits of a prompt
    equal transformers' on the same products (llama.cpp keeps K and V in f16: 2e-2)."""
    assert peer.available(), "the peer tests need llama-cpp-python (pip install it)"
    from runtime.tools.hf_reference import dense_state, load_transformers
    from runtime.tools.random_checkpoint import write_random_checkpoint

    spec = load_spec(SPECS / "cpu-smoke.yaml")  # decomposed: transformers holds D·U
    write_random_checkpoint(spec, tmp_path / "ck", 0)
    streamed = peer.write_gguf(spec, dense_state(spec, tmp_path / "ck"), tmp_path / "m.gguf")
    prompt = [(7 * j) % 500 + 1 for j in range(24)]
    with torch.inference_mode():
        ref = load_transformers(spec, tmp_path / "ck")(torch.tensor([prompt])).logits[0]
    model = peer.LlamaCpp(tmp_path / "m.gguf", 2, 64, 2, streamed)
    try:
        got = torch.from_numpy(model.prompt_logits(prompt))
        assert torch.allclose(got, ref, atol=2e-2, rtol=0)
        tokens, times = model.generate([prompt, prompt[::-1]], 8)
        with torch.inference_mode():
            hf = load_transformers(spec, tmp_path / "ck")
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert tokens[0] == want[0, len(prompt) :].tolist()
        assert len(tokens[1]) == 8 and len(times) == 8
    finally:
        model.close()
