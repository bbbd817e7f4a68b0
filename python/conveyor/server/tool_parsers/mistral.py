"""Mistral style: [TOOL_CALLS] then a JSON array of {"name", "arguments"}, or (newer
tokenizers) [TOOL_CALLS]name[ARGS]{arguments} once per call; text may come before."""
from __future__ import annotations

import json
from typing import Optional

from .base import MalformedCall, ParsedAnswer, call_from_object, held_prefix_start, make_call, tools_json

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser:
    name = "mistral"

    def call_start(self, text: str) -> Optional[int]:
        return held_prefix_start(text, MARKER)

    def parse(self, text: str, tool_names) -> ParsedAnswer:
        start = text.find(MARKER)
        if start < 0:
            return ParsedAnswer(text, [])
        body = text[start + len(MARKER):].strip()
        calls = []
        if body.startswith("["):
            try:
                value = json.loads(body)
            except ValueError:
                raise MalformedCall("the tool calls are not JSON") from None
            if not isinstance(value, list):
                raise MalformedCall("the tool calls are not an array")
            calls = [call_from_object(obj, tool_names) for obj in value]
        else:
            for part in body.split(MARKER):
                name, sep, args = part.partition(ARGS)
                if not sep:
                    raise MalformedCall("a tool call without [ARGS]")
                try:
                    arguments = json.loads(args)
                except ValueError:
                    raise MalformedCall("tool call arguments are not JSON") from None
                calls.append(make_call(name.strip(), arguments, tool_names))
        if not calls:
            raise MalformedCall("an empty tool call")
        return ParsedAnswer(text[:start].rstrip() or None, calls)

    def system_prompt(self, tools: dict) -> str:
        return (f"You may call these functions:\n[AVAILABLE_TOOLS]\n{tools_json(tools)}\n[/AVAILABLE_TOOLS]\n"
                "To call them, answer only with [TOOL_CALLS][{\"name\": \"function name\", "
                "\"arguments\": {\"argument\": \"value\"}}]. Else answer in plain text.")

    def format_calls(self, calls: list) -> str:
        return MARKER + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
