"""The tool-call parsers on answers shaped as each model family writes them: plain text,
one call, several calls, text before a call, streamed in pieces of every size, and
malformed calls (which come back as text). Arguments are compared as JSON values."""
from __future__ import annotations

import json

import pytest

from conveyor.server.tool_parsers import PARSERS, ToolCallStream, detect_parser, get_parser, parse_answer

TOOLS = {"get_weather": {"description": "the weather in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}},
         "add": {"description": "", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "integer"}}}}}

WEATHER = ("get_weather", {"city": "Paris"})
ADD = ("add", {"a": 1, "b": 2})

# parser -> [(answer, expected content, expected calls)]
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [WEATHER]),
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>', None, [WEATHER, ADD]),  # SmolLM2
        ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
         '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
         "Let me look.", [WEATHER, ADD]),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [ADD]),  # stopped before the tag
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [WEATHER, ADD]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [WEATHER, ADD]),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
         "Sure.", [WEATHER, ADD]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris")]', None, [WEATHER]),
        ('[get_weather(city=\'Paris\'), add(a=1, b=2)]', None, [WEATHER, ADD]),
        ('```tool_code\n[get_weather(city="Paris")]\n```', None, [WEATHER]),  # Gemma
        ('<|python_start|>[add(a=1, b=2)]<|python_end|>', None, [ADD]),
    ],
}

TEXT = ["The weather in Paris is sunny today.", "  1 + 2 is 3 {not a call}", ""]

MALFORMED = {
    "hermes": ['<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
               '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
               '<tool_call>{"name": "add", "arguments": {}}</tool_call> and then text'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Par',
                    '{"city": "Paris"}', '{"name": "add", "parameters": {}} trailing words'],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"', '[TOOL_CALLS]add{"a": 1}',
                '[TOOL_CALLS]{"name": "add"}'],
    "pythonic": ['[get_weather(city="Paris")', '[get_weather("Paris")]', '[get_weather(city=open("x"))]',
                 '[os.system(cmd="ls")]', '[add(**{"a": 1})]', '[]', '[add(a={1, 2})]'],
}


def _calls(answer):
    return [(c.name, json.loads(c.arguments)) for c in answer.calls]


def _stream(parser, text, size):
    """The answer fed `size` characters at a time: (all content sent, calls)."""
    s = ToolCallStream(parser, TOOLS)
    sent = "".join(s.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = s.finish()
    return sent + rest, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_calls_parse(name):
    parser = get_parser(name)
    for text, content, calls in CASES[name]:
        answer = parse_answer(parser, text, TOOLS)
        assert _calls(answer) == calls, text
        assert answer.content == content, text
        for size in (1, 2, 3, 7, len(text)):
            streamed_content, streamed_calls = _stream(parser, text, size)
            assert streamed_calls == calls, (text, size)
            assert (streamed_content or None) == content, (text, size)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_text_and_malformed_calls_come_back_as_text(name):
    parser = get_parser(name)
    for text in TEXT + MALFORMED[name]:
        answer = parse_answer(parser, text, TOOLS)
        assert answer.calls == [] and answer.content == text, text
        for size in (1, 4, max(1, len(text))):
            assert _stream(parser, text, size) == (text, []), (text, size)


def test_text_streams_before_a_call_arrives():
    """Content is let through as it comes; only a possible start of a call is held."""
    s = ToolCallStream(get_parser("hermes"), TOOLS)
    assert s.feed("It is ") == "It is"
    assert s.feed("sunny <tool") == " sunny"
    assert s.feed("box> no") == " <toolbox> no"  # not the marker after all
    s = ToolCallStream(get_parser("llama3_json"), TOOLS)
    assert s.feed("  ") == ""
    assert s.feed("Hello") == "  Hello"


def test_parser_chosen_from_the_chat_template():
    smol = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n'}}{% endfor %}")
    assert detect_parser(smol).name == "hermes"
    assert detect_parser(None).name == "hermes"
    assert detect_parser("{{ '<tool_call>' }}{{ '<|im_start|>' }}").name == "hermes"
    assert detect_parser("[INST] {{ m }} [/INST][TOOL_CALLS]").name == "mistral"
    assert detect_parser("<|start_header_id|>ipython<|end_header_id|><|python_tag|>").name == "llama3_json"
    assert detect_parser("<start_of_turn>user\n{{ m }}<end_of_turn>").name == "pythonic"
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_parser("nope")


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_history_calls_read_back(name):
    """An assistant turn's tool_calls written in the format parse back to the same calls."""
    parser = get_parser(name)
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    answer = parse_answer(parser, parser.format_calls(calls), TOOLS)
    assert _calls(answer) == [WEATHER, ADD]
    prompt = parser.system_prompt(TOOLS)
    assert "get_weather" in prompt and "the weather in a city" in prompt
