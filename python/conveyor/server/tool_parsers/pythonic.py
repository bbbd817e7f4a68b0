"""Pythonic style (Llama 3.2/4, Gemma): the answer is a Python list of calls with
keyword arguments, [get_weather(city="Paris"), add(a=1, b=2)], possibly wrapped in
<|python_start|>...<|python_end|> or a ```tool_code fence. Only literals are read
(ast.literal_eval on each argument); nothing is ever run."""
from __future__ import annotations

import ast
import json
from typing import Optional

from .base import MalformedCall, ParsedAnswer, leading_start, make_call, tools_json

WRAPPERS = (("<|python_start|>", "<|python_end|>"), ("```tool_code", "```"), ("```python", "```"))


class PythonicParser:
    name = "pythonic"

    def call_start(self, text: str) -> Optional[int]:
        return leading_start(text, ("[",) + tuple(w[0] for w in WRAPPERS))

    def parse(self, text: str, tool_names) -> ParsedAnswer:
        s = text.strip()
        for opener, closer in WRAPPERS:
            if s.startswith(opener):
                s = s[len(opener):]
                s = (s[:-len(closer)] if s.rstrip().endswith(closer) else s).strip()
                break
        if not s.startswith("["):
            return ParsedAnswer(text, [])
        try:
            tree = ast.parse(s, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise MalformedCall("the calls are not a Python list") from None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            raise MalformedCall("the calls are not a non-empty list")
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise MalformedCall("each call must be name(keyword=value, ...)")
            args = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise MalformedCall("** arguments are not allowed")
                try:
                    args[kw.arg] = ast.literal_eval(kw.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    raise MalformedCall(f"argument {kw.arg} is not a literal") from None
            try:
                json.dumps(args)
            except (TypeError, ValueError):  # a set, bytes, complex...: not JSON
                raise MalformedCall("an argument has no JSON form") from None
            calls.append(make_call(node.func.id, args, tool_names))
        return ParsedAnswer(None, calls)

    def system_prompt(self, tools: dict) -> str:
        return (f"You may call these functions:\n{tools_json(tools)}\n"
                "To call them, answer only with a Python list of calls such as "
                "[function_name(argument=\"value\"), other(number=1)]. Else answer in plain text.")

    def format_calls(self, calls: list) -> str:
        def call(c):
            args = ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items())
            return f"{c['name']}({args})"
        return "[" + ", ".join(call(c) for c in calls) + "]"
