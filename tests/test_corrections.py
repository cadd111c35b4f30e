"""Training-free corrections of a decomposition: the up-factor refit, sequential
calibration and allocated ranks, each against an oracle computed another way, end to end
through the CLI and the engine against transformers (fp32; products to 1e-4 relative,
tokens equal), and the fidelity table that measures them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cli.main import main as cli
from compress.calibration import collect_input_stats, sample_sequences
from compress.factorize import InputStats, factorize, refit_up
from compress.report import Variant
from compress.sequential import sequential_factors
from dsl import load_spec
from dsl.errors import UserError
from runtime.model.checkpoint import CheckpointReader, names_for, validate
from tests.hf_models import build_hf
from tests.test_compress import CONFIG, _greedy_equals_transformers, _one_line_error, _spec


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sequential") / "dense"
    build_hf("llama", CONFIG, seed=11).save_pretrained(folder)
    return folder


def _model(dense):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(dense).eval()


def _output_error(w, d, u, stats: InputStats) -> float:
    """‖X·(W − D·U)‖² = tr(EᵀGE) on the calibration tokens."""
    e = w.double() - d.double() @ u.double()
    return float(torch.einsum("ij,ik,kj->", e, stats.gram, e))


def test_refit_keeps_svd_llm_optimal_and_improves_svd_and_asvd(dense, tmp_path):
    """svd-llm's U is already the least-squares U for its D (the refit returns it);
    svd's and asvd's are not, and the refit lowers their output error."""
    spec = load_spec(_spec(dense, tmp_path / "spec.yaml", 0.5))
    model = _model(dense)
    stats = collect_input_stats(
        model, spec.model, sample_sequences(model, 2, 8, 16, 0), progress=False
    )
    w = model.model.layers[0].mlp.down_proj.weight.detach().t()  # [40, 32]
    x = stats[(0, "down")]
    r = spec.decomposition.layers[0].rank("down")
    d, u = factorize(w, r, "svd-llm", x)
    assert torch.allclose(refit_up(d, w, x), u, rtol=1e-4, atol=1e-5)
    for method in ("svd", "asvd"):
        d, u = factorize(w, r, method, x)
        assert _output_error(w, d, refit_up(d, w, x), x) < 0.99 * _output_error(w, d, u, x)
    with pytest.raises(ValueError, match="Gram"):
        refit_up(d, w, InputStats(w.shape[0], gram=False))


def test_refit_is_the_least_squares_up_factor_for_the_dense_outputs():
    """min over U of ‖X·W − X'·D·U‖ against a direct solve on the activations; it beats
    the U that svd-llm on X' alone gives."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 24, generator=g, dtype=torch.float64)
    x_c = x + 0.3 * torch.randn(400, 24, generator=g, dtype=torch.float64)  # compressed
    w = torch.randn(24, 20, generator=g, dtype=torch.float64)
    paired, alone = InputStats(24, cross=True), InputStats(24)
    paired.add(x_c, x)
    alone.add(x_c)

    def err(m):
        return float((x @ w - x_c @ m).square().sum())

    for rank in (1, 5, 12):
        d, u = factorize(w, rank, "svd-llm", alone)
        best = torch.linalg.lstsq(x_c @ d.double(), x @ w).solution
        refitted = refit_up(d, w, paired).double()
        assert err(d.double() @ refitted) == pytest.approx(err(d.double() @ best), rel=1e-5)
        assert err(d.double() @ refitted) < err(d.double() @ u.double())
    with pytest.raises(ValueError, match="dense"):
        paired.add(x_c)  # paired statistics need the dense input too


def _inputs(model, module_name: str, seqs) -> torch.Tensor:
    seen = []
    handle = model.get_submodule(module_name).register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].reshape(-1, args[0].shape[-1]))
    )
    with torch.no_grad():
        for seq in seqs:
            model(torch.tensor([seq]))
    handle.remove()
    return torch.cat(seen)


def test_sequential_factors_come_from_the_compressed_model_below(dense, tmp_path):
    """Layer 0's q/k/v see the embeddings in both streams: the one-shot factors. Layer
    1's q sees what the already-compressed layer 0 produces: the oracle collects the
    inputs of a copy of the model whose layer 0 holds the sequential products."""
    spec = load_spec(_spec(dense, tmp_path / "spec.yaml", 0.5))
    model = _model(dense)
    seqs = sample_sequences(model, 3, 8, 16, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    made = sequential_factors(model, spec, seqs, "svd-llm", progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # untouched
    assert set(made) == {(i, m) for i in range(2) for m in spec.model.matrices}
    one_shot = collect_input_stats(model, spec.model, seqs, progress=False)
    names = names_for(spec.model)

    def product(factors):
        return factors[0] @ factors[1]

    def weight(m, layer):
        return layer.get_submodule(names.modules[m]).weight.detach().t()

    layer0 = model.model.layers[0]
    r = spec.decomposition.layers[0].rank("q")
    want = factorize(weight("q", layer0), r, "svd-llm", one_shot[(0, "q")])
    assert torch.allclose(product(made[(0, "q")]), product(want), rtol=1e-4, atol=1e-5)

    compressed = copy.deepcopy(model)
    for m in spec.model.matrices:
        module = compressed.model.layers[0].get_submodule(names.modules[m])
        module.weight.data = product(made[(0, m)]).t().contiguous()
    q1 = names.layer(1, "q")
    oracle = InputStats(spec.model.hidden_size)
    oracle.add(_inputs(compressed, q1, seqs))
    layer1 = model.model.layers[1]
    want = factorize(weight("q", layer1), r, "svd-llm", oracle)
    assert torch.allclose(product(made[(1, "q")]), product(want), rtol=1e-4, atol=1e-5)
    stale = factorize(weight("q", layer1), r, "svd-llm", one_shot[(1, "q")])
    assert not torch.allclose(product(made[(1, "q")]), product(stale), rtol=1e-4, atol=1e-5)


def test_sequential_refit_checkpoint_serves_like_transformers(dense, tmp_path, capsys):
    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.3)
    args = ["decompose", "--model", str(dense), "--spec", str(spec_path), "--quiet"]
    args += ["--out", str(tmp_path / "ck"), "--method", "asvd", "--calib-len", "12"]
    _one_line_error(capsys, [*args, "--sequential"], "--sequential needs calibration data")
    _one_line_error(capsys, [*args, "--method", "svd", "--refit"], "--refit needs calibration data")
    assert cli([*args, "--sequential", "--refit", "--calib", "self:4"]) == 0
    again = [*args[:-6], "--out", str(tmp_path / "again"), *args[-4:]]
    assert cli([*again, "--sequential", "--refit", "--calib", "self:4"]) == 0
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:  # deterministic: identical bytes
        assert (tmp_path / "ck" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    validate(CheckpointReader(tmp_path / "ck"), load_spec(spec_path))
    record = json.loads((tmp_path / "ck" / "config.json").read_text())["deinfer"]
    assert record["method"] == "asvd" and record["sequential"] and record["refit"]
    _greedy_equals_transformers(spec_path, tmp_path / "ck", 2, "deinfer")


def test_variant_names_parse_or_fail_in_one_line():
    assert Variant.parse("svd-llm+seq+refit") == Variant("svd-llm", True, True)
    assert Variant.parse("asvd+refit").label == "asvd+refit"
    assert Variant.parse("svd-llm+fisher+seq") == Variant("svd-llm", True, False, True)
    assert Variant.parse("svd-llm+fisher+seq").label == "svd-llm+seq+fisher"
    for bad in ("svd+seq+seq", "svd+fast", "qr", "svd+fisher+fisher"):
        with pytest.raises(UserError, match="expected a method"):
            Variant.parse(bad)


def test_allocate_writes_a_spec_at_the_same_parameter_count(dense, tmp_path):
    """At a real parameter cut the allocation spends the uniform ranks' parameters
    (within one direction's cost), never gives a matrix factors larger than itself, and
    may keep some dense."""
    from compress.allocate import break_even_rank

    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.4, rule="param_count")
    alloc = tmp_path / "allocated.yaml"
    args = ["decompose", "--model", str(dense), "--spec", str(spec_path), "--out"]
    args += [str(tmp_path / "ck"), "--method", "svd-llm", "--calib", "self:4", "--quiet"]
    assert cli([*args, "--calib-len", "16", "--allocate", str(alloc)]) == 0
    uniform, allocated = load_spec(spec_path), load_spec(alloc)

    def params(spec):
        total = 0
        for layer in spec.decomposition.layers:
            for m in spec.model.matrices:
                n_in, n_out = spec.model.matrix_shape(m)
                r = layer.rank(m)
                total += n_in * n_out if r is None else r * (n_in + n_out)
                assert r is None or r <= break_even_rank(n_in, n_out), (m, r)
        return total

    assert params(uniform) - 8 * 72 < params(allocated) <= params(uniform)  # multiple 8
    assert allocated.decomposition.layers != uniform.decomposition.layers
    validate(CheckpointReader(tmp_path / "ck"), allocated)
    _greedy_equals_transformers(alloc, tmp_path / "ck", 2, "deinfer")


def test_fidelity_table_of_methods_and_cuts(dense, tmp_path, capsys):
    out = tmp_path / "table"
    args = ["fidelity", "--model", str(dense), "--out", str(out), "--self", "2", "--len", "12"]
    args += ["--cuts", "0.3", "--allocate-cuts", "0.3", "--calib", "self:4", "--calib-len", "12"]
    args += ["--rule", "param_count", "--quiet"]
    _one_line_error(capsys, [*args, "--methods", "svd,svd+fast"], "--methods svd+fast")
    assert not out.exists()  # every method checked before any work
    assert cli([*args, "--methods", "svd,svd-llm+refit"]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["svd", "svd-llm+refit", "svd+allocate", "svd-llm+refit+allocate"]
    assert all(r["cut"] == 0.3 and 0 <= r["top1"] <= 1 and r["kl"] >= 0 for r in rows.values())
    assert all(r["factor_params"] <= 0.7 * r["dense_params"] for r in rows.values())
    assert rows["svd-llm+refit+allocate"]["factor_params"] <= rows["svd-llm+refit"]["factor_params"]
    assert result["calibration"]["calibration_tokens"] == 48
    assert 0 < result["peak_rss_gib"] < 24
    table = (out / "results.md").read_text()
    assert table.count("\n| svd") == 4 and table.count("| 30% params |") == 4


def test_fisher_is_the_summed_squared_gradient_of_each_output(dense, tmp_path):
    """The oracle reads each projection's output gradient another way: forward hooks
    that keep the outputs, a loss through input ids, ``retain_grad``."""
    from compress.fisher import output_fisher

    spec = load_spec(_spec(dense, tmp_path / "spec.yaml", 0.5))
    model = _model(dense)
    seqs = [*sample_sequences(model, 3, 8, 16, 0), [5, 9, 2, 7, 1]]  # two lengths
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = output_fisher(model, spec.model, seqs, progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
    names = names_for(spec.model)
    want = {key: torch.zeros_like(f) for key, f in got.items()}
    for seq in seqs:
        outputs, handles = {}, []
        for key in want:
            module = model.get_submodule(names.layer(*key))

            def keep(mod, args, out, key=key, outputs=outputs):
                out.retain_grad()
                outputs[key] = out

            handles.append(module.register_forward_hook(keep))
        ids = torch.tensor([seq])
        with torch.enable_grad():
            model.zero_grad()
            logits = model(input_ids=ids).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
            loss.backward()
        for h in handles:
            h.remove()
        for key, out in outputs.items():
            want[key] += out.grad[0].double().square().sum(0)
    model.zero_grad(set_to_none=True)
    assert set(got) == {(i, m) for i in range(2) for m in spec.model.matrices}
    for key, f in got.items():
        assert f.dtype == torch.float64 and f.shape == (spec.model.matrix_shape(key[1])[1],)
        assert torch.allclose(f, want[key], rtol=1e-4, atol=1e-12), key


@settings(max_examples=25, deadline=None)
@given(
    n_in=st.integers(3, 12),
    n_out=st.integers(3, 12),
    data=st.data(),
)
def test_column_scaled_truncation_is_the_weighted_optimum(n_in, n_out, data):
    """With column scales c, svd-llm's factors minimise ‖X·(W − D·U)·diag(c)‖: the error
    equals the dropped singular values² of Sᵀ·W·diag(c) (Eckart–Young), is no larger than
    the unweighted factors' in that norm, and a constant c changes nothing."""
    seed = data.draw(st.integers(0, 2**16))
    rank = data.draw(st.integers(1, min(n_in, n_out)))
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n_in, n_out, generator=gen, dtype=torch.float64)
    stats = InputStats(n_in)
    stats.add(torch.randn(4 * n_in, n_in, generator=gen, dtype=torch.float64))
    c = torch.rand(n_out, generator=gen, dtype=torch.float64) * 3 + 0.05

    def weighted_error(d, u) -> float:
        e = (w - d.double() @ u.double()) * c[None, :]
        return float(torch.einsum("ij,ik,kj->", e, stats.gram, e))

    d, u = factorize(w, rank, "svd-llm", stats, column_scale=c)
    s = stats.whitening().factor
    dropped = torch.linalg.svdvals(s.T @ w * c[None, :])[rank:].square().sum()
    assert weighted_error(d, u) == pytest.approx(float(dropped), rel=1e-4, abs=1e-6)
    plain = factorize(w, rank, "svd-llm", stats)
    assert weighted_error(d, u) <= weighted_error(*plain) * (1 + 1e-5) + 1e-6
    same = factorize(w, rank, "svd-llm", stats, column_scale=torch.full((n_out,), 2.5))
    assert torch.allclose(same[0] @ same[1], plain[0] @ plain[1], rtol=1e-4, atol=1e-5)


def test_fisher_checkpoint_serves_like_transformers(dense, tmp_path, capsys):
    """--fisher through the CLI with every other correction: deterministic bytes, the
    record says so, the engine's greedy tokens are transformers' on the same products."""
    spec_path = _spec(dense, tmp_path / "spec.yaml", 0.3, rule="param_count")
    args = ["decompose", "--model", str(dense), "--spec", str(spec_path), "--quiet"]
    args += ["--method", "svd-llm", "--calib-len", "12", "--fisher"]
    _one_line_error(capsys, [*args, "--out", str(tmp_path / "x")], "--fisher needs calibration")
    args += ["--calib", "self:4", "--sequential", "--refit"]
    for out in ("ck", "again"):
        spec_out = tmp_path / f"{out}.yaml"
        assert cli([*args, "--out", str(tmp_path / out), "--allocate", str(spec_out)]) == 0
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        if name != "config.json":  # holds the written spec's name
            assert (tmp_path / "ck" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    record = json.loads((tmp_path / "ck" / "config.json").read_text())["deinfer"]
    assert record["fisher"] and record["sequential"] and record["refit"]
    # uniform ranks with and without: same shapes, other factors
    assert cli([*args, "--out", str(tmp_path / "weighted")]) == 0
    assert cli([*[a for a in args if a != "--fisher"], "--out", str(tmp_path / "plain")]) == 0
    pairs = zip(_tensors(tmp_path / "weighted"), _tensors(tmp_path / "plain"), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)
    _greedy_equals_transformers(tmp_path / "ck.yaml", tmp_path / "ck", 2, "deinfer")


def _tensors(folder):
    from safetensors.torch import load_file

    out = []
    for f in sorted(folder.glob("*.safetensors")):
        out += [t for _, t in sorted(load_file(f).items())]
    return out
