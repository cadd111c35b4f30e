"""``deinfer serve`` end to end: the real server (uvicorn, a subprocess on 127.0.0.1 and a
free port) over a tiny decomposed checkpoint with a word-level tokenizer and a chat
template, at tp 1 and tp 2, talked to with the official ``openai`` client and raw HTTP.

Greedy text through HTTP must equal ``LLM.generate`` in-process; 32 concurrent streams
must all complete with their own answers; a client that disconnects must free its KV
blocks; bad requests get a 4xx with a one-line reason and the server keeps serving;
SIGTERM finishes the running stream, exits 0 and leaves no rank behind."""

from __future__ import annotations

import json
import math
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from runtime.serve.admission import chat_prompt
from runtime.serve.body import BadRequest
from runtime.serve.text import TextStream
from tests.serving import MAX_TOKENS, MODEL, PROMPT, Server, not_zombie, serving_checkpoint
from tests.serving import words as _words


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(spec, checkpoint with tokenizer and chat template)."""
    return serving_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def expected(checkpoint):
    """What the in-process engine answers (greedy), the oracle for every HTTP answer."""
    spec, ckpt = checkpoint
    prompts = [PROMPT, "t1 t2 t47", *[_words([3 + i, 20 + i % 7, 5]) for i in range(32)]]
    with LLM(spec, ckpt, tp=1) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, logprobs=2))
        score = llm.score(outs[0].prompt_token_ids + outs[0].token_ids)
    return {p: o for p, o in zip(prompts, outs, strict=True)}, score


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, checkpoint, tmp_path_factory):
    spec, ckpt = checkpoint
    log = tmp_path_factory.mktemp("log") / f"serve-tp{request.param}.log"
    srv = Server(spec, ckpt, request.param, log)
    srv.tp = request.param
    yield srv
    srv.stop()


def test_completion_and_chat_equal_generate(server, expected):
    """Completion and chat, streamed and not: the same greedy text as LLM.generate."""
    outs, _ = expected
    client = server.client()
    want = outs[PROMPT]
    args = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    got = client.completions.create(prompt=PROMPT, **args)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    by_ids = client.completions.create(prompt=[1, 2, 3, 4, 5], **args)
    assert by_ids.choices[0].model_extra["token_ids"] == want.token_ids

    chat_want = outs["t1 t2 t47"]  # the template renders the message and appends t47
    messages = [{"role": "user", "content": "t1 t2"}]
    chat = client.chat.completions.create(messages=messages, **args)
    assert chat.choices[0].message.content == chat_want.text
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **args
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_want.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_logprobs_equal_the_engines_and_score(server, expected):
    """Log-probabilities through HTTP equal the engine's, which equal teacher forcing."""
    outs, score = expected
    want = outs[PROMPT]
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2
    )
    lp = got.choices[0].logprobs
    assert lp.tokens == [f"t{t}" for t in want.token_ids]
    n = len(want.prompt_token_ids)
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert math.isclose(value, want.logprobs[i].logprob, abs_tol=1e-5)
        assert math.isclose(value, float(score[n - 1 + i, want.token_ids[i]]), abs_tol=1e-4)
        assert len(top) == 2 and math.isclose(max(top.values()), value, abs_tol=1e-6)  # greedy
    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "t1"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)


def test_stop_strings_and_token_ids(server, expected):
    outs, _ = expected
    want, text = outs[PROMPT].token_ids, outs[PROMPT].text
    client = server.client()
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    stop = f" t{want[2]}"
    got = client.completions.create(stop=["t99", stop], **args).choices[0]
    assert got.text == text[: text.index(stop)] and got.finish_reason == "stop"
    for streamed in (False, True):
        extra = {"stop_token_ids": [want[-1]]}  # vLLM's field, sent as the client allows
        resp = client.completions.create(**args, stream=streamed, extra_body=extra)
        chunks = list(resp) if streamed else [resp]
        got_text = "".join(c.choices[0].text for c in chunks)
        assert got_text == _words(want[: want.index(want[-1])])  # the stop token not shown
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_streams(server, expected):
    """More clients than the batch (8): all complete, each with its own answer."""
    outs, _ = expected
    prompts = list(outs)[2:]
    client = server.client()

    def one(prompt: str) -> tuple[str, str | None]:
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        chunks = list(stream)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, prompts))
    assert got == [(outs[p].text, "length") for p in prompts]
    assert server.metric("deinfer_kv_blocks_used") == 0


def test_disconnect_frees_blocks(server):
    aborted = server.metric('deinfer_requests_total{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 470, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("deinfer_kv_blocks_used") > 0  # the request holds blocks
    deadline = time.monotonic() + 30
    while server.metric("deinfer_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("deinfer_kv_blocks_used") == 0
    assert server.metric('deinfer_requests_total{finish_reason="abort"}') == aborted + 1
    assert server.metric("deinfer_requests_running") == 0


@pytest.mark.parametrize(
    "body,status,words",
    [
        ({"model": "gpt-4", "prompt": "t1"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "t1", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "t1 " * 470, "max_tokens": 20}, 400, "max_seq_len"),
        ({"model": MODEL, "prompt": [1, 48]}, 400, "prompt[1] is token id 48"),
        ({"model": MODEL, "prompt": [1, -1]}, 400, "prompt[1] is token id -1"),
        ({"model": MODEL, "prompt": "t1", "temperature": math.nan}, 400, "temperature"),
        ({"model": MODEL, "prompt": "t1", "n": 17}, 400, "n: Input should be less than"),
        ({"model": MODEL, "prompt": ["t1"] * 65}, 400, "at most 64 prompts"),
        ({"model": MODEL, "prompt": [True, 2]}, 400, "found [True, 2]"),
        ({"model": MODEL, "prompt": [1.0, 2]}, 400, "found [1.0, 2]"),
        ({"model": MODEL, "prompt": ["t1", [1]]}, 400, "a non-empty list of strings or"),
        ({"model": MODEL, "prompt": "t1", "stop_token_ids": [True]}, 400, "stop_token_ids"),
        ({"model": MODEL, "prompt": "t1", "temperature": 1e-40}, 400, "at least 1e-05"),
        ({"model": MODEL, "prompt": "t1", "top_k": 2**63}, 400, "top_k"),
        ({"model": MODEL, "prompt": "t1", "top_k": 49}, 400, "vocabulary has 48 tokens"),
        ({"model": MODEL, "prompt": "t1", "stop": ["t9"] * 10_000}, 400, "at most 64 stop"),
        ({"model": MODEL, "prompt": "t1", "max_tokens": 0}, 400, "only meaningful with echo"),
        ({"model": MODEL, "prompt": "t1", "best_of": 3}, 400, "best_of is not supported"),
        ({"model": MODEL, "prompt": "t1", "logit_bias": {"99": 1}}, 400, "names token 99"),
        ({"model": MODEL, "prompt": "t1", "logit_bias": {"x": 1}}, 400, "keys are token ids"),
        ({"model": MODEL, "prompt": "t1", "frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"model": MODEL, "prompt": ""}, 400, "empty"),
        ({"model": MODEL, "prompt": "t1", "seed": 2**70}, 400, "seed"),
        ({"model": MODEL}, 400, "prompt"),
        ("{not json", 400, "malformed JSON"),
    ],
)
def test_bad_requests_get_one_line_4xx(server, body, status, words):
    data = body if isinstance(body, str) else json.dumps(body)  # NaN as JSON's NaN literal
    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=data,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == status
    message = resp.json()["error"]["message"]
    assert words in message and "\n" not in message
    ok = server.client().completions.create(model=MODEL, prompt="t1", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # still serving


def test_chat_without_template_is_a_clear_400():
    llm = SimpleNamespace(tokenizer=None)
    req = SimpleNamespace(messages=[])
    with pytest.raises(BadRequest, match="no chat template"):
        chat_prompt(req, llm)


def test_full_queue_is_503_and_serving_goes_on(checkpoint, tmp_path):
    """--max-queue 0: at most max_batch_size (8) requests in flight; the rest get 503."""
    spec, ckpt = checkpoint
    srv = Server(spec, ckpt, 1, tmp_path / "serve.log", "--max-queue", "0")
    try:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 400, "ignore_eos": True}

        def one(_: int) -> tuple[int, dict]:
            resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            return resp.status_code, resp.json()

        with ThreadPoolExecutor(24) as pool:
            got = list(pool.map(one, range(24)))
        codes = [c for c, _ in got]
        assert set(codes) == {200, 503} and codes.count(200) >= 8
        assert all(len(j["choices"][0]["token_ids"]) == 400 for c, j in got if c == 200)
        assert all("retry later" in j["error"]["message"] for c, j in got if c == 503)
        again = srv.client().completions.create(model=MODEL, prompt=[1], max_tokens=2)
        assert again.choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_sigterm_finishes_the_stream_and_leaves_nothing(checkpoint, tmp_path):
    spec, ckpt = checkpoint
    srv = Server(spec, ckpt, 2, tmp_path / "serve.log")
    children = srv.children()
    assert len(children) >= 2  # the two ranks (and the resource tracker)
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 300, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        next(lines)
        srv.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(rest) == 300 - 1 + 2  # tokens, finish, DONE
    assert srv.proc.wait(timeout=60) == 0, srv.log.read_text()[-3000:]
    time.sleep(0.5)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists() and not_zombie(pid)]
    assert alive == [], srv.log.read_text()[-2000:]
    assert "Traceback" not in srv.log.read_text()


@given(
    text=st.text(alphabet="ab c", min_size=0, max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
)
def test_text_stream_sends_exactly_the_text_before_the_first_stop(text, stops):
    """Deltas joined equal the text cut where the first stop string completes (all of it
    if none does), whatever the stop strings; nothing after it is ever sent."""

    class Chars:  # one token per character
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    stream = TextStream(Chars(), tuple(stops))
    sent = ""
    for ch in text:
        sent += stream.add(ord(ch))
        if stream.stopped:
            break
    sent += stream.flush()
    want = text
    for k in range(1, len(text) + 1):  # the first prefix that holds a stop string ends it
        if hits := [i for s in stops if (i := text[:k].find(s)) >= 0]:
            want = text[: min(hits)]
            break
    assert sent == want
