"""lm-evaluation-harness, a standard client, against ``deinfer serve``: its
``local-completions`` model scores a multiple-choice task of the project's own
(``tests/data/lmeval``) through ``echo`` with ``logprobs``, at batch size 1 (one prompt
per request) and 4 (four prompts per request). Every choice's log-likelihood must equal
the one ``LLM.score`` gives in-process (to 1e-4), and the greedy flags must agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.engine.llm import LLM
from tests.conftest import REPO
from tests.serving import MODEL, Server, serving_checkpoint

TASK = REPO / "tests" / "data" / "lmeval"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return serving_checkpoint(tmp_path_factory.mktemp("lm-eval"))


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[tuple[str, str], tuple[float, bool]]:
    """(context, choice) -> (log-likelihood, greedy) by teacher forcing in-process, with
    lm-eval's own split of context and continuation (the whole text encoded once)."""
    out = {}
    docs = [json.loads(line) for line in (TASK / "deinfer_mc.jsonl").read_text().splitlines()]
    with LLM(*checkpoint, tp=1) as llm:
        for doc in docs:
            context = llm.tokenizer.encode(doc["context"])
            for choice in doc["choices"]:
                whole = llm.tokenizer.encode(f"{doc['context']} {choice}")
                logp = llm.score(whole)
                rows = range(len(context), len(whole))
                total = sum(float(logp[i - 1, whole[i]]) for i in rows)
                greedy = all(int(logp[i - 1].argmax()) == whole[i] for i in rows)
                out[(doc["context"], choice)] = (total, greedy)
    return out


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = Server(*checkpoint, 1, tmp_path_factory.mktemp("log") / "serve.log")
    yield srv
    srv.stop()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_scores_every_choice_as_the_engine_does(
    server, checkpoint, expected, batch_size, tmp_path
):
    _, ckpt = checkpoint
    args = (
        f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={ckpt},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=400"
    )
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
    cmd += ["--model_args", args, "--tasks", "deinfer_mc", "--include_path", str(TASK)]
    cmd += ["--batch_size", str(batch_size), "--output_path", str(tmp_path), "--log_samples"]
    env = os.environ | {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
    }
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = tmp_path.rglob("samples_deinfer_mc_*.jsonl")
    scored = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        doc = sample["doc"]
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            loglik, greedy = resp[0]  # the samples file holds them as text
            want_loglik, want_greedy = expected[(doc["context"], choice)]
            assert float(loglik) == pytest.approx(want_loglik, abs=1e-4)
            assert str(greedy) == str(want_greedy)
            scored += 1
    assert scored == len(expected)
