"""Llama 3.x JSON style: the whole answer is a call {"name", "parameters"} (or
"arguments"), possibly after <|python_tag|>; several calls are separated by ';'."""
from __future__ import annotations

import json
from typing import Optional

from .base import MalformedCall, ParsedAnswer, call_from_object, leading_start, tools_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"

    def call_start(self, text: str) -> Optional[int]:
        return leading_start(text, ("{", PYTHON_TAG))

    def parse(self, text: str, tool_names) -> ParsedAnswer:
        s = text.strip()
        if s.startswith(PYTHON_TAG):
            s = s[len(PYTHON_TAG):].lstrip()
        if not s.startswith("{"):
            return ParsedAnswer(text, [])
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(s):
            try:
                obj, at = decoder.raw_decode(s, at)
            except ValueError:
                raise MalformedCall("a tool call is not JSON") from None
            calls.append(call_from_object(obj, tool_names))
            while at < len(s) and (s[at].isspace() or s[at] == ";"):
                at += 1
        return ParsedAnswer(None, calls)

    def system_prompt(self, tools: dict) -> str:
        return (f"You may call these functions:\n{tools_json(tools)}\n"
                "To call one, answer only with {\"name\": \"function name\", \"parameters\": "
                "{\"argument\": \"value\"}} (several: separated by ';'). Else answer in plain text.")

    def format_calls(self, calls: list) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
