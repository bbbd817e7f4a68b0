"""What every tool-call parser shares: the call it returns, the checks a call must pass,
and the prompt that shows the model its tools.

A parser reads a model's whole answer (parse) and says, while the answer streams in,
from where on the text may be a call (call_start), so that the text before it can be
streamed as content and the call held back until it can be read whole.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional


@dataclass
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass
class ParsedAnswer:
    content: Optional[str]   # the text beside the calls (None: none); the whole text when no call
    calls: list              # [FunctionCall]; empty: the answer is text


class MalformedCall(ValueError):
    """The text looked like a call but is not one (it goes back as text)."""


def make_call(name, arguments, tool_names) -> FunctionCall:
    """A checked call: a known function's name and an object of arguments."""
    if not isinstance(name, str) or name not in tool_names:
        raise MalformedCall(f"no tool named {name!r}")
    if isinstance(arguments, str):  # some models send the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise MalformedCall("arguments are not JSON") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise MalformedCall("arguments are not an object")
    try:  # NaN and Infinity, which Python's JSON reads, are not JSON to a strict client
        return FunctionCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except ValueError:
        raise MalformedCall("arguments hold a number that is not JSON (NaN or Infinity)") from None


def call_from_object(obj, tool_names, arguments_keys=("arguments", "parameters")) -> FunctionCall:
    """{"name": ..., "arguments" | "parameters": {...}} as a call."""
    if not isinstance(obj, dict) or "name" not in obj:
        raise MalformedCall("a call must be an object with a 'name'")
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    return make_call(obj["name"], args, tool_names)


def held_prefix_start(text: str, marker: str) -> Optional[int]:
    """Where `marker` starts in text, or where a part of it that may still be completed
    starts at the very end (text "hi <tool" holds back "<tool"); None when neither."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


def leading_start(text: str, openers: tuple) -> Optional[int]:
    """For formats whose call is the whole answer: 0 while the answer (leading blanks
    aside) is empty or may begin with one of `openers`, else None (it is text)."""
    s = text.lstrip()
    if not s or any(s.startswith(o) or o.startswith(s) for o in openers):
        return 0
    return None


def tools_json(tools: dict) -> str:
    """One line per function: {"name", "description" (when there is one), "parameters"}."""
    return "\n".join(json.dumps({"name": n, **({"description": t["description"]} if t.get("description") else {}),
                                 "parameters": t["parameters"]}, ensure_ascii=False)
                     for n, t in tools.items())
