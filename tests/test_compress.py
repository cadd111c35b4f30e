"""Data-aware decomposition, importers and fidelity evaluation end to end on small
random transformers models: every checkpoint is checked by products (exact for the
importers) and by greedy tokens through the engine against transformers holding the
same products (fp32; the engine's tolerance is token equality)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from cli.main import main as cli
from compress.decompose import model_section
from dsl import load_spec
from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from runtime.model.checkpoint import CheckpointReader, validate
from runtime.tools.hf_reference import dense_state, load_transformers
from tests.hf_models import build_hf, decompose_with_cli

CONFIG = {
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8]]
RUNTIME = {"dtype": "float32", "max_batch_size": 4, "max_seq_len": 48, "block_size": 4}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compress") / "dense"
    build_hf("llama", CONFIG, seed=11).save_pretrained(folder)
    return folder


def _spec(
    folder: Path,
    path: Path,
    ratio: float,
    name: str = "tiny-compress",
    rule: str = "smaller_dim_fraction",
) -> Path:
    config = json.loads((folder / "config.json").read_text())
    raw = {
        "name": name,
        "model": model_section(config),
        "decomposition": {"ratio": ratio, "rule": rule},
        "parallel": {"tp": 2},
        "runtime": RUNTIME,
    }
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _greedy_equals_transformers(spec_path: Path, checkpoint: Path, tp: int, mode: str) -> None:
    spec = load_spec(spec_path)
    ref = load_transformers(spec, checkpoint)
    with torch.no_grad():
        want = [
            ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    with LLM(spec_path, checkpoint, tp=tp, mode=mode, kv_memory_bytes=1 << 20) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6))]
    assert got == want


@pytest.mark.parametrize(
    ("method", "calib", "tp", "mode"),
    [("svd-llm", "self:6", 2, "deinfer"), ("asvd", "text", 1, "base"), ("svd", None, 2, "dense")],
)
def test_decompose_methods_write_valid_checkpoints_served_like_transformers(
    dense, tmp_path, method, calib, tp, mode
):
    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.3)
    args = ["decompose", "--model", str(dense), "--spec", str(spec_path)]
    args += ["--out", str(tmp_path / "ck"), "--method", method, "--quiet", "--calib-len", "12"]
    if calib == "text":
        data = tmp_path / "calib.jsonl"  # this model has no tokenizer: ids as text fail
        data.write_text('{"text": "hello"}\n')
        assert cli([*args, "--calib", str(data)]) == 2  # needs a tokenizer: one-line error
        calib = "self:4"
    if calib:
        args += ["--calib", calib]
    assert cli(args) == 0
    spec = load_spec(spec_path)
    validate(CheckpointReader(tmp_path / "ck"), spec)
    record = json.loads((tmp_path / "ck" / "config.json").read_text())["deinfer"]
    assert record["method"] == method
    if calib:
        assert record["calibration"] == calib
        assert record["calibration_tokens"] == 12 * int(calib.removeprefix("self:"))
    _greedy_equals_transformers(spec_path, tmp_path / "ck", tp, mode)


def test_data_aware_methods_fit_the_calibration_outputs_better_than_plain_svd(dense, tmp_path):
    """On the calibration tokens, each svd-llm projection's output error is at most
    plain SVD's (it is the optimum in that norm)."""
    import transformers

    from compress.calibration import collect_input_stats, sample_sequences
    from compress.factorize import factorize

    spec = load_spec(_spec(dense, tmp_path / "spec.yaml", 0.5))
    model = transformers.AutoModelForCausalLM.from_pretrained(dense).eval()
    seqs = sample_sequences(model, 1, 8, 16, seed=0)
    assert seqs == sample_sequences(model, 1, 8, 16, seed=0)  # deterministic for a seed
    assert seqs != sample_sequences(model, 1, 8, 16, seed=1)
    stats = collect_input_stats(model, spec.model, seqs, progress=False)
    x_q = stats[(0, "q")]
    assert x_q.tokens == 8 * 16
    w = model.model.layers[0].self_attn.q_proj.weight.detach().double().t()
    r = spec.decomposition.layers[0].rank("q")
    gram = x_q.gram

    def err(d, u):
        e = w - d.double() @ u.double()
        return float(torch.einsum("ij,ik,kj->", e, gram, e))  # ‖X·E‖² = tr(EᵀGE)

    assert err(*factorize(w, r, "svd-llm", x_q)) < err(*factorize(w, r, "svd")) * 0.999


# --- importers -----------------------------------------------------------------------


def _factors(dense: Path, ratio: float):
    """Per projection: (module path, Vᵀ-like [r, in], U-like [out, r]) of a plain SVD."""
    from compress.factorize import factorize

    reader = CheckpointReader(dense)
    out = {}
    for name in reader.file_of:
        if name.endswith("_proj.weight"):
            w = reader.read(name).t()  # [in, out]
            r = max(1, round((1 - ratio) * min(w.shape)))
            d, u = factorize(w, r, "svd")
            out[name.removesuffix(".weight")] = (d.t().contiguous(), u.t().contiguous())
    return reader, out


def _write_layout(dense: Path, fmt: str, src: Path) -> dict[str, torch.Tensor]:
    """A checkpoint of the random model in ``fmt``'s published layout; returns each
    projection's product [out, in] for the round-trip check."""
    reader, factors = _factors(dense, 0.25)
    config = json.loads((dense / "config.json").read_text())
    tensors = {k: reader.read(k) for k in reader.file_of if not k.endswith("_proj.weight")}
    products = {}
    dense_kept = "model.layers.1.mlp.down_proj"  # one projection stays whole
    tensors[f"{dense_kept}.weight"] = reader.read(f"{dense_kept}.weight")
    products[dense_kept] = tensors[f"{dense_kept}.weight"]
    ranks: dict = {}
    for module, (vt, u) in factors.items():
        if module == dense_kept:
            continue
        parent, _, leaf = module.rpartition(".")
        if fmt == "svd-llm":
            stem = leaf.removesuffix("_proj")
            tensors[f"{parent}.{stem}_v_proj.weight"] = vt
            tensors[f"{parent}.{stem}_u_proj.weight"] = u
            products[module] = u @ vt
        elif fmt == "asvd":
            tensors[f"{module}.BLinear.weight"] = vt
            tensors[f"{module}.ALinear.weight"] = u
            ranks[module] = vt.shape[0]
            products[module] = u @ vt
        else:  # palu-headwise: k and v per head group, the rest whole
            if leaf not in ("k_proj", "v_proj"):
                tensors[f"{module}.weight"] = reader.read(f"{module}.weight")
                products[module] = tensors[f"{module}.weight"]
                continue
            w = reader.read(f"{module}.weight")  # [out, in]
            groups = w.split(CONFIG["head_dim"], dim=0)
            group_ranks = [3, 5][: len(groups)]
            vts, us = [], []
            for g, (wg, r) in enumerate(zip(groups, group_ranks, strict=True)):
                from compress.factorize import factorize

                d, uu = factorize(wg.t(), r, "svd")
                vts.append(d.t())
                tensors[f"{module}.U.{g}.weight"] = uu.t().contiguous()
                us.append(uu.t())
            tensors[f"{module}.VT.weight"] = torch.cat(vts).contiguous()
            ranks[module] = group_ranks
            products[module] = torch.block_diag(*us) @ torch.cat(vts)
    if fmt == "asvd":
        config["truncation_ranks"] = ranks
        config["architectures"] = ["ASVDLlamaForCausalLM"]
    if fmt == "palu-headwise":
        config["head_wise_ranks"] = ranks
        config["model_type"] = "palullama"
    src.mkdir(parents=True)
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(config))
    return products


@pytest.mark.parametrize("fmt", ["svd-llm", "asvd", "palu-headwise"])
def test_importers_round_trip_to_identical_products(dense, tmp_path, fmt):
    products = _write_layout(dense, fmt, tmp_path / "src")
    spec_path = tmp_path / "imported.yaml"
    args = ["import", "--format", fmt, str(tmp_path / "src"), "--out", str(tmp_path / "ck")]
    assert cli([*args, "--spec-out", str(spec_path)]) == 0
    spec = load_spec(spec_path)
    validate(CheckpointReader(tmp_path / "ck"), spec)
    state = dense_state(spec, tmp_path / "ck")
    for module, product in products.items():
        assert torch.equal(state[f"{module}.weight"], product) or torch.allclose(
            state[f"{module}.weight"], product, rtol=0, atol=1e-6
        ), module
    layer1 = spec.decomposition.layers[1]
    if fmt == "palu-headwise":
        assert layer1.rank("k") == 8 and layer1.rank("q") is None
    else:
        assert layer1.rank("down") is None and layer1.rank("q") == 24
    _greedy_equals_transformers(spec_path, tmp_path / "ck", 2, "deinfer")


class _Marker:
    """Unpickling this creates a file: proof that a pickle was (not) loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _one_line_error(capsys, args: list[str], *needles: str) -> None:
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err


def test_malformed_imports_fail_in_one_line_and_never_unpickle(dense, tmp_path, capsys):
    products = _write_layout(dense, "asvd", tmp_path / "asvd")
    assert products
    out = ["--out", str(tmp_path / "ck"), "--spec-out", str(tmp_path / "s.yaml")]
    # wrong layout: an ASVD folder read as Palu / SVD-LLM
    _one_line_error(
        capsys,
        ["import", "--format", "palu-headwise", str(tmp_path / "asvd"), *out],
        "head_wise_ranks",
    )
    _one_line_error(
        capsys, ["import", "--format", "svd-llm", str(tmp_path / "asvd"), *out], "missing tensor"
    )
    # missing ranks
    config = json.loads((tmp_path / "asvd" / "config.json").read_text())
    del config["truncation_ranks"]["model.layers.0.self_attn.q_proj"]
    (tmp_path / "asvd" / "config.json").write_text(json.dumps(config))
    _one_line_error(
        capsys,
        ["import", "--format", "asvd", str(tmp_path / "asvd"), *out],
        "truncation_ranks: missing model.layers.0.self_attn.q_proj",
    )
    # a pickle, as .bin and renamed .safetensors: refused, never loaded
    marker = tmp_path / "unpickled"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((dense / "config.json").read_text())
    (evil / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(marker)))
    _one_line_error(capsys, ["import", "--format", "svd-llm", str(evil), *out], "pickle")
    (evil / "pytorch_model.bin").rename(evil / "model.safetensors")
    _one_line_error(
        capsys, ["import", "--format", "svd-llm", str(evil), *out], "not a readable safetensors"
    )
    _one_line_error(
        capsys,
        ["import", "--format", "gguf", str(evil / "config.json"), "--out", str(tmp_path / "g")],
        "neither a GGUF file nor a wheel",
    )
    assert not marker.exists()
    assert not (tmp_path / "ck").exists() and not (tmp_path / "s.yaml").exists()


def test_bad_calibration_input_fails_in_one_line(dense, tmp_path, capsys):
    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.3)
    base = ["decompose", "--model", str(dense), "--spec", str(spec_path), "--out"]
    base += [str(tmp_path / "ck"), "--method", "svd-llm", "--quiet"]
    _one_line_error(capsys, base, "needs calibration data")
    _one_line_error(capsys, [*base, "--calib", "self:x"], "self:N")
    _one_line_error(capsys, [*base, "--calib", str(tmp_path / "none.txt")], "no such file")
    assert not (tmp_path / "ck").exists()


# --- fidelity --------------------------------------------------------------------------


def test_metrics_against_hand_computation():
    from compress.fidelity import divergence, perplexity

    p = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]]), -1)
    q = torch.log_softmax(torch.tensor([[1.0, 1.5, -1.0], [0.0, 2.0, 0.0]]), -1)
    kl, top1 = divergence([p], [q])
    want = float(sum((p[i].exp() * (p[i] - q[i])).sum() for i in range(2)) / 2)
    assert abs(kl - want) < 1e-6 and top1 == 0.5
    assert divergence([p], [p])[0] == 0.0
    # tokens [0, 1, 2]: position 0 predicts 1, position 1 predicts 2
    nll = -(float(p[0, 1]) + float(p[1, 2])) / 2
    assert abs(perplexity([[0, 1, 2]], [torch.cat([p, p[:1]])]) - torch.tensor(nll).exp()) < 1e-5


def test_score_equals_transformers_log_probabilities_at_tp2(dense, tmp_path):
    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.3)
    decompose_with_cli(dense, spec_path, tmp_path / "ck")
    spec = load_spec(spec_path)
    ref = load_transformers(spec, tmp_path / "ck")
    seq = [1, 4, 9, 16, 25, 36, 2, 3, 5, 7, 11, 13, 17]  # spans several blocks
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([seq])).logits[0], -1)
    for kv in ("dense", "latent"):
        with LLM(spec_path, tmp_path / "ck", tp=2, kv_cache=kv, prefill_chunk=5) as llm:
            got = llm.score(seq)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_eval_of_a_full_rank_checkpoint_matches_the_dense_model(dense, tmp_path):
    """At full rank the products are the dense weights: KL ≈ 0, top-1 = 1, same text."""
    from compress.fidelity import EvalConfig, dense_reference, evaluate

    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.0)
    decompose_with_cli(dense, spec_path, tmp_path / "ck")
    cfg = EvalConfig(self_samples=3, length=20, prompts=(), max_new_tokens=4)
    ref = dense_reference(dense, cfg)
    assert ref.sampled and ref.metrics["ppl_sampled"] > 1
    with LLM(spec_path, tmp_path / "ck", tp=1) as llm:
        metrics = evaluate(llm, ref, cfg)
    assert metrics["kl"] < 1e-6 and metrics["top1"] == 1.0
    assert abs(metrics["ppl_sampled"] - ref.metrics["ppl_sampled"]) < 1e-3


def test_deinfer_eval_cli_reports_a_full_rank_checkpoint_as_the_dense_model(
    dense, tmp_path, capsys
):
    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.0)
    args = ["decompose", "--model", str(dense), "--spec", str(spec_path), "--out"]
    assert cli([*args, str(tmp_path / "ck"), "--quiet"]) == 0
    capsys.readouterr()
    args = ["eval", "--checkpoint", str(tmp_path / "ck"), "--spec", str(spec_path)]
    args += ["--reference", str(dense), "--self", "2", "--len", "12", "--tp", "2"]
    assert cli([*args, "--mode", "base", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint"]["kl"] < 1e-6 and result["checkpoint"]["top1"] == 1.0
    assert cli(args) == 0
    text = capsys.readouterr().out
    assert "mean KL(dense || checkpoint)" in text and "top-1 agreement: 1.0000" in text
    _one_line_error(capsys, [*args, "--text", str(tmp_path / "x.txt")], "no tokenizer")
