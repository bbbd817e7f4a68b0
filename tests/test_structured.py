"""Structured output (guided decoding): real servers on stories260K (llama2.c
tokenizer) and on a random-weight HF checkpoint (byte-level BPE tokenizer),
talked to with the official `openai` client; outputs checked with `jsonschema`
and `re`, independent of the grammar engine."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("uvicorn")

import conveyor  # noqa: E402
from conveyor import SamplingParams  # noqa: E402
from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.guided import GuidedDecodingParams  # noqa: E402
from conveyor.testing import write_hf_checkpoint  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    write_hf_checkpoint(path, shape="tiny", tokenizer=True)
    return path


@pytest.fixture(scope="module", params=["stories260K", "hf"])
def client(request, hf_model):
    if request.param == "stories260K":
        if not STORIES.is_file():
            pytest.skip(f"{STORIES} not found")
        model = STORIES
    else:
        model = hf_model
    server = OwnServer(str(model), (), timeout=60.0)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                      http_client=httpx.Client(trust_env=False, timeout=60.0))
    c.raw = httpx.Client(base_url=server.url, trust_env=False, timeout=60.0)
    c.model = c.raw.get("/v1/models").json()["data"][0]["id"]
    yield c
    c.raw.close()
    c.close()
    server.stop()


def test_json_schema_20_seeds(client):
    for seed in range(20):
        r = client.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": "Who are you?"}], temperature=1.0,
            seed=seed, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_and_guided_json_on_completions(client):
    r = client.completions.create(model=client.model, prompt="Once upon a time", max_tokens=120, seed=1,
                                  extra_body={"guided_json": WEATHER})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)
    r = client.completions.create(model=client.model, prompt="Once upon a time", max_tokens=300, seed=2,
                                  extra_body={"response_format": {"type": "json_object"}, "guided_json": None})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].text.startswith("{")


def test_choice_and_regex(client):
    choices = ["yes", "no", "maybe so"]
    for seed in range(5):
        r = client.completions.create(model=client.model, prompt="Is it?", max_tokens=20, seed=seed,
                                      temperature=1.0, extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices
        r = client.completions.create(model=client.model, prompt="Call", max_tokens=30, seed=seed,
                                      temperature=1.0, extra_body={"guided_regex": r"\d{3}-[a-z]{2,4}"})
        assert re.fullmatch(r"\d{3}-[a-z]{2,4}", r.choices[0].text), r.choices[0].text


def test_grammar_lark(client):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    r = client.completions.create(model=client.model, prompt="Sum", max_tokens=40, seed=3,
                                  extra_body={"guided_grammar": grammar})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text), text


def test_named_and_required_tool_calls(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in range(5):
        r = client.chat.completions.create(model=client.model, messages=msgs, tools=TOOLS, seed=seed,
                                           max_tokens=120, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        r = client.chat.completions.create(model=client.model, messages=msgs, tools=TOOLS, seed=seed,
                                           max_tokens=200, temperature=1.0, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        (call,) = r.choices[0].message.tool_calls
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # "none" ignores the tools: plain text
    r = client.chat.completions.create(model=client.model, messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=5)
    assert r.choices[0].message.tool_calls is None


def test_unconstrained_request_unchanged_beside_constrained(client):
    """A constrained request in the same batch leaves an unconstrained one's tokens alone."""
    import concurrent.futures as cf

    def plain():
        return client.completions.create(model=client.model, prompt="Once upon a time", max_tokens=24,
                                         seed=7, temperature=1.0).choices[0].text

    alone = plain()
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(plain)] + [ex.submit(lambda s=s: client.completions.create(
            model=client.model, prompt="Once", max_tokens=60, seed=s,
            extra_body={"guided_json": WEATHER})) for s in range(3)]
        assert futs[0].result() == alone
        for f in futs[1:]:
            jsonschema.validate(json.loads(f.result().choices[0].text), WEATHER)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_structured_requests_400(client, path, body, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = client.raw.post(path, json={"model": client.model, **base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_python_api_and_errors():
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} not found")
    with pytest.raises(ValueError) as ei:
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="(unclosed"))
    assert ei.value.field == "guided_decoding"
    with pytest.raises(ValueError) as ei:
        SamplingParams(guided_decoding={"json": {"type": "object"}, "regex": "a"})
    assert ei.value.field == "guided_decoding"
    with conveyor.LLM(str(STORIES)) as llm:
        sp = SamplingParams(n=3, temperature=1.0, max_tokens=150, seed=5,
                            guided_decoding=GuidedDecodingParams(json=SCHEMA))
        (out,) = llm.generate(["Hello"], sp, use_tqdm=False)
        assert len(out.outputs) == 3
        for o in out.outputs:
            jsonschema.validate(json.loads(o.text), SCHEMA)
        # unconstrained requests in the same batch are unaffected
        plain = SamplingParams(temperature=1.0, max_tokens=20, seed=9)
        (alone,) = llm.generate(["Hello"], plain, use_tqdm=False)
        both = llm.generate(["Hello", "Hello"], [plain, sp], use_tqdm=False)
        assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_engine_token_mask_contract():
    """The C side directly: a mask of the wrong size is refused, a mask for a
    request that is not guided/live is refused, a guided completion whose mask
    was never posted before a synchronous step ends aborted, and the sampler
    only ever picks allowed tokens."""
    import numpy as np

    if not STORIES.is_file():
        pytest.skip(f"{STORIES} not found")
    with conveyor.LLM(str(STORIES)) as llm:
        eng = llm._core._engine
        words = eng.token_mask_words()
        assert words == (llm._core.vocab_size + 31) // 32
        with pytest.raises(ValueError):
            eng.set_token_mask(0, 0, 0, np.zeros(words + 1, np.uint32))
        assert eng.set_token_mask(12345, 0, 0, np.zeros(words, np.uint32)) is False
        # a guided request whose masks come from here: only tokens 300..309 allowed
        sp = SamplingParams(temperature=1.0, max_tokens=4, seed=1, ignore_eos=True,
                            guided_decoding=GuidedDecodingParams(regex="a"))
        allowed = np.zeros(words, np.uint32)
        for t in range(300, 310):
            allowed[t // 32] |= np.uint32(1 << (t % 32))
        eng.add_request(900, [1, 400, 401], sp)
        for pos in range(4):
            assert eng.set_token_mask(900, 0, pos, allowed) is True
            eng.step()
            (ev,) = [e for e in eng.take_outputs() if e.request_id == 900]
            assert 300 <= ev.token < 310
        assert ev.finished and ev.finish_reason == "length"
        assert eng.set_token_mask(900, 0, 4, allowed) is False  # retired: refused
        # no mask posted before the step: aborted, not hung
        eng.add_request(901, [1, 400, 401], sp)
        eng.step()
        (ev,) = [e for e in eng.take_outputs() if e.request_id == 901]
        assert ev.finished and ev.finish_reason == "abort"


def test_bench_structured_prints_ratio(capsys):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} not found")
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools/bench_structured.py"
    spec = importlib.util.spec_from_file_location("bench_structured", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(STORIES), "--n", "4", "--max-tokens", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    n = re.findall(r"for (\d+) tokens", out)
    assert n == ["16", "16"], out  # the grammar never ends early: same token counts
    assert re.search(r"ratio \(per token\) guided/unconstrained: \d+\.\d\dx", out)


@pytest.mark.parametrize("tokenizer", ["llama", "gpt2"])
def test_gguf_tokenizers(tmp_path, tokenizer):
    """GGUF models: SentencePiece-style (dummy prefix) and byte-level vocabularies."""
    from conveyor.testing import write_gguf_checkpoint

    path = write_gguf_checkpoint(tmp_path / "m.gguf", shape="tiny", tokenizer=tokenizer)
    with conveyor.LLM(str(path)) as llm:
        for data in (b"ab c", b'{"a": 1}', b" x"):
            ids = llm.tokenizer.encode_exact_bytes(data)
            assert b"".join(llm.tokenizer.token_bytes(i) for i in ids) == data
        sp = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=2,
                            guided_decoding=GuidedDecodingParams(regex=r"[0-9]{2}-[a-z]{3}"))
        (out,) = llm.generate(["hello"], sp, use_tqdm=False)
        for o in out.outputs:
            assert o.finish_reason == "stop" and re.fullmatch(r"[0-9]{2}-[a-z]{3}", o.text), o


def test_streamed_json_schema(client):
    for seed in range(3):
        stream = client.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": "Who?"}], temperature=1.0, seed=seed,
            max_tokens=200, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(
        model=client.model, messages=[{"role": "user", "content": "Add"}], tools=TOOLS, seed=4, max_tokens=150,
        tool_choice={"type": "function", "function": {"name": "add"}}, stream=True)
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "add"
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[1]["function"]["parameters"])


def test_text_spelling_a_special_token_is_forced_as_text(smollm2_gguf):
    """A choice, regex or JSON const holding "<|im_end|>" (SmolLM2's EOS) is that text in
    the output, never the special token: the grammar's forced text is encoded without
    special ids, so the answer is complete and valid when it ends with "stop"."""
    schema = {"type": "object", "properties": {"tag": {"const": "<|im_end|>"}}, "required": ["tag"],
              "additionalProperties": False}
    with conveyor.LLM(str(smollm2_gguf)) as llm:
        special = set(llm.tokenizer.special_ids)
        for guided, check in ((GuidedDecodingParams(choice=["<|im_end|>"]), lambda t: t == "<|im_end|>"),
                              (GuidedDecodingParams(regex=r"<\|im_end\|>x"), lambda t: t == "<|im_end|>x"),
                              (GuidedDecodingParams(json=schema), lambda t: json.loads(t) == {"tag": "<|im_end|>"})):
            (out,) = llm.generate(["Say it:"], SamplingParams(temperature=0, max_tokens=40, guided_decoding=guided),
                                  use_tqdm=False)
            o = out.outputs[0]
            assert o.finish_reason == "stop" and check(o.text), (guided, o.text)
            assert not special & set(o.token_ids[:-1])  # only the EOS that ends it
