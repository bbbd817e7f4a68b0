"""Which request body fields the server reads, so that the others (a misspelled
"temprature", a field of another server) are named instead of ignored silently: the
server logs a warning and lists them in the response header IGNORED_FIELDS_HEADER.

OpenAI fields that change nothing here (user, metadata, ...) are accepted quietly, as
vLLM accepts them: clients send them on every request.
"""
from __future__ import annotations

IGNORED_FIELDS_HEADER = "x-conveyor-ignored-fields"

_SAMPLING = {
    "model", "n", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "logit_bias",
    "allowed_token_ids", "bad_words", "best_of", "logprobs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "response_format", "priority", "timeout",
}
_OPENAI_NO_EFFECT = {"user", "metadata", "store", "service_tier"}

READ_FIELDS = {
    "completion": _SAMPLING | {"prompt", "echo", "suffix"},
    "chat": _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                         "parallel_tool_calls"},
}


def unknown_fields(body: dict, kind: str) -> list:
    """The fields of `body` that a `kind` ("completion" or "chat") request does not read, sorted."""
    known = READ_FIELDS[kind] | _OPENAI_NO_EFFECT
    out = [k for k in body if k not in known]
    so = body.get("stream_options")
    if isinstance(so, dict):  # vLLM's continuous_usage_stats, say
        out += [f"stream_options.{k}" for k in so if k != "include_usage"]
    return sorted(out)


def header_value(fields: list) -> str:
    """The header's value: the names, comma-separated, each cut to printable ASCII."""
    clean = ("".join(c if " " < c < "\x7f" and c != "," else "?" for c in f[:64]) for f in fields[:32])
    return ",".join(clean)
