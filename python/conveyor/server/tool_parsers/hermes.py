"""Hermes / Qwen / SmolLM2 style: calls inside <tool_call>...</tool_call> tags, each a
JSON object {"name", "arguments"} or (SmolLM2) a JSON array of them; text may come
before the first tag. A final tag left open at the end of the answer is read too."""
from __future__ import annotations

import json
from typing import Optional

from .base import MalformedCall, ParsedAnswer, call_from_object, held_prefix_start, tools_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
    name = "hermes"

    def call_start(self, text: str) -> Optional[int]:
        return held_prefix_start(text, OPEN)

    def parse(self, text: str, tool_names) -> ParsedAnswer:
        start = text.find(OPEN)
        if start < 0:
            return ParsedAnswer(text, [])
        calls = []
        rest = text[start:]
        while rest.strip():
            if not rest.lstrip().startswith(OPEN):
                raise MalformedCall("text after a tool call")
            rest = rest.lstrip()[len(OPEN):]
            end = rest.find(CLOSE)
            body, rest = (rest, "") if end < 0 else (rest[:end], rest[end + len(CLOSE):])
            try:
                value = json.loads(body)
            except ValueError:
                raise MalformedCall("a tool call is not JSON") from None
            for obj in value if isinstance(value, list) else [value]:
                calls.append(call_from_object(obj, tool_names))
        if not calls:
            raise MalformedCall("an empty tool call")
        return ParsedAnswer(text[:start].rstrip() or None, calls)

    def system_prompt(self, tools: dict) -> str:
        return (f"You may call these functions:\n<tools>\n{tools_json(tools)}\n</tools>\n"
                "To call them, answer only with <tool_call>[{\"name\": \"function name\", "
                "\"arguments\": {\"argument\": \"value\"}}]</tool_call>. Else answer in plain text.")

    def format_calls(self, calls: list) -> str:
        return "".join(f"{OPEN}{json.dumps({'name': c['name'], 'arguments': c['arguments']})}{CLOSE}"
                       for c in calls)
