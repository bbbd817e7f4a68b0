"""The OpenAI-compatible server: real server processes on loopback, talked to with the
official `openai` client and with raw HTTP (httpx)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import conveyor  # noqa: E402
from conveyor import SamplingParams  # noqa: E402
from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")

PROMPT = "Once upon a time"
PROMPT2 = "The little dog"
CHAT = [{"role": "user", "content": "Tell me a story"}]
BODY_LIMIT = 65536


class Server(OwnServer):
    """A real server process on a free loopback port (conveyor.bench.serve.OwnServer)."""

    def __init__(self, *extra: str):
        super().__init__(str(MODEL), extra, timeout=60.0)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-body-bytes", str(BODY_LIMIT))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def limited():
    """Needs a key; one running sequence at a time and no waiting room; uvicorn's pure-Python
    HTTP implementation (the default server has httptools, the server extra installs it)."""
    s = Server("--api-key", "sekrit", "--max-queued-requests", "1", "--max-num-seqs", "1", "--http", "h11")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    engine = conveyor.LLM(str(MODEL))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30.0, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(http):
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                      http_client=httpx.Client(trust_env=False, timeout=30.0))
    yield c
    c.close()


def greedy(llm, prompt, max_tokens):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


def sse_events(text: str) -> list:
    """Parses an SSE body strictly: 'data: X' lines separated by blank lines."""
    assert text.endswith("\n\n"), text[-50:]
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        assert "\n" not in block, block
        events.append(block[len("data: "):])
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def metric(http, name) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


# ---------------------------------------------------------------------------- basics


def test_models_health_metrics(http, model_name):
    assert model_name == "stories260K"  # the file stem, not the path given on the command line
    r = http.get("/v1/models")
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert http.get("/health").status_code == 200
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("conveyor_num_requests_running", "conveyor_num_requests_waiting",
                 "conveyor_num_preemptions_total", "conveyor_kv_cache_usage_perc",
                 "conveyor_kv_cache_blocks_used", "conveyor_prefix_cache_hit_rate",
                 "conveyor_prompt_tokens_total", "conveyor_generation_tokens_total",
                 "conveyor_time_to_first_token_seconds_bucket", "conveyor_time_per_output_token_seconds_count",
                 "conveyor_e2e_request_latency_seconds_sum"):
        assert name in r.text, name
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])  # every sample value is a number
    assert metric(http, "conveyor_kv_cache_blocks_total") > 0


def test_cli_parser_defaults_to_loopback():
    from conveyor.serve import make_parser

    args = make_parser().parse_args(["m.bin"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key in (None, os.environ.get(
        "CONVEYOR_API_KEY"))
    args = make_parser().parse_args(["m.bin", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert args.max_num_seqs == 4 and args.enable_prefix_caching is False


# ---------------------------------------------------------------------------- openai client


def test_openai_completion_matches_llm(client, model_name, llm):
    ref = greedy(llm, PROMPT, 24).outputs[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason


def test_openai_chat_matches_llm(client, model_name, llm):
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)

    stream = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_openai_batch_n_and_token_prompt(client, model_name, llm):
    outs = [greedy(llm, p, 12).outputs[0] for p in (PROMPT, PROMPT2)]
    refs = [o.text for o in outs]
    r = client.completions.create(model=model_name, prompt=[PROMPT, PROMPT2], n=2, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0], refs[0], refs[1], refs[1]]
    n_prompt = len(llm.tokenizer.encode(PROMPT)) + len(llm.tokenizer.encode(PROMPT2))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 2 * sum(len(o.token_ids) for o in outs)

    ids = llm.tokenizer.encode(PROMPT)
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == refs[0]


def test_stop_and_sampling_fields(client, model_name, llm):
    ref = greedy(llm, PROMPT, 40).outputs[0].text
    word = ref.split()[3]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref[:ref.index(word)]
    # Seeded sampling repeats; the extras are accepted.
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
              presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8


def test_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token  # greedy picks the top token


# ---------------------------------------------------------------------------- raw HTTP


def test_completion_stream_format(http, model_name, llm):
    ref = greedy(llm, PROMPT, 10).outputs[0]
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert all(e["object"] == "text_completion" and e["model"] == model_name for e in events)
    *content, last = events
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in content)
    reasons = [e["choices"][0]["finish_reason"] for e in content]
    assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])
    assert "".join(e["choices"][0]["text"] for e in content) == ref.text
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": len(llm.tokenizer.encode(PROMPT)), "completion_tokens": 10,
                             "total_tokens": len(llm.tokenizer.encode(PROMPT)) + 10}

    # Without include_usage there is no usage anywhere.
    body.pop("stream_options")
    events = sse_events(http.post("/v1/completions", json=body).text)
    assert all("usage" not in e for e in events)


def test_chat_stream_format(http, model_name):
    body = {"model": model_name, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True, "n": 2}
    events = sse_events(http.post("/v1/chat/completions", json=body).text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["id"].startswith("chatcmpl-")
    first = {c["index"]: c for c in events[0]["choices"]}
    assert set(first) == {0, 1} and all(c["delta"]["role"] == "assistant" for c in first.values())
    texts = {0: "", 1: ""}
    finished = {}
    for e in events[1:]:
        for c in e["choices"]:
            assert c["index"] not in finished, "a chunk after the choice finished"
            assert "role" not in c["delta"]
            texts[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"] is not None:
                finished[c["index"]] = c["finish_reason"]
    assert finished == {0: "length", 1: "length"}
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices agree


def test_non_stream_usage_and_shape(http, model_name):
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": CHAT, "max_tokens": 5,
                                                "ignore_eos": True})
    assert r.status_code == 200
    j = r.json()
    assert j["object"] == "chat.completion" and j["id"].startswith("chatcmpl-")
    assert j["choices"][0]["message"]["role"] == "assistant"
    assert j["choices"][0]["finish_reason"] == "length" and j["usage"]["completion_tokens"] == 5
    # The model field is optional; the default length for completions is 16.
    r = http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


BAD = [
    (b"{not json", "body"),
    (b'{"prompt": "\xff\xfe"}', "body"),
    (b"[1, 2]", "body"),
    (b'{"prompt": "x", "temperature": NaN}', "body"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": [[1, 2], [1, -5]]}, "prompt[1]"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "n": 10**6}, "n"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "seed": "s"}, "seed"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "model": 3}, "model"),
    ({"prompt": "a " * 2000}, "prompt"),  # longer than the context
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_completion_400(http, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = http.post("/v1/completions", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


BAD_CHAT = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 3}, "logprobs"),
    ({"messages": CHAT, "max_tokens": 100000}, "max_tokens"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[f"badchat{i}" for i in range(len(BAD_CHAT))])
def test_chat_400(http, body, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_404_and_413(http, model_name):
    r = http.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and "no-such-model" in r.json()["error"]["message"]
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()

    big = json.dumps({"model": model_name, "prompt": "x" * (BODY_LIMIT + 10)}).encode()
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()

    def chunks():  # no Content-Length: the server must count what it reads
        for _ in range(4):
            yield b" " * (BODY_LIMIT // 2)
        yield b"{}"

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert http.get("/health").status_code == 200


def test_401_auth(limited):
    with httpx.Client(base_url=limited.url, timeout=30.0, trust_env=False) as c:
        body = {"prompt": PROMPT, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert c.get("/health").status_code == 200


def test_stream_over_h11_matches_the_default_server(limited, http, model_name, llm):
    """The same streamed completion from the h11 server and the default one: the same events."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=limited.url, timeout=30.0, trust_env=False,
                      headers={"Authorization": "Bearer sekrit"}) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    h11_events = sse_events(r.text)
    default_events = sse_events(http.post("/v1/completions", json=body).text)

    def strip(events):
        return [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]

    assert strip(h11_events) == strip(default_events)
    assert "".join(e["choices"][0]["text"] for e in h11_events if e["choices"]) == \
        greedy(llm, PROMPT, 12).outputs[0].text


def test_serve_http_choice_is_checked():
    from conveyor.serve import make_parser

    assert make_parser().parse_args(["m.bin"]).http == "auto"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["m.bin", "--http", "h2"])


def test_serve_http_httptools_missing_is_one_line(monkeypatch, capsys):
    from conveyor.serve import main

    monkeypatch.setitem(sys.modules, "httptools", None)  # as if not installed
    assert main(["m.bin", "--http", "httptools"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("conveyor serve: error:") and "httptools is missing" in err


def test_503_when_queue_is_full(limited):
    async def flood():
        async with httpx.AsyncClient(base_url=limited.url, timeout=60.0, trust_env=False,
                                     headers={"Authorization": "Bearer sekrit"},
                                     limits=httpx.Limits(max_connections=64)) as c:
            body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(12)])

    rs = asyncio.run(asyncio.wait_for(flood(), 90))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
    for r in rs:
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "service_unavailable_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    with httpx.Client(base_url=limited.url, timeout=30.0, trust_env=False) as c:
        assert metric(c, "conveyor_requests_rejected_total") == codes.count(503)


# ---------------------------------------------------------------------------- disconnects, load


def _wait_metric(http, name, pred, timeout=15.0) -> float:
    deadline = time.monotonic() + timeout
    v = metric(http, name)
    while not pred(v) and time.monotonic() < deadline:
        time.sleep(0.05)
        v = metric(http, name)
    return v


def test_disconnect_mid_stream_frees_blocks(server, http, model_name):
    aborted0 = metric(http, "conveyor_requests_aborted_total")
    gen0 = metric(http, "conveyor_generation_tokens_total")
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30.0, trust_env=False) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert metric(http, "conveyor_kv_cache_blocks_used") > 0
        # Leaving the block closes the connection mid-stream.
    assert _wait_metric(http, "conveyor_requests_aborted_total", lambda v: v > aborted0) == aborted0 + 1
    assert _wait_metric(http, "conveyor_kv_cache_blocks_used", lambda v: v == 0) == 0
    assert metric(http, "conveyor_num_requests_running") == 0
    assert metric(http, "conveyor_generation_tokens_total") - gen0 < 500  # it really stopped early
    assert metric(http, "conveyor_client_disconnects_total") >= 1


def test_disconnect_while_waiting_non_streaming(server, http, model_name):
    aborted0 = metric(http, "conveyor_requests_aborted_total")
    # sized in tokens: 128 x 500 = 64,000 tokens, over a second on this model even on a fast
    # CPU; the client gives up after 0.1 s, long before
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "n": 128}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0, read=0.1), trust_env=False) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    assert _wait_metric(http, "conveyor_requests_aborted_total", lambda v: v > aborted0) == aborted0 + 1
    assert _wait_metric(http, "conveyor_kv_cache_blocks_used", lambda v: v == 0) == 0


def test_200_concurrent_streams(server, http, model_name, llm):
    """200 streams at once with lengths 1..24 (EOS ignored): every stream must carry exactly
    its tokens, end with finish_reason "length", usage and [DONE], and match greedy LLM text."""
    lengths = [1 + i % 24 for i in range(200)]
    refs = llm.generate([PROMPT] * 24, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
                                        for k in range(1, 25)], use_tqdm=False)
    ref = {k: refs[k - 1].outputs[0].text for k in range(1, 25)}
    finished0 = metric(http, "conveyor_requests_finished_total")

    async def one(c, k):
        body = {"model": model_name, "prompt": PROMPT, "max_tokens": k, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = "".join([chunk async for chunk in r.aiter_text()])
        events = sse_events(text)
        got = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        return k, got, events[-1]["usage"]["completion_tokens"], events[-2]["choices"][0]["finish_reason"]

    async def run():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits, trust_env=False) as c:
            return await asyncio.gather(*[one(c, k) for k in lengths])

    results = asyncio.run(asyncio.wait_for(run(), 120))
    assert len(results) == 200
    for k, got, n, reason in results:
        assert (got, n, reason) == (ref[k], k, "length")
    assert metric(http, "conveyor_requests_finished_total") - finished0 == 200
    assert _wait_metric(http, "conveyor_kv_cache_blocks_used", lambda v: v == 0) == 0
    assert metric(http, "conveyor_time_to_first_token_seconds_count") >= 200
    assert metric(http, "conveyor_e2e_request_latency_seconds_count") >= 200


# ---------------------------------------------------------------------------- the serving benchmark


def test_bench_workload_shape():
    from conveyor.bench.serve import arrival_times, make_workload, summarize

    a = make_workload(400, 32, 8, 3, 512, 512, seed=1)
    assert a == make_workload(400, 32, 8, 3, 512, 512, seed=1)
    b = make_workload(400, 32, 8, 3, 512, 512, seed=1, run=1)
    assert [len(r["prompt"]) for r in a] == [len(r["prompt"]) for r in b]
    assert [r["prompt"] for r in a] != [r["prompt"] for r in b]  # no prefix-cache reuse across runs
    assert all(16 <= len(r["prompt"]) <= 48 for r in a)
    assert all(1 <= r["max_tokens"] <= 96 for r in a)
    assert 5 < sum(r["max_tokens"] for r in a) / len(a) < 11
    assert all(3 <= t < 512 for r in a for t in r["prompt"])
    t = arrival_times(1000, 50.0, seed=0)
    assert t == sorted(t) and 15 < t[-1] < 25  # about 1000 / 50 s
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    s = summarize([1.0, 2.0, 3.0, 4.0, None])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["p50"] == 2.5 and abs(s["p90"] - 3.7) < 1e-9


def test_bench_serve_against_server(server, http, tmp_path, capsys):
    from conveyor.bench.serve import main, make_workload

    out = tmp_path / "bench.json"
    rc = main(["--url", server.url, "--num-prompts", "8", "--prompt-len", "16", "--output-mean", "6",
               "--rates", "40,inf", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    card = http.get("/v1/models").json()["data"][0]
    for run, r in enumerate(res["runs"]):
        assert r["completed"] == 8 and r["failed"] == 0
        assert r["ttft_s"]["p50"] > 0 and r["e2e_s"]["p99"] >= r["ttft_s"]["p50"]
        reqs = make_workload(8, 16, 6, 3, card["vocab_size"], card["max_model_len"], 0, run=run)
        assert r["output_tokens"] == sum(q["max_tokens"] for q in reqs)  # EOS ignored: exact lengths
    assert [r["rate_label"] for r in res["runs"]] == [40.0, "inf"]
    assert "TTFT" in capsys.readouterr().out
