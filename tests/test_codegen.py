"""deinfer-gen: determinism, drift against generated/, --check, untrusted specs,
the manifest, and that the emitted kernels compile for sm_90 without a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from codegen.generate import generate, stale_files
from codegen.render import UnsafeValueError, check_safe
from dsl import SpecError, parse_spec
from tests.conftest import REPO, SPECS, deinfer_cli

SHIPPED = sorted(SPECS.glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_generated_folder_is_current(path):
    """Drift: regenerating every shipped spec gives generated/ byte for byte."""
    gen = generate(parse_spec(path.read_text(), path.stem))
    assert stale_files(gen.files, REPO / "generated" / gen.spec.name) == []


def test_generation_is_deterministic(tmp_path):
    """Two processes with different hash seeds (set and dict order of strings) write the
    same bytes; the same spec with a comment and blank lines added generates the same code."""
    spec = SPECS / "tiny-llama.yaml"
    reordered = tmp_path / "tiny-llama.yaml"
    lines = spec.read_text().splitlines()
    reordered.write_text("# reformatted copy\n" + "\n".join(lines) + "\n\n")
    trees = []
    for seed, path in (("1", spec), ("2", spec), ("3", reordered)):
        out = tmp_path / f"out{seed}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-m", "cli.main", "gen", str(path), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        trees.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert trees[0] and trees[0] == trees[1]
    assert trees[2].keys() == trees[0].keys()
    # the manifest records the spec's source digest; everything generated from it is equal
    assert {k: v for k, v in trees[2].items() if k not in ("manifest.json", "README.md")} == {
        k: v for k, v in trees[0].items() if k not in ("manifest.json", "README.md")
    }


def test_main_command_writes_folder_with_summary(tmp_path):
    shutil.copytree(SPECS, tmp_path / "specs")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "gen", "specs/llama3-70b-r40.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "35,640 vs base 167,936" in proc.stdout and "kernels:" in proc.stdout
    out = tmp_path / "generated" / "llama3-70b-r40"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["deinfer"]["comm_units_per_token_per_block"] == 35640
    for kernel in manifest["kernels"]:
        assert (out / kernel["file"]).is_file()
        if "meta" in kernel:
            assert kernel["meta_source"].startswith(("default", "tuned"))
    for f in out.glob("*.py"):
        assert "DO NOT EDIT" in "".join(f.read_text().splitlines()[:3]), f.name
    assert "do not edit" in (out / "README.md").read_text()
    assert elapsed < 30, f"deinfer-gen took {elapsed:.1f} s"  # the bound, generous


def test_check_lists_stale_files_and_exits_1(tmp_path):
    root = tmp_path / "generated"
    shutil.copytree(REPO / "generated", root)
    ok = deinfer_cli("gen", "--check", "--specs-dir", str(SPECS), "--out-root", str(root))
    assert ok.returncode == 0, ok.stderr
    victim = root / "tiny-llama" / "kernels.py"
    victim.write_text(victim.read_text() + "# hand edit\n")
    (root / "tiny-llama" / "stray.py").write_text("")
    (root / "removed-spec").mkdir()
    bad = deinfer_cli("gen", "--check", "--specs-dir", str(SPECS), "--out-root", str(root))
    assert bad.returncode == 1
    for name in ("kernels.py", "stray.py", "removed-spec"):
        assert name in bad.stderr


def _per_layer_ranks(raw: dict, layers: int) -> dict:
    """``raw`` with ``layers`` layers, each with ranks of its own (as ``--allocate`` writes)."""
    raw = yaml.safe_load(yaml.safe_dump(raw))
    raw["name"] = "per-layer"
    raw["model"]["num_layers"] = layers
    names = ("q", "k", "v", "o", "gate", "up", "down")
    raw["decomposition"]["overrides"] = [
        {"layers": [i], "ranks": {n: 3 + i + j for j, n in enumerate(names)}} for i in range(layers)
    ]
    return raw


def test_generated_files_do_not_grow_with_the_layer_shapes(tmp_path):
    uniform = yaml.safe_load((SPECS / "tiny-llama.yaml").read_text())
    few = generate(parse_spec(yaml.safe_dump(_per_layer_ranks(uniform, 2))))
    many = generate(parse_spec(yaml.safe_dump(_per_layer_ranks(uniform, 24))))
    assert len(json.loads(many.files["manifest.json"])["layer_shapes"]) == 24
    base = generate(parse_spec(yaml.safe_dump(uniform)))
    assert len(many.files) == len(few.files) == len(base.files)
    # and --check still sees a hand edit of one layer shape's entry in a shared file
    spec_dir, root = tmp_path / "specs", tmp_path / "generated"
    spec_dir.mkdir()
    (spec_dir / "per-layer.yaml").write_text(yaml.safe_dump(_per_layer_ranks(uniform, 24)))
    assert (
        deinfer_cli("gen", str(spec_dir / "per-layer.yaml"), "--out-root", str(root)).returncode
        == 0
    )
    check = ("gen", "--check", "--specs-dir", str(spec_dir), "--out-root", str(root))
    assert deinfer_cli(*check).returncode == 0
    victim = root / "per-layer" / "down_proj.py"
    text = victim.read_text()
    assert text.count("DownProj(") == 2 * 24  # an entry per (group, layer shape)
    victim.write_text(text.replace("in_features=", "in_features=1 + ", 1))
    bad = deinfer_cli(*check)
    assert bad.returncode == 1 and "down_proj.py" in bad.stderr


INJECTIONS = [
    ("name", lambda r: r.update(name='x"""; import os; os.system(\'id\') #')),
    ("norm kind", lambda r: r["model"].update(norm={"kind": "rms\nimport os"})),
    (
        "activation",
        lambda r: r["model"].update(mlp={"kind": "glu", "activation": "__import__('os')"}),
    ),
    ("dtype", lambda r: r["runtime"].update(dtype="float32; import os")),
    ("rank as string", lambda r: r["decomposition"]["ranks"].update(q="1); import os; (")),
    (
        "float theta as code",
        lambda r: r["model"]["positions"].update(theta="1e4 + __import__('os')"),
    ),
]


@pytest.mark.parametrize("label,mutate", INJECTIONS, ids=[i[0] for i in INJECTIONS])
def test_smuggled_code_is_rejected_before_anything_is_written(tmp_path, label, mutate):
    raw = yaml.safe_load((SPECS / "tiny-llama.yaml").read_text())
    mutate(raw)
    spec = tmp_path / "evil.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    proc = deinfer_cli("gen", str(spec), "--out", str(out))
    assert proc.returncode == 2, (label, proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [spec]
    with pytest.raises(SpecError):
        generate(parse_spec(spec.read_text(), "evil"))


def test_emitter_guard_rejects_text_outside_the_vocabulary():
    check_safe({"a": 1, "b": 2.5, "c": "attn s0 | D_q (27)", "d": [(1, 2, 3)]})
    for bad in ("x'", 'x"', "a\nb", "{x}", "#", "\\", float("nan")):
        with pytest.raises(UnsafeValueError):
            check_safe({"v": bad})
    with pytest.raises(UnsafeValueError):
        check_safe(object())


def test_generated_kernels_compile_for_sm90_in_bf16():
    """Lower every kernel of tiny-llama to a cubin for sm_90 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tune.compile_check",
            str(REPO / "generated" / "tiny-llama"),
            "--arch",
            "90",
            "--dtype",
            "bf16",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    families = {line.split("_")[0] for line in lines}
    assert {"down", "latent", "gemm", "kv", "rope", "paged"} <= families
    assert all(" ok, " in line for line in lines)
