"""Nothing lost, nothing silently wrong: bad input is refused in one line and changes
nothing; dead, stopped or signalled ranks and drivers are named and leave nothing behind.

Each test asserts the message (one line), the exit status where there is a process, and
that no file, process or folder was lost or left over."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import py_compile
import random
import re
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from cli.main import gen_main
from codegen.folder import stale_files
from codegen.generate import generate
from dsl import parse_spec
from dsl.errors import SpecError, UserError
from dsl.folders import _exchange, write_atomically
from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from runtime.kernels.loader import load_generated
from runtime.model.checkpoint import CheckpointReader
from tests.conftest import REPO, SPECS
from tests.hardening import hardening_model, one_line

TINY = SPECS / "tiny-llama.yaml"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- deinfer-gen writes only where it may ---------------------------------------------


def test_gen_refuses_folders_and_files_it_does_not_own(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "work"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep")
    for out, words in ((mine, "refusing to replace"), (a_file, "is a file")):
        assert gen_main([str(TINY), "--out", str(out)]) == 2
        assert words in one_line(capsys.readouterr().err)
    monkeypatch.chdir(mine)
    assert gen_main([str(TINY), "--out", "."]) == 2
    assert "refusing to replace" in one_line(capsys.readouterr().err)
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"
    assert a_file.read_text() == "keep"


def test_gen_replaces_its_own_folder_but_not_another_specs(tmp_path, capsys):
    out = tmp_path / "gen"
    assert gen_main([str(TINY), "--out", str(out)]) == 0
    (out / "leftover.py").write_text("x = 1\n")
    assert gen_main([str(TINY), "--out", str(out)]) == 0  # the same spec file: replaced whole
    assert not (out / "leftover.py").exists()
    other = tmp_path / "other.yaml"
    other.write_text(TINY.read_text())  # also named tiny-llama
    capsys.readouterr()
    assert gen_main([str(other), "--out", str(out)]) == 2
    message = one_line(capsys.readouterr().err)
    assert "'tiny-llama.yaml'" in message and "'other.yaml'" in message and "--force" in message
    assert gen_main([str(other), "--out", str(out), "--force"]) == 0


def test_swap_is_one_rename_and_killed_runs_are_cleaned(tmp_path, monkeypatch):
    x, y = tmp_path / "x", tmp_path / "y"
    x.mkdir()
    y.mkdir()
    (x / "was-x").touch()
    assert _exchange(x, y)  # this kernel swaps two folders in one renameat2 call
    assert os.listdir(y) == ["was-x"] and os.listdir(x) == []
    shutil.rmtree(x)
    shutil.rmtree(y)
    a = generate(parse_spec(TINY.read_text(), "tiny-llama")).files
    b = {**a, "README.md": a["README.md"] + "\nchanged\n"}
    out = tmp_path / "gen"
    write_atomically(a, out)
    dead = _dead_pid()
    stray = tmp_path / f".gen.new-{dead}-abc"
    stray.mkdir()
    (stray / "half.py").write_text("")
    write_atomically(b, out)
    assert stale_files(b, out) == [] and not stray.exists()
    # A run killed between the two renames of the fallback swap: the target is missing
    # and the old folder waits under a hidden name; the next run puts it back first.
    old = tmp_path / f".gen.old-{dead}-xyz"
    out.rename(old)
    write_atomically(a, out)
    assert stale_files(a, out) == [] and not old.exists()
    monkeypatch.setattr("dsl.folders._exchange", lambda new, out: False)  # no renameat2
    write_atomically(b, out)
    assert stale_files(b, out) == [] and os.listdir(tmp_path) == ["gen"]


def test_killing_gen_never_leaves_the_folder_missing_or_mixed(tmp_path):
    """Two specs of the same name and file name, written in turn and killed at random
    moments: the folder always holds one of the two complete outputs."""
    first, second = tmp_path / "a" / "tiny-llama.yaml", tmp_path / "b" / "tiny-llama.yaml"
    for path, rank in ((first, 27), (second, 25)):
        path.parent.mkdir()
        path.write_text(TINY.read_text().replace("q: 27", f"q: {rank}"))
    outputs = [generate(parse_spec(p.read_text(), "tiny-llama")).files for p in (first, second)]
    out = tmp_path / "gen"
    write_atomically(outputs[0], out)
    rng = random.Random(0)
    for i in range(6):
        cmd = [sys.executable, "-m", "cli.main", "gen", str((first, second)[i % 2])]
        proc = subprocess.Popen([*cmd, "--out", str(out)], cwd=REPO, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 4.0))
        proc.kill()
        proc.wait()
        assert any(stale_files(files, out) == [] for files in outputs)
    write_atomically(outputs[0], out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "gen"]  # no stray folders


def test_generated_code_runs_from_source_never_from_bytecode(tmp_path):
    folder = tmp_path / "gen"
    write_atomically(generate(parse_spec(TINY.read_text(), "tiny-llama")).files, folder)
    source = folder / "kernels.py"
    original = source.read_bytes()
    evil = b"EVIL = True\n"
    source.write_bytes(evil + b"#" * (len(original) - len(evil) - 1) + b"\n")  # same size
    cache = importlib.util.cache_from_source(str(source))
    py_compile.compile(str(source), cfile=cache, doraise=True)
    stat = source.stat()
    source.write_bytes(original)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the bytecode looks current
    module = load_generated(folder)
    assert hasattr(module, "KERNELS") and not hasattr(module, "EVIL")
    assert os.listdir(folder / "__pycache__") == [Path(cache).name]  # nothing written
    assert stale_files(generate(parse_spec(TINY.read_text(), "tiny-llama")).files, folder) == []


# --- the spec parser: only SpecError, bounded time -------------------------------------

BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    "text,words",
    [
        (BOMB + "name: *i\n", "once aliases expand"),
        ("a: " + "[" * 100_000 + "]" * 100_000, "nested deeper"),
        ("? [1, 2]\n: 3\n", "list used as a mapping key"),
        ("model: " + "9" * 100_000, "unreadable YAML value"),
        (TINY.read_text().replace("name: tiny-llama", 'name: "evil\\n"'), "name: must match"),
        (
            TINY.read_text().replace("layers: [1]", "layers: ['1-" + "9" * 100_000 + "']"),
            "expected a layer index or 'a-b' range",
        ),
    ],
)
def test_hostile_specs_are_one_short_line(text, words):
    start = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(SpecError) as err:
            parse_spec(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in str(err.value) and len(str(err.value)) < 300
    assert time.perf_counter() - start < 10 and peak < 256 << 20  # bounded time and memory


def test_rank_multiple_larger_than_a_matrix_is_refused():
    raw = yaml.safe_load(TINY.read_text())
    raw["decomposition"] = {"ratio": 0.4, "rank_multiple": 4096}
    with pytest.raises(SpecError, match=r"decomposition\.rank_multiple: 4096 is larger"):
        parse_spec(yaml.safe_dump(raw))


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
_trees = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=25,
)


@given(data=st.data())
def test_fuzzed_specs_only_ever_raise_spec_error(data):
    """Random YAML trees, and the real spec with one field replaced by a random tree."""
    raw = yaml.safe_load(TINY.read_text())
    node, key = raw, None
    while isinstance(node, dict) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node)))
        if not isinstance(node[key], dict):
            break
        node = node[key]
    if key is not None and isinstance(node, dict):
        node[key] = data.draw(_trees)
    for tree in (raw, data.draw(_trees)):
        with contextlib.suppress(SpecError):
            parse_spec(yaml.safe_dump(tree))
    with contextlib.suppress(SpecError):
        parse_spec(data.draw(st.text(max_size=200)))


# --- checkpoints -------------------------------------------------------------------------


def _shards(folder: Path, shards: dict[str, list[str]], index: object = None) -> Path:
    folder.mkdir()
    for file, names in shards.items():
        save_file({n: torch.zeros(2) for n in names}, folder / file)
    if index is not None:
        text = index if isinstance(index, str) else json.dumps(index)
        (folder / "model.safetensors.index.json").write_text(text)
    return folder


@pytest.mark.parametrize(
    "shards,index,words",
    [
        ({"a.safetensors": ["x"], "b.safetensors": ["x"]}, None, "stored twice"),
        ({"a.safetensors": ["x"], "b.safetensors": ["y"]}, {"x": "b.safetensors"}, "puts it"),
        ({"a.safetensors": ["x"]}, {"x": "../outside.safetensors"}, "outside the checkpoint"),
        ({"a.safetensors": ["x"]}, {"x": "/tmp/a.safetensors"}, "outside the checkpoint"),
        ({"a.safetensors": ["x"]}, "{not json", "not a readable safetensors index"),
        ({"a.safetensors": ["x"]}, {"x": "gone.safetensors"}, "missing"),
        ({"a.safetensors": ["x"]}, {"x": "a.safetensors", "y": "a.safetensors"}, "lists y"),
    ],
)
def test_checkpoint_index_is_authoritative_and_stays_inside(tmp_path, shards, index, words):
    wrapped = {"weight_map": index} if isinstance(index, dict) else index
    folder = _shards(tmp_path / "ckpt", shards, wrapped)
    with pytest.raises(UserError) as err:
        CheckpointReader(folder)
    assert words in one_line(str(err.value))


def test_an_index_without_weight_map_isone_line(tmp_path):
    folder = _shards(tmp_path / "ckpt", {"a.safetensors": ["x"]}, {"metadata": {}})
    with pytest.raises(UserError, match="no 'weight_map'"):
        CheckpointReader(folder)


# --- the engine refuses bad requests and keeps serving --------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hardening_model(tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def llm(model):
    with LLM(*model, tp=1) as engine:
        yield engine


@pytest.mark.parametrize(
    "prompt,words",
    [
        ([1, -1], "prompt token 1 is -1;"),
        ([1, 48], "prompt token 1 is 48;"),
        ([10**6], "is 1000000;"),
        ([1.5], "token ids are integers"),
        ([True], "token ids are integers"),
    ],
)
def test_bad_token_ids_are_refused_and_nothing_is_queued(llm, prompt, words):
    with pytest.raises(UserError, match=re.escape(words)):
        llm.generate([[1, 2], prompt], SamplingParams(max_tokens=2))
    assert not llm.scheduler.has_work()  # the good prompt before it was not queued either
    (out,) = llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"seed": 2**70},
        {"seed": -1},
        {"max_tokens": 2.5},
        {"top_k": True},
        {"stop_token_ids": (1.5,)},
    ],
)
def test_bad_sampling_params_are_refused(params):
    with pytest.raises(UserError) as err:
        SamplingParams(**params)
    one_line(str(err.value))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(model, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    spec, ckpt = model
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(60)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(copy)
    with pytest.raises(UserError, match="60 tokens, more than the model's vocabulary of 48"):
        LLM(spec, copy, tp=1)


def test_a_tuned_file_from_other_versions_warns_and_uses_the_defaults(tmp_path):
    import warnings

    from tune.store import TunedFileWarning, config_path

    manifest = json.loads((REPO / "generated/tiny-llama/manifest.json").read_text())
    kernel = next(k for k in manifest["kernels"] if k["family"] == "gemm_fixed")
    path = config_path("Fake GPU", kernel["family"], kernel["shape_key"], tmp_path)
    path.parent.mkdir(parents=True)
    meta = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    path.write_text(json.dumps({"triton": "0.1", "torch": "1.0", "configs": {"1": meta}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = generate(
            parse_spec(TINY.read_text(), "tiny-llama"), device="Fake GPU", config_root=tmp_path
        )
    assert any(issubclass(w.category, TunedFileWarning) for w in caught)
    used = json.loads(gen.files["manifest.json"])["kernels"]
    mine = next(k for k in used if k["file"] == kernel["file"])
    assert mine["meta_source"].startswith("default (unusable tuned file")


@pytest.mark.parametrize("value", [3e38, -2e5])
def test_a_weight_of_absurd_magnitude_is_refused_by_name(model, tmp_path, value, caplog):
    """A finite 3e38 loaded and made the model emit token 0 forever; now the tensor is
    named at load, and ``allow_extreme_weights`` loads it with a warning instead."""
    from safetensors.torch import load_file

    spec, ckpt = model
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]  # layer 0's
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.v.weight"))
    tensors[name][0, 0] = value
    save_file(tensors, shard)
    with pytest.raises(UserError) as err:
        LLM(spec, copy, tp=1)
    assert f"tensor {name} holds a value of magnitude" in one_line(str(err.value))
    with LLM(spec, copy, tp=1, allow_extreme_weights=True):
        assert any(name in r.getMessage() for r in caplog.records)
