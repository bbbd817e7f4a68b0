"""tool_choice "auto" through the official openai client, plain and streamed, on a real
server over stories260K. stories260K cannot write a call by itself, so guided_regex makes
it write exactly the text of one (the engine generates it token by token, the parser reads
it); without that it answers with text, which must come back as content."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALLS = ('I will check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
PYTHONIC_CALLS = '[get_weather(city="Paris"), add(a=1, b=2)]'
EXPECTED = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60.0))


@pytest.fixture(scope="module")
def client():
    server = OwnServer(str(MODEL), (), timeout=60.0)
    c = _client(server)
    yield c
    c.close()
    server.stop()


def _forced(text):
    return {"guided_regex": re.escape(text)}


def _calls(tool_calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_tool_calls(client, choice):
    """tools with tool_choice "auto", or without tool_choice (OpenAI's default is auto)."""
    kw = {} if choice is None else {"tool_choice": choice}
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0,
                                       max_tokens=128, extra_body=_forced(HERMES_CALLS), **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "I will check."
    assert _calls(ch.message.tool_calls) == EXPECTED
    assert all(c.id.startswith("call_") and c.type == "function" for c in ch.message.tool_calls)
    assert len({c.id for c in ch.message.tool_calls}) == 2


def test_auto_tool_calls_streamed(client):
    """The streamed deltas assemble (by the openai client's own stream helper) to the same answer."""
    with client.chat.completions.stream(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0,
                                        max_tokens=128, extra_body=_forced(HERMES_CALLS)) as stream:
        final = stream.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "I will check."
    assert _calls(ch.message.tool_calls) == EXPECTED
    # and by hand, as a client that reads raw chunks does
    content, calls, finish = _assemble(client.chat.completions.create(
        model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=128, stream=True,
        extra_body=_forced(HERMES_CALLS)))
    assert finish == "tool_calls" and content == "I will check."
    assert calls == EXPECTED


def _assemble(chunks):
    """(content, [(name, arguments)], finish_reason) of a streamed answer, put together from its deltas."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("stream", [False, True])
def test_auto_text_answer_is_content(client, stream):
    """An answer that is no call (here: the model's own text, and a malformed call) is content,
    the same streamed or not."""
    for extra in ({}, _forced('<tool_call>{"name": "launch", "arguments": {}}</tool_call>')):
        kw = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80,
                  extra_body=extra)
        plain = client.chat.completions.create(**kw).choices[0]
        assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
        assert plain.message.content
        if extra:
            assert plain.message.content == '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
        if stream:
            content, calls, finish = _assemble(client.chat.completions.create(stream=True, **kw))
            assert (content, calls, finish) == (plain.message.content, [], plain.finish_reason)


def test_tool_choice_none_reads_no_calls(client):
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=60, extra_body=_forced(HERMES_CALLS[:40]))
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == HERMES_CALLS[:40]


def test_history_with_tool_calls_and_results(client):
    """A conversation that holds the assistant's calls and the tool's answer is accepted."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="stories260K", messages=history, tools=TOOLS, temperature=0,
                                       max_tokens=10)
    assert r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="tool_calls"):
        client.chat.completions.create(model="stories260K", messages=MESSAGES + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{nope"}}]}],
            tools=TOOLS, max_tokens=4)


def test_tool_call_parser_option():
    """--tool-call-parser pythonic reads Python-style calls; a bad name is a one-line error."""
    server = OwnServer(str(MODEL), ("--tool-call-parser", "pythonic"), timeout=60.0)
    try:
        with _client(server) as c:
            r = c.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0,
                                          max_tokens=80, extra_body=_forced(PYTHONIC_CALLS))
            assert r.choices[0].finish_reason == "tool_calls"
            assert r.choices[0].message.content is None
            assert _calls(r.choices[0].message.tool_calls) == EXPECTED
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match="invalid choice: 'nope'"):
        OwnServer(str(MODEL), ("--tool-call-parser", "nope"), timeout=30.0)


def test_default_model_by_its_name_with_tools_and_no_tool_choice():
    """The default model (when cached), started with --model, is served as
    "SmolLM2-135M-Instruct"; a request by that name with tools and no tool_choice is answered
    (SmolLM2-135M answers this one in text; a call would come back as tool_calls)."""
    from conveyor.default_model import find_default_model

    smol = find_default_model()
    if smol is None:
        pytest.skip("the default model is not fetched here")
    server = OwnServer(f"--model={smol}", ("--max-model-len", "1024"), timeout=120.0)
    try:
        with _client(server) as c:
            assert [m.id for m in c.models.list().data] == ["SmolLM2-135M-Instruct"]
            r = c.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                          messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                          tools=TOOLS)
            ch = r.choices[0]
            assert r.model == "SmolLM2-135M-Instruct"
            if ch.message.tool_calls:
                assert ch.finish_reason == "tool_calls"
                assert all(t.function.name in ("get_weather", "add") for t in ch.message.tool_calls)
            else:
                assert ch.message.content and ch.finish_reason in ("stop", "length")
    finally:
        server.stop()


def test_streamed_logprobs_cover_every_token(client):
    """Tokens held back while a call may be starting still get their logprobs, once each."""
    kw = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=128,
              logprobs=True, extra_body=_forced(HERMES_CALLS))
    plain = client.chat.completions.create(**kw)
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kw)
                for ch in chunk.choices if ch.logprobs is not None for c in ch.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in plain.choices[0].logprobs.content]
    assert "".join(c.token for c in streamed) == HERMES_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(client, stream):
    kw = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=128,
              parallel_tool_calls=False, extra_body=_forced(HERMES_CALLS))
    if stream:
        content, calls, finish = _assemble(client.chat.completions.create(stream=True, **kw))
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        content, calls, finish = ch.message.content, _calls(ch.message.tool_calls), ch.finish_reason
    assert (content, calls, finish) == ("I will check.", EXPECTED[:1], "tool_calls")


def test_two_tools_of_one_name_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS + TOOLS[:1], max_tokens=4)
    assert e.value.body["param"] == "tools[2].function.name"


def test_arguments_that_are_not_strict_json_make_no_call():
    from conveyor.server.tool_parsers import get_parser, parse_answer

    names = {"add": {}}
    for parser, text in (("hermes", '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>'),
                         ("pythonic", "[add(a=1e999)]")):
        answer = parse_answer(get_parser(parser), text, names)
        assert answer.calls == [] and answer.content == text


def test_a_streamed_named_call_carries_its_logprobs(client):
    kw = dict(model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=32, logprobs=True,
              top_logprobs=1, tool_choice={"type": "function", "function": {"name": "add"}})
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kw)
                for ch in chunk.choices if ch.logprobs is not None for c in ch.logprobs.content]
    assert plain and [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in plain]


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_a_tool_schema_that_cannot_be_followed_is_refused_naming_the_tool(client, choice):
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS + [bad], max_tokens=4,
                                       tool_choice=choice)
    assert e.value.body["param"] == "tools[2].function.parameters"
    assert "frobnicate" in e.value.body["message"]
