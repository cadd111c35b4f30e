"""``deinfer serve`` against what a standard client and a hostile one send: echo (the
prompt scored, as lm-evaluation-harness asks), lists of prompts and ``n``, logit bias and
penalties, bodies too large or malformed, shutdown past its grace, a dead rank, a busy
port. Each answer is compared with the engine in-process or checked for its OpenAI shape,
and the server is shown to keep serving (or to stop, with a reason, where it must)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from tests.serving import MODEL, Server, not_zombie, serving_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return serving_checkpoint(tmp_path_factory.mktemp("serve-hardening"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    with LLM(*checkpoint, tp=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = Server(*checkpoint, 1, tmp_path_factory.mktemp("log") / "serve.log")
    yield srv
    srv.stop()


def _post(server: Server, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def _still_serving(server: Server) -> None:
    ok = _post(server, {"model": MODEL, "prompt": [1], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def _openai_error(resp: httpx.Response, status: int, words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and "\n" not in error["message"]


# --- echo: lm-evaluation-harness's log-likelihoods -------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_scores_every_prompt_token_as_score_does(server, engine, max_tokens):
    """``{"prompt": [[ids], [ids]], "max_tokens": 1, "logprobs": 1, "echo": true}``: each
    prompt token's log-probability (None for the first) equals ``LLM.score`` to 1e-4, the
    top alternative is the argmax, and max_tokens 0 sends the prompt alone."""
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": max_tokens, "logprobs": 1}
    resp = _post(server, body | {"echo": True, "temperature": 0})
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        score = engine.score(prompt)
        lp = choice["logprobs"]
        assert lp["tokens"][: len(prompt)] == [f"t{t}" for t in prompt]
        assert choice["text"].startswith(" ".join(f"t{t}" for t in prompt))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(prompt)):
            want = float(score[i - 1, prompt[i]])
            assert math.isclose(lp["token_logprobs"][i], want, abs_tol=1e-4)
            (best,) = lp["top_logprobs"][i].values()
            assert math.isclose(best, float(score[i - 1].max()), abs_tol=1e-4)
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        assert len(choice["token_ids"]) == max_tokens
    assert resp.json()["usage"]["completion_tokens"] == 2 * max_tokens


def test_streamed_echo_sends_the_prompt_first(server):
    body = {"model": MODEL, "prompt": "t1 t2 t3", "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line[6:7] == "{"]
    assert events[0]["choices"][0]["text"] == "t1 t2 t3"
    assert "token_ids" not in events[0]["choices"][0]
    assert len([e for e in events if e["choices"][0].get("token_ids")]) == 2


# --- many prompts, n, logit bias, penalties ---------------------------------------------


def test_prompt_lists_and_n_give_one_choice_per_prompt_and_sample(server, engine):
    """Choice i·n + j is sample j of prompt i, each as the engine makes it in-process (a
    seed s gives sample j the seed s + j); streamed chunks carry the same indices."""
    params = {"max_tokens": 5, "temperature": 1.0, "seed": 11}
    body = {"model": MODEL, "prompt": ["t1 t2", "t5"], "n": 3, **params}
    got = {c["index"]: c["token_ids"] for c in _post(server, body).json()["choices"]}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}) as r:
        streamed: dict[int, list[int]] = {}
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed.setdefault(c["index"], []).extend(c.get("token_ids", []))
    assert got == streamed and sorted(got) == list(range(6))
    for i, prompt in enumerate(["t1 t2", "t5"]):
        samples = [SamplingParams(**params | {"seed": 11 + j}) for j in range(3)]
        outs = engine.generate([prompt] * 3, samples)
        assert [got[3 * i + j] for j in range(3)] == [o.token_ids for o in outs]
    assert got[0] != got[1]  # n samples, not one sample n times


def test_logit_bias_and_penalties_are_applied_as_in_process(server, engine):
    """Never accepted and ignored: the same tokens as ``LLM.generate`` with the same
    bias and penalties, and different ones from a request without them."""
    cases = [
        ({"logit_bias": {"7": 100}}, {"logit_bias": ((7, 100.0),)}),
        (
            {"logit_bias": {"7": 6}, "frequency_penalty": 2.0},
            {"logit_bias": ((7, 6.0),), "frequency_penalty": 2.0},
        ),
        (
            {"logit_bias": {"9": 4}, "presence_penalty": -2.0},
            {"logit_bias": ((9, 4.0),), "presence_penalty": -2.0},
        ),
    ]
    plain = _post(server, {"model": MODEL, "prompt": [1, 2], "max_tokens": 8, "temperature": 0})
    plain_ids = plain.json()["choices"][0]["token_ids"]
    for http, python in cases:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 8, "temperature": 0, **http}
        got = _post(server, body).json()["choices"][0]["token_ids"]
        (want,) = engine.generate([[1, 2]], SamplingParams(max_tokens=8, **python))
        assert got == want.token_ids and got != plain_ids
    assert got.count(9) >= 1  # a negative presence penalty rewards what was said


# --- bodies, shapes, metrics -------------------------------------------------------------


def _raw_post(server: Server, head: bytes, body: bytes) -> tuple[int, dict]:
    """Send ``head`` and ``body`` on one socket; the status and JSON of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[-1] or b"{}")


def test_a_body_past_the_limit_is_413_before_it_is_read(server):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {50 << 20}\r\n\r\n"
    ).encode()
    start = time.monotonic()
    status, body = _raw_post(server, head, b'{"model": "')  # 50 MB announced, 11 B sent
    assert status == 413 and "at most 4,194,304" in body["error"]["message"]
    assert time.monotonic() - start < 10
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"a" * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(5)) + b"0\r\n\r\n"
    status, body = _raw_post(server, chunked, chunks)
    assert status == 413 and "more than 4,194,304" in body["error"]["message"]
    _still_serving(server)


@pytest.mark.parametrize(
    "body,path,status,words",
    [
        (b'{"model": "tiny-hf", "prompt": "\xff\xfe"}', "/v1/completions", 400, "malformed JSON"),
        (b'{"model": "tiny-hf", "prompt": "t1\\ud800"}', "/v1/completions", 400, "malformed"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "/v1/completions", 400, "JSON"),
        (b"{}", "/v1/nowhere", 404, "Not Found"),
    ],
)
def test_malformed_bodies_and_paths_get_openai_errors(server, body, path, status, words):
    _openai_error(_post(server, body, path), status, words)
    _still_serving(server)


def test_a_stop_string_finish_is_counted_as_stop(server, engine):
    (out,) = engine.generate(["t1 t2"], SamplingParams(max_tokens=6))
    before = server.metric('deinfer_requests_total{finish_reason="stop"}')
    aborted = server.metric('deinfer_requests_total{finish_reason="abort"}')
    stop = f"t{out.token_ids[2]}"
    body = {"model": MODEL, "prompt": "t1 t2", "max_tokens": 6, "temperature": 0, "stop": stop}
    assert _post(server, body).json()["choices"][0]["finish_reason"] == "stop"
    assert server.metric('deinfer_requests_total{finish_reason="stop"}') == before + 1
    assert server.metric('deinfer_requests_total{finish_reason="abort"}') == aborted


# --- stopping ----------------------------------------------------------------------------


def test_sigterm_past_the_timeout_ends_every_stream_with_abort_and_done(checkpoint, tmp_path):
    """More work than --shutdown-timeout: every stream still gets a last chunk with its
    finish reason and [DONE], the server exits 0, and the log has no traceback."""
    from concurrent.futures import ThreadPoolExecutor

    srv = Server(*checkpoint, 1, tmp_path / "serve.log", "--shutdown-timeout", "1")
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 470, "stream": True}
    body["ignore_eos"] = True

    def one(_: int) -> list[str]:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(24) as pool:
        streams = [pool.submit(one, i) for i in range(24)]
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        lines = [s.result() for s in streams]
    assert srv.proc.wait(timeout=60) == 0
    reasons = [json.loads(s[-2][6:])["choices"][0]["finish_reason"] for s in lines]
    assert all(s[-1] == "data: [DONE]" for s in lines)
    assert set(reasons) <= {"abort", "length"} and "abort" in reasons
    assert "Traceback" not in srv.log.read_text()


@pytest.mark.parametrize(
    "sig,words",
    [(signal.SIGKILL, "died (exit code -9)"), (signal.SIGSTOP, "stopped answering")],
)
def test_a_dead_or_stopped_rank_is_logged_and_the_server_exits_nonzero(
    checkpoint, tmp_path, sig, words
):
    srv = Server(*checkpoint, 2, tmp_path / "serve.log")
    ranks = [pid for pid in srv.children() if "spawn_main" in _cmdline(pid)]
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 470, "stream": True}
    url = f"{srv.url}/v1/completions"
    with httpx.stream("POST", url, json=body | {"ignore_eos": True}, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        start = time.monotonic()
        os.kill(ranks[-1], sig)
        rest = [line for line in lines if line.startswith("data: ")]
    assert "error" in json.loads(rest[-1][6:]) and time.monotonic() - start < 20
    assert srv.proc.wait(timeout=20) == 1
    log = srv.log.read_text()
    assert words in log and "error: the server stopped" in log
    time.sleep(0.5)
    assert [p for p in ranks if Path(f"/proc/{p}").exists() and not_zombie(p)] == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_busy_port_fails_in_one_line_before_loading(checkpoint):
    spec, ckpt = checkpoint
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "cli.main", "serve", "--spec", str(spec)]
        cmd += ["--checkpoint", str(ckpt), "--port", str(port)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
