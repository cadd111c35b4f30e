"""What a newcomer meets first: the README's Python snippet saved as a script, the help
text, and one-line errors (exit status 2, no traceback) for the mistakes people make."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, SPECS, deinfer_cli
from tests.hardening import hardening_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hardening_model(tmp_path_factory.mktemp("newcomer"))


def _run(spec, checkpoint, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``deinfer run`` at tp 1 with ``args`` (the prompt and options)."""
    common = ["run", "--spec", str(spec), "--checkpoint", str(checkpoint), "--tp", "1"]
    return deinfer_cli(*common, *args, env=env)


def _refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 and exactly one ``error:`` line naming the problem, no traceback
    (progress lines such as "loading ..." may come before it)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for word in words:
        assert word in errors[0], errors[0]


def test_the_readme_snippet_runs_as_a_saved_script(model, tmp_path):
    spec, ckpt = model
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"The Python API:\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert 'if __name__ == "__main__":' in snippet
    script = tmp_path / "snippet.py"
    script.write_text(
        snippet.replace("my-model.yaml", str(spec)).replace("path/to/lowrank", str(ckpt))
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    first = lines[0]
    assert first.startswith("[") and len(first.split("]")[0].split(",")) == 16  # 16 tokens
    assert len(lines) >= 2 and all(len(line.split()) == 3 for line in lines[1:])  # stream


def test_help_names_every_command_without_markup():
    proc = deinfer_cli("--help")
    assert proc.returncode == 0
    for command in ("plan", "gen", "decompose", "tune", "run", "demo", "bench", "predict"):
        assert command in proc.stdout
    for command in ("import", "eval", "fidelity", "serve"):
        assert command in proc.stdout
    assert "``" not in proc.stdout


def test_a_text_prompt_without_a_tokenizer(model):
    spec, ckpt = model
    proc = _run(spec, ckpt, "--prompt", "hello world")
    _refused(proc, "no tokenizer", "token ids")


def test_backend_triton_on_a_cpu_without_the_interpreter(model):
    spec, ckpt = model
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = _run(spec, ckpt, "--path", "static", "--backend", "triton", "--prompt", "1,2", env=env)
    _refused(proc, "backend triton needs a GPU", "TRITON_INTERPRET=1")


def test_a_spec_that_does_not_match_the_checkpoint(model):
    _, ckpt = model
    proc = _run(SPECS / "tiny-llama.yaml", ckpt, "--prompt", "1,2")
    _refused(proc, "model.")  # names the tensor that differs


def test_gpu_check_without_a_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tune.gpu_check", "--out", str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    _refused(proc, "needs a CUDA GPU")
    assert not (tmp_path / "out").exists()


def test_an_unknown_backend_or_up_layout_from_python_is_one_error():
    from dsl.errors import UserError
    from runtime.engine import LLM

    with pytest.raises(UserError, match="backend must be one of"):
        LLM(SPECS / "tiny-llama.yaml", "nowhere", backend="cuda")
    with pytest.raises(UserError, match="up_layout must be auto or one of replicated, sharded"):
        LLM(SPECS / "tiny-llama.yaml", "nowhere", up_layout="diagonal")
