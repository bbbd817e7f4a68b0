"""The server's logit-control, best_of and prompt-logprob fields through the
official openai client and raw HTTP: logit_bias (string keys, both endpoints),
best_of, echo with prompt logprobs in OpenAI's legacy shape, and 400s that name
the param."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import conveyor  # noqa: E402
from conveyor import SamplingParams  # noqa: E402
from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
PROMPT = "Once upon a time, there was a little girl named Lily. She"


@pytest.fixture(scope="module")
def server():
    s = OwnServer(str(MODEL), (), timeout=60.0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                      http_client=httpx.Client(trust_env=False, timeout=60.0))
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    with conveyor.LLM(str(MODEL), num_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def model_name(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def test_logit_bias_through_openai_client(client, model_name, llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    bias = {str(t): -100 for t in set(base)}  # the openai client sends string keys
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  logit_bias=bias, logprobs=0, extra_body={"ignore_eos": True})
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                 logit_bias={int(k): v for k, v in bias.items()}),
                        use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text
    assert not set(want.token_ids) & set(base)
    forced = 300
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    piece = llm.get_tokenizer().decode([forced] * 5)
    assert r.choices[0].text == piece
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == llm.get_tokenizer().decode([forced] * 4)


def test_best_of_on_completions(client, model_name, llm):
    kw = dict(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    want = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, **kw), use_tqdm=False)[0].outputs
    r = client.completions.create(model=model_name, prompt=PROMPT, n=2, best_of=4, max_tokens=8,
                                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in want]


def test_echo_logprobs_legacy_shape(client, model_name, llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and r.choices[0].finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(ref.prompt_logprobs[t][ids[t]].logprob, abs=1e-5)
        assert len(lp.top_logprobs[t]) in (2, 3)
        assert max(lp.top_logprobs[t].values()) >= lp.token_logprobs[t] - 1e-6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage.completion_tokens == 0
    # prompt + completion
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                  temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    gen = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text.endswith(gen.text)
    assert all(math.isfinite(x) for x in lp.token_logprobs[1:])


def test_echo_text_offsets_point_into_the_text(client, model_name, llm):
    """Each token's text_offset is where that token's text starts in the choice's text:
    the prompt's (its leading space and BOS dropped by the echoed text) and the output's."""
    tok = llm.get_tokenizer()
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, echo=True, logprobs=1,
                                  temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    text, lp = c.text, c.logprobs
    assert text.startswith(PROMPT)
    ids = tok.encode(PROMPT)
    assert len(lp.tokens) == len(ids) + 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    assert lp.text_offset[len(ids)] == len(PROMPT)  # the output starts where the prompt ends
    first = next(j for j, piece in enumerate(lp.tokens) if piece)  # after BOS, whose text is empty
    for j, (piece, off) in enumerate(zip(lp.tokens, lp.text_offset)):
        if j == first:  # its leading space is the one the echoed text drops
            piece = piece.lstrip(" ")
        assert text[off:].startswith(piece), (j, piece, text[off:off + 12])


def test_text_offsets_count_characters_split_across_tokens():
    from conveyor.server.serving import text_offsets
    smile = "\N{GRINNING FACE}".encode()
    # four byte tokens of one character, then a word: every byte token is at that character
    assert text_offsets("\N{GRINNING FACE} hi", [smile[:1], smile[1:2], smile[2:3], smile[3:], b" hi"]) == \
        [0, 0, 0, 0, 1]
    # a prompt whose text dropped BOS (no bytes) and the first token's leading space
    assert text_offsets("Once upon", [b"", b" Once", b" upon"], 7) == [7, 7, 11]
    # an output a stop string cut short: the tokens past the text are at its end
    assert text_offsets("ab", [b"a", b"b", b"cd"]) == [0, 1, 2]


BAD = [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "big"}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"echo": True, "logprobs": 50}, "logprobs"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [9999]}, "allowed_token_ids"),
    ({"bad_words": "x"}, "bad_words"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_400_names_the_param(http, extra, param):
    r = http.post("/v1/completions", json={"prompt": PROMPT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_chat_logit_bias_400_and_best_of(http):
    msgs = [{"role": "user", "content": "Hi"}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "logit_bias": {"7": -101}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = http.post("/v1/chat/completions", json={"messages": msgs, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
