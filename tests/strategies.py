"""Hypothesis strategies for valid specs (as YAML-ready dicts)."""

from __future__ import annotations

from hypothesis import strategies as st

from dsl.spec import GLU_MATRICES, PLAIN_MATRICES


def matrix_limits(model: dict) -> dict[str, int]:
    """min(in, out) of every projection of a model mapping (spec field names)."""
    h, m = model["hidden_size"], model["intermediate_size"]
    d = model.get("head_dim") or h // model["num_heads"]
    hq, hkv = model["num_heads"] * d, model["num_kv_heads"] * d
    return {
        "q": min(h, hq),
        "k": min(h, hkv),
        "v": min(h, hkv),
        "o": min(h, hq),
        "gate": min(h, m),
        "up": min(h, m),
        "down": min(h, m),
        "fc1": min(h, m),
        "fc2": min(h, m),
    }


@st.composite
def rank_maps(draw, model: dict, allow_dense: bool = True, partial: bool = False) -> dict:
    names = GLU_MATRICES if model["family"] != "opt" else PLAIN_MATRICES
    limits = matrix_limits(model)
    out = {}
    for name in names:
        if partial and draw(st.booleans()):
            continue
        if allow_dense and draw(st.integers(0, 7)) == 0:
            out[name] = "dense"
        else:
            out[name] = draw(st.integers(1, limits[name]))
    return out


@st.composite
def spec_dicts(draw, max_tp: int = 4) -> dict:
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3", "opt"]))
    kv_heads = draw(st.sampled_from([1, 2, 3, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    model = {
        "family": family,
        "hidden_size": draw(st.integers(4, 48)),
        "intermediate_size": draw(st.integers(4, 80)),
        "num_layers": draw(st.integers(1, 4)),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": draw(st.integers(8, 64)),
        "max_position_embeddings": 64,
    }
    tps = [
        t
        for t in range(1, max_tp + 1)
        if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)
    ]
    tp = draw(st.sampled_from(tps))
    overrides = []
    for _ in range(draw(st.integers(0, 2))):
        layer = draw(st.integers(0, model["num_layers"] - 1))
        overrides.append({"layers": [layer], "ranks": draw(rank_maps(model, partial=True))})
    return {
        "name": "hypo",
        "model": model,
        "decomposition": {"ranks": draw(rank_maps(model)), "overrides": overrides},
        "parallel": {"tp": tp},
    }
