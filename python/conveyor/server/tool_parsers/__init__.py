"""Tool calls in the model's own words: with tool_choice "auto" the model answers with
text or with calls written in the format it was trained on, and a parser turns the calls
into OpenAI's tool_calls. One parser per format (the names are vLLM's):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen, SmolLM2
    llama3_json  {"name": ..., "parameters": {...}}, maybe after <|python_tag|>   Llama 3.x
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}]            Mistral
    pythonic     [get_weather(city="Paris")]                                 Llama 3.2/4, Gemma

Without --tool-call-parser the format is chosen from the markers in the chat template.
The tools are described to the model in a system message written in the format's own
words (the chat template is given the messages only). An answer that looks like a call
but is not a valid one (bad JSON, an unknown function) comes back as text.
"""
from __future__ import annotations

import uuid
from typing import Optional

from .base import FunctionCall, MalformedCall, ParsedAnswer
from .hermes import HermesParser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .pythonic import PythonicParser

__all__ = ["PARSERS", "FunctionCall", "ParsedAnswer", "ToolCallStream", "detect_parser", "get_parser",
           "parse_answer", "tool_call_deltas"]

PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}

# a marker in the chat template's text -> the format its model writes calls in, first match wins
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>", "llama3_json"),
    ("<start_of_turn>", "pythonic"),
)
DEFAULT_PARSER = "hermes"  # SmolLM2 and the ChatML family


def get_parser(name: str):
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(PARSERS)}")
    return PARSERS[name]


def detect_parser(chat_template: Optional[str]):
    """The parser for the model whose chat template is `chat_template`."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return PARSERS[name]
    return PARSERS[DEFAULT_PARSER]


def parse_answer(parser, text: str, tool_names, parallel: bool = True) -> ParsedAnswer:
    """The answer's calls and content; a malformed call leaves the whole text as content.
    parallel False (the request's parallel_tool_calls): only the first call is kept."""
    try:
        answer = parser.parse(text, tool_names)
    except MalformedCall:
        return ParsedAnswer(text, [])
    if not parallel and len(answer.calls) > 1:
        answer = ParsedAnswer(answer.content, answer.calls[:1])
    return answer


def tool_call_deltas(calls: list) -> list:
    """OpenAI's tool_calls entries (with their index, as streamed deltas carry)."""
    return [{"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


class ToolCallStream:
    """One streamed answer: feed() returns the text that is surely content (never a part
    of a call, and no trailing blanks that a call might follow); finish() reads the rest."""

    def __init__(self, parser, tool_names, parallel: bool = True):
        self.parser = parser
        self.tool_names = tool_names
        self.parallel = parallel
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        start = self.parser.call_start(self.text)
        safe = len(self.text) if start is None else start
        safe = len(self.text[:safe].rstrip())
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self) -> tuple[str, list]:
        """(content not yet sent, calls)."""
        answer = parse_answer(self.parser, self.text, self.tool_names, self.parallel)
        if not answer.calls:
            return self.text[self.sent:], []
        start = self.parser.call_start(self.text) or 0
        return self.text[self.sent:start].rstrip() if start > self.sent else "", answer.calls
