"""`conveyor serve`: an OpenAI-compatible HTTP server over one AsyncLLM.

    conveyor serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine knobs]
    python -m conveyor.serve MODEL ...

Endpoints: POST /v1/completions, POST /v1/chat/completions (plain or streamed as
server-sent events ending with ``data: [DONE]``), GET /v1/models, GET /health and
GET /metrics (Prometheus text format).

The app is plain Starlette (no request-model magic), so every error is ours: bad
input gets 400 naming the field, never 422 or 500. A client that goes away has its
request aborted at once: a task per response waits for the ASGI ``http.disconnect``
message and cancels the generation, and cancelling AsyncLLM.generate's iterator
aborts the engine request and frees its KV blocks.

`build_app(engine, model_name=...)` returns the ASGI app for tests and embedding.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import os
import sys
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from .sampling_params import MAX_LOGPROBS, SamplingParams
from .stream_encoder import ChunkEncoder, dumps

DEFAULT_MAX_QUEUED_REQUESTS = 1024
RETRY_AFTER_S = 1           # the Retry-After of a 503 for a full queue
DEFAULT_MAX_BODY_BYTES = 16 << 20
MAX_N = 128                 # choices per prompt
MAX_PROMPTS = 256           # prompts in one batched completions request
MAX_SEQUENCES = 1024        # prompts x n in one request
MAX_STOP = 16
DEFAULT_CHAT_MAX_TOKENS_CAP = 4096
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 405: "invalid_request_error",
                              413: "invalid_request_error", 503: "service_unavailable_error"
                              }.get(status, "server_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


_dumps = dumps  # compact, UTF-8 as is, no NaN


# ---------------------------------------------------------------------------- validation


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _check_text(param: str, s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, f"'{param}' contains invalid Unicode (a lone surrogate)") from None
    return s


class _Fields:
    """Reads typed, range-checked fields from a JSON object; errors name the field."""

    def __init__(self, obj: dict, prefix: str = ""):
        self.obj = obj
        self.prefix = prefix

    def name(self, key: str) -> str:
        return self.prefix + key

    def int(self, key, default=None, lo=None, hi=None):
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(self.name(key), f"'{self.name(key)}' must be an integer, got {_type_name(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _bad(self.name(key), f"'{self.name(key)}' must be in [{lo if lo is not None else '-inf'}, "
                                       f"{hi if hi is not None else 'inf'}], got {v}")
        return v

    def number(self, key, default=None, lo=None, hi=None, lo_open=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bad(self.name(key), f"'{self.name(key)}' must be a number, got {_type_name(v)}")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        ok = math.isfinite(f) and (lo is None or (f > lo if lo_open else f >= lo)) and (hi is None or f <= hi)
        if not ok:
            left = "(" if lo_open else "["
            raise _bad(self.name(key), f"'{self.name(key)}' must be a finite number in {left}"
                                       f"{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], "
                                       f"got {v!r}")
        return f

    def bool(self, key, default=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _bad(self.name(key), f"'{self.name(key)}' must be a boolean, got {_type_name(v)}")
        return v

    def str(self, key, default=None):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise _bad(self.name(key), f"'{self.name(key)}' must be a string, got {_type_name(v)}")
        return _check_text(self.name(key), v)

    def obj_(self, key) -> Optional[dict]:
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise _bad(self.name(key), f"'{self.name(key)}' must be an object, got {_type_name(v)}")
        return v


@dataclass
class _Prompt:
    text: Optional[str]
    ids: list


@dataclass
class _Parsed:
    """A validated request: prompts, sampling, and how to answer."""

    kind: str                       # "completion" or "chat"
    prompts: list                   # [_Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # completions: top-N; chat: top_logprobs (when logprobs is on)
    echo: bool = False
    model: Optional[str] = None
    priority: int = 0               # vLLM's extension: lower runs first under scheduling="priority"
    timeout: Optional[float] = None # seconds from arrival; past it: finish_reason "timeout"


def _parse_stop(f: _Fields):
    v = f.obj.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "'stop' must be a string or an array of strings")
    if len(v) > MAX_STOP:
        raise _bad("stop", f"'stop' has {len(v)} entries; at most {MAX_STOP} are allowed")
    for s in v:
        if s == "":
            raise _bad("stop", "'stop' must not contain an empty string")
        _check_text("stop", s)
    return v or None


def _common_sampling(f: _Fields, max_tokens: Optional[int], logprobs: Optional[int], n: int) -> dict:
    """The request fields every endpoint maps onto SamplingParams."""
    kw = dict(
        n=n,
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, lo=0.0, hi=1e6),
        top_p=f.number("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=f.int("top_k", 0, lo=-1, hi=1 << 30),
        min_p=f.number("min_p", 0.0, lo=0.0, hi=1.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, lo=0.0, hi=1e6, lo_open=True),
        presence_penalty=f.number("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        seed=f.int("seed", None, lo=-(2**63), hi=2**64 - 1),
        stop=_parse_stop(f),
        ignore_eos=f.bool("ignore_eos", False),
        min_tokens=f.int("min_tokens", 0, lo=0, hi=1 << 30),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        logprobs=logprobs,
    )
    sti = f.obj.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
            raise _bad("stop_token_ids", "'stop_token_ids' must be an array of integers")
        if len(sti) > 64:
            raise _bad("stop_token_ids", "'stop_token_ids' may hold at most 64 ids")
        kw["stop_token_ids"] = sti
    if max_tokens is not None and kw["min_tokens"] > max_tokens:
        raise _bad("min_tokens", f"'min_tokens' ({kw['min_tokens']}) must be <= max_tokens ({max_tokens})")
    lb = f.obj.get("logit_bias")
    if lb is not None and lb != {}:
        raise _bad("logit_bias", "'logit_bias' is not supported by this server")
    bo = f.obj.get("best_of")
    if bo is not None and bo != n:
        raise _bad("best_of", "'best_of' is not supported (only best_of == n)")
    return kw


def _make_params(kw: dict) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        msg = str(e)
        param = None
        if msg.startswith("SamplingParams."):
            param = msg[len("SamplingParams."):].split(" ", 1)[0]
        raise _bad(param or "body", msg.replace("SamplingParams.", "")) from None


def _load_fields(f: _Fields) -> dict:
    """The serving-under-load fields of any generation request: priority and timeout."""
    return {"priority": f.int("priority", 0, lo=-(2**31), hi=2**31 - 1),
            "timeout": f.number("timeout", None, lo=0.0, hi=1e9, lo_open=True)}


def _stream_flags(f: _Fields) -> tuple[bool, bool]:
    stream = f.bool("stream", False)
    so = f.obj_("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = _Fields(so, "stream_options.").bool("include_usage", False)
    return stream, include_usage


class _Validator:
    """Turns request JSON into a _Parsed, tokenizing prompts and checking lengths."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tok = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def _ids(self, param: str, ids: list) -> list:
        if not ids:
            raise _bad(param, f"'{param}' is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise _bad(param, f"'{param}' must hold integer token ids, got {_type_name(t)}")
            if t < 0 or t >= self.vocab_size:
                raise _bad(param, f"'{param}' holds token id {t}, outside the vocabulary [0, {self.vocab_size})")
        return list(ids)

    def _encode(self, param: str, text: str, add_special_tokens: bool = True) -> list:
        _check_text(param, text)
        if self.tok is None:
            raise _bad(param, "this server has no tokenizer; send token ids")
        if text == "":
            raise _bad(param, f"'{param}' is empty")
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:
            raise _bad(param, f"'{param}' could not be tokenized: {e}") from None

    def _fit(self, param: str, n_prompt: int, max_tokens: Optional[int], default_cap: Optional[int]) -> int:
        room = self.max_model_len - n_prompt
        if room < 1:
            raise _bad(param, f"the prompt has {n_prompt} tokens; this model's context is "
                              f"{self.max_model_len} tokens, which leaves no room to generate")
        if max_tokens is None:
            return room if default_cap is None else min(room, default_cap)
        if max_tokens > room:
            raise _bad("max_tokens", f"'max_tokens' is {max_tokens}, but the prompt has {n_prompt} tokens "
                                     f"and the context is {self.max_model_len} tokens: at most {room} "
                                     f"can be generated")
        return max_tokens

    def completion(self, body: dict) -> _Parsed:
        f = _Fields(body)
        model = f.str("model")
        n = f.int("n", 1, lo=1, hi=MAX_N)
        max_tokens = f.int("max_tokens", 16, lo=1, hi=1 << 31)
        logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
        echo = f.bool("echo", False)
        if echo and logprobs is not None:
            raise _bad("echo", "'echo' together with 'logprobs' is not supported (no prompt logprobs)")
        if f.obj.get("suffix") not in (None, ""):
            raise _bad("suffix", "'suffix' is not supported by this server")
        stream, include_usage = _stream_flags(f)

        raw = body.get("prompt")
        if raw is None:
            raise _bad("prompt", "'prompt' is required")
        if isinstance(raw, str):
            items = [raw]
        elif isinstance(raw, list):
            if not raw:
                raise _bad("prompt", "'prompt' is empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
                items = [raw]
            elif all(isinstance(p, (str, list)) for p in raw):
                items = raw
            else:
                raise _bad("prompt", "'prompt' must be a string, an array of strings, an array of token ids "
                                     "or an array of token-id arrays")
        else:
            raise _bad("prompt", f"'prompt' must be a string or an array, got {_type_name(raw)}")
        if len(items) > MAX_PROMPTS:
            raise _bad("prompt", f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} are allowed")
        if len(items) * n > MAX_SEQUENCES:
            raise _bad("n", f"{len(items)} prompts x n={n} is more than {MAX_SEQUENCES} sequences")
        prompts = []
        for i, p in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                prompts.append(_Prompt(p, self._encode(param, p)))
            else:
                prompts.append(_Prompt(None, self._ids(param, p)))
        for i, p in enumerate(prompts):
            self._fit("prompt" if len(prompts) == 1 else f"prompt[{i}]", len(p.ids), max_tokens, None)
        kw = _common_sampling(f, max_tokens, logprobs, n)
        return _Parsed("completion", prompts, _make_params(kw), stream, include_usage, logprobs, echo, model,
                       **_load_fields(f))

    def _message_text(self, i: int, content) -> str:
        param = f"messages[{i}].content"
        if content is None:
            return ""
        if isinstance(content, str):
            return _check_text(param, content)
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pp = f"{param}[{j}]"
                if not isinstance(part, dict):
                    raise _bad(pp, f"'{pp}' must be an object, got {_type_name(part)}")
                if part.get("type") != "text":
                    raise _bad(pp, f"'{pp}': only content parts of type 'text' are supported, "
                                   f"got {part.get('type')!r}")
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad(pp + ".text", f"'{pp}.text' must be a string")
                parts.append(_check_text(pp + ".text", text))
            return "".join(parts)
        raise _bad(param, f"'{param}' must be a string or an array of content parts, got {_type_name(content)}")

    def chat(self, body: dict) -> _Parsed:
        f = _Fields(body)
        model = f.str("model")
        n = f.int("n", 1, lo=1, hi=MAX_N)
        mt = f.int("max_completion_tokens", None, lo=1, hi=1 << 31)
        max_tokens = f.int("max_tokens", mt, lo=1, hi=1 << 31)
        want_lp = f.bool("logprobs", False)
        top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
        logprobs = (top or 0) if want_lp else None
        stream, include_usage = _stream_flags(f)
        for key in ("tools", "functions"):
            if f.obj.get(key):
                raise _bad(key, f"'{key}' is not supported by this server")
        rf = f.obj_("response_format")
        if rf is not None and rf.get("type", "text") != "text":
            raise _bad("response_format", "only response_format type 'text' is supported")

        msgs = body.get("messages")
        if msgs is None:
            raise _bad("messages", "'messages' is required")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages", "'messages' must be a non-empty array of {role, content} objects")
        conv = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object, got {_type_name(m)}")
            role = m.get("role")
            if not isinstance(role, str) or role not in _CHAT_ROLES:
                raise _bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(_CHAT_ROLES)}")
            conv.append({"role": role, "content": self._message_text(i, m.get("content"))})
        if self.tok is None:
            raise _bad("messages", "this server has no tokenizer, so chat is unavailable")
        try:
            text = self.tok.apply_chat_template(conv, add_generation_prompt=True)
        except (TypeError, ValueError) as e:
            raise _bad("messages", f"the chat template failed: {e}") from None
        except Exception as e:  # a template's own error (jinja2)
            raise _bad("messages", f"the chat template failed: {type(e).__name__}: {e}") from None
        if getattr(self.tok, "chat_template", None):
            ids = self._encode("messages", text, add_special_tokens=False)
        else:
            ids = self._encode("messages", text)
        max_tokens = self._fit("messages", len(ids), max_tokens, DEFAULT_CHAT_MAX_TOKENS_CAP)
        kw = _common_sampling(f, max_tokens, logprobs, n)
        return _Parsed("chat", [_Prompt(text, ids)], _make_params(kw), stream, include_usage, logprobs,
                       False, model, **_load_fields(f))


# ---------------------------------------------------------------------------- metrics

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
                120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets):
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float):
        if v is None or not math.isfinite(v):
            return
        v = max(v, 0.0)
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v
        self.count += 1

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{{labels},le="{b!r}"}} {acc}')
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{self.name}_count{{{labels}}} {self.count}")
        return out


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """Server-side counters and latency histograms; engine figures come from engine.stats()."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{_label(model_name)}"'
        self.ttft = Histogram("conveyor_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", _TTFT_BUCKETS)
        self.tpot = Histogram("conveyor_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", _TPOT_BUCKETS)
        self.e2e = Histogram("conveyor_e2e_request_latency_seconds",
                             "Time from arrival to the last token.", _E2E_BUCKETS)
        self.finished: dict[str, int] = {}
        self.rejected = 0
        self.http_errors: dict[int, int] = {}
        self.disconnects = 0

    def record(self, metrics, n_tokens: int, finish_reason: Optional[str]):
        if finish_reason:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
        if metrics is None:
            return
        a, ft, fin = metrics.arrival_time, metrics.first_token_time, metrics.finished_time
        if ft is not None:
            self.ttft.observe(ft - a)
        if fin is not None:
            self.e2e.observe(fin - a)
        if ft is not None and fin is not None and n_tokens > 1:
            self.tpot.observe((fin - ft) / (n_tokens - 1))

    def render(self, stats: dict, in_flight: int) -> str:
        L = self.labels
        lines: list[str] = []

        def metric(name, kind, help_, value, extra=""):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lab = L + ("," + extra if extra else "")
            lines.append(f"{name}{{{lab}}} {value!r}" if isinstance(value, float) else f"{name}{{{lab}}} {value}")

        g = stats.get
        total = g("blocks_total", 0) or 0
        used = g("blocks_used", 0) or 0
        q = g("prefix_queries", 0) or 0
        h = g("prefix_hits", 0) or 0
        metric("conveyor_num_requests_running", "gauge", "Requests in the running batch.", g("num_running", 0))
        metric("conveyor_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", g("num_waiting", 0))
        metric("conveyor_num_requests_queued", "gauge",
               "Requests not yet scheduled once (what max_queued_requests limits).", g("num_queued", 0))
        metric("conveyor_num_preemptions_total", "counter", "Preemptions since start.", g("num_preemptions", 0))
        metric("conveyor_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full).",
               float(used / total) if total else 0.0)
        metric("conveyor_kv_cache_blocks_used", "gauge", "KV blocks held by requests.", used)
        metric("conveyor_kv_cache_blocks_total", "gauge", "KV blocks in the pool.", total)
        metric("conveyor_kv_cache_blocks_cached_free", "gauge", "Free KV blocks still holding cached prefixes.",
               g("blocks_cached_free", 0))
        metric("conveyor_kv_cache_waste", "gauge", "1 - tokens held / allocated slots.", float(g("kv_waste", 0.0)))
        metric("conveyor_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", q)
        metric("conveyor_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", h)
        metric("conveyor_prefix_cache_hit_rate", "gauge", "prefix_cache_hits / prefix_cache_queries.",
               float(h / q) if q else 0.0)
        metric("conveyor_prompt_tokens_total", "counter", "Prompt tokens processed.", g("prompt_tokens", 0))
        metric("conveyor_generation_tokens_total", "counter", "Tokens generated.", g("generation_tokens", 0))
        metric("conveyor_requests_finished_total", "counter", "Engine requests finished.",
               g("requests_finished", 0))
        metric("conveyor_requests_aborted_total", "counter", "Engine requests aborted (e.g. disconnects).",
               g("requests_aborted", 0))
        lines.append("# HELP conveyor_request_success_total Requests answered, by finish reason.")
        lines.append("# TYPE conveyor_request_success_total counter")
        for reason in sorted(set(self.finished) | {"stop", "length"}):
            lines.append(f'conveyor_request_success_total{{{L},finished_reason="{_label(reason)}"}} '
                         f"{self.finished.get(reason, 0)}")
        metric("conveyor_requests_rejected_total", "counter",
               "Requests refused with 503 (queue full: max_queued_requests).", self.rejected)
        metric("conveyor_requests_timed_out_total", "counter",
               "Engine requests ended past their deadline (timeout, --request-timeout).",
               g("requests_timed_out", 0))
        metric("conveyor_client_disconnects_total", "counter", "Requests whose client went away before the end.",
               self.disconnects)
        metric("conveyor_server_requests_in_flight", "gauge", "HTTP generation requests being served.", in_flight)
        lines.append("# HELP conveyor_http_errors_total Error answers, by HTTP status.")
        lines.append("# TYPE conveyor_http_errors_total counter")
        for status in sorted(self.http_errors):
            lines.append(f'conveyor_http_errors_total{{{L},status="{status}"}} {self.http_errors[status]}')
        for hist in (self.ttft, self.tpot, self.e2e):
            lines.extend(hist.render(L))
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- responses


def _json_response(obj, status: int = 200, headers: Optional[dict] = None):
    from starlette.responses import Response

    # "replace": a lone surrogate echoed from the request must not break the answer.
    body = _dumps(obj).encode("utf-8", errors="replace")
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _error_response(err: APIError):
    headers = dict(err.headers or {})
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _json_response(err.body(), err.status, headers or None)


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _SSEResponse:
    """Streams `data: ...` events from an async iterator of str; a client that goes away
    cancels the stream (and with it the engine requests) at once."""

    def __init__(self, events: AsyncIterator[str], on_disconnect=None, on_end=None):
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_end = on_end

    async def _stream(self, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        try:
            async for ev in self.events:
                await send({"type": "http.response.body", "body": ev.encode("utf-8"), "more_body": True})
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send):
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done:
                stream.cancel()
                if self.on_disconnect is not None:
                    self.on_disconnect()
            try:
                await stream
            except (asyncio.CancelledError, OSError):
                pass
        finally:
            for t in (stream, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            if self.on_end is not None:
                self.on_end()


# ---------------------------------------------------------------------------- the server


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class _Server:
    def __init__(self, engine, model_name: str, api_key: Optional[str], request_timeout: Optional[float],
                 max_body_bytes: int):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.max_body_bytes = int(max_body_bytes)
        self.tok = engine.tokenizer
        st = engine.stats()
        self.max_model_len = int(st.get("max_model_len") or engine.model_config.get("max_pos") or 2048)
        self.vocab_size = int(engine.model_config["vocab_size"])
        self.validator = _Validator(self.tok, self.vocab_size, self.max_model_len)
        self.metrics = ServerMetrics(model_name)
        self.created = int(time.time())
        self.in_flight = 0   # HTTP generation requests being answered
        self._piece_cache: dict[int, tuple[str, list]] = {}

    # -- request plumbing -------------------------------------------------
    def check_auth(self, request):
        if self.api_key is None:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "replace"),
                                                                  self.api_key.encode("utf-8")):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def read_json(self, request) -> dict:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise _bad("body", "the Content-Length header is not an integer") from None
            if n > self.max_body_bytes:
                raise APIError(413, f"the request body has {n} bytes; the limit is {self.max_body_bytes}",
                               code="body_too_large")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > self.max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {self.max_body_bytes} bytes",
                               code="body_too_large")
        try:
            text = bytes(buf).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad("body", f"the request body is not valid UTF-8 (at byte {e.start})") from None

        def no_constants(c):
            raise ValueError(f"{c} is not valid JSON")

        try:
            body = json.loads(text, parse_constant=no_constants)
        except (ValueError, RecursionError) as e:
            raise _bad("body", f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("body", f"the request body must be a JSON object, got {_type_name(body)}")
        return body

    def check_model(self, model: Optional[str]):
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def start(self, parsed: _Parsed, rid: str, params: SamplingParams) -> list:
        """Adds every prompt's request to the engine now, before any response starts, so
        that a full queue is answered 503 (with Retry-After) at once and a refused request
        400; all or nothing. Returns the RequestStreams; the caller closes them."""
        from . import EngineOverloadedError

        timeout = parsed.timeout if parsed.timeout is not None else self.request_timeout
        streams = []
        try:
            for i, p in enumerate(parsed.prompts):
                streams.append(self.engine.add_request({"prompt": p.text, "prompt_token_ids": p.ids}, params,
                                                       request_id=f"{rid}-{i}", priority=parsed.priority,
                                                       timeout=timeout))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, EngineOverloadedError):
                self.metrics.rejected += 1
                raise APIError(503, f"the server is overloaded: {e}", code="server_overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(e, (ValueError, TypeError)):  # the engine refused the request
                raise _bad(getattr(e, "field", None) or "body", str(e)) from None
            raise
        return streams

    def piece(self, tid: int) -> tuple[str, list]:
        p = self._piece_cache.get(tid)
        if p is None:
            b = b""
            if self.tok is not None:
                try:
                    b = self.tok.token_bytes(tid)
                except Exception:
                    b = b""
            p = (b.decode("utf-8", errors="replace"), list(b))
            if len(self._piece_cache) < 1_000_000:
                self._piece_cache[tid] = p
        return p

    # -- generation -------------------------------------------------------
    @staticmethod
    async def _merged(streams: list):
        """Yields (prompt index, RequestOutput) from every prompt's stream."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def feed(i, stream):
            try:
                async for out in stream:
                    q.put_nowait((i, out, None))
                q.put_nowait((i, None, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                q.put_nowait((i, None, e))
                if isinstance(e, asyncio.CancelledError):
                    raise

        tasks = [asyncio.ensure_future(feed(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                i, out, err = await q.get()
                if err is not None:
                    raise err
                if out is None:
                    left -= 1
                    continue
                yield i, out
        finally:
            started = [t for t in tasks if not t.done()]
            for t in started:
                t.cancel()
            if started:
                await asyncio.gather(*started, return_exceptions=True)

    def _completion_logprobs(self, lps, token_ids, offset0: int):
        if lps is None:
            return None, offset0
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tid, entry in zip(token_ids, lps):
            s = self.piece(tid)[0]
            tokens.append(s)
            lp = entry.get(tid)
            token_lps.append(_finite(lp.logprob) if lp is not None else None)
            tops.append({self.piece(t)[0]: _finite(v.logprob) for t, v in entry.items()})
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}, off

    def _chat_logprobs(self, lps, token_ids, top_n: int):
        if lps is None:
            return None
        content = []
        for tid, entry in zip(token_ids, lps):
            s, b = self.piece(tid)
            lp = entry.get(tid)
            ranked = sorted(((v.rank, t, v) for t, v in entry.items() if v.rank is not None),
                            key=lambda x: x[0])[:top_n]
            content.append({
                "token": s, "logprob": _finite(lp.logprob) if lp is not None else -9999.0, "bytes": b,
                "top_logprobs": [{"token": self.piece(t)[0], "logprob": _finite(v.logprob),
                                  "bytes": self.piece(t)[1]} for _, t, v in ranked],
            })
        return {"content": content}

    def _record(self, out, n_tokens: list[int]):
        reasons = [o.finish_reason for o in out.outputs]
        reason = "length" if "length" in reasons else (reasons[0] if reasons else None)
        self.metrics.record(out.metrics, max(n_tokens) if n_tokens else 0, reason)

    async def generate_full(self, streams: list, parsed: _Parsed, rid: str):
        """Runs a request to the end; returns the response body."""
        n = parsed.params.n
        finals: dict[int, Any] = {}
        async with aclosing(self._merged(streams)) as outs:
            async for i, out in outs:
                if out.finished:
                    finals[i] = out
                    self._record(out, [len(o.token_ids) for o in out.outputs])
        choices = []
        prompt_tokens = completion_tokens = 0
        chat = parsed.kind == "chat"
        for i in range(len(parsed.prompts)):
            out = finals[i]
            prompt_tokens += len(out.prompt_token_ids)
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                idx = i * n + o.index
                if chat:
                    choices.append({
                        "index": idx, "message": {"role": "assistant", "content": o.text},
                        "logprobs": self._chat_logprobs(o.logprobs, o.token_ids, parsed.logprobs or 0),
                        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
                else:
                    text = o.text
                    if parsed.echo:
                        text = self._prompt_text(parsed.prompts[i]) + text
                    lp, _ = self._completion_logprobs(o.logprobs, o.token_ids, 0)
                    choices.append({"index": idx, "text": text, "logprobs": lp,
                                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is not None:
            return p.text
        return self.tok.decode(p.ids) if self.tok is not None else ""

    def _stream_choices(self, parsed: _Parsed, i: int, out, tokens, offsets, done) -> list:
        """The chunk choices for one delta RequestOutput of prompt i; updates the per-choice state."""
        n = parsed.params.n
        chat = parsed.kind == "chat"
        choices = []
        for o in out.outputs:
            j = i * n + o.index
            if done[j]:
                continue
            fin = o.finish_reason if o.finish_reason not in (None, "abort") else None
            if not o.token_ids and not o.text and fin is None:
                continue
            tokens[j] += len(o.token_ids)
            tail = {"stop_reason": o.stop_reason} if fin else {}
            if chat:
                delta = {"content": o.text} if (o.text or fin is None) else {}
                lp = self._chat_logprobs(o.logprobs, o.token_ids, parsed.logprobs or 0)
                choices.append({"index": j, "delta": delta, "logprobs": lp, "finish_reason": fin, **tail})
            else:
                lp, offsets[j] = self._completion_logprobs(o.logprobs, o.token_ids, offsets[j])
                choices.append({"index": j, "text": o.text, "logprobs": lp, "finish_reason": fin, **tail})
            if fin is not None:
                done[j] = True
        return choices

    async def _single_events(self, stream, enc: ChunkEncoder, usage: list) -> AsyncIterator[str]:
        """The common stream (one prompt, n=1, no logprobs): every output delivered since
        the last write becomes one template-encoded event, and all of them one write."""
        tokens = 0
        done = False
        while True:
            outs = await stream.next_batch()
            if not outs:
                break
            parts = []
            for out in outs:
                o = out.outputs[0]
                fin = o.finish_reason if o.finish_reason not in (None, "abort") else None
                if not done and (o.token_ids or o.text or fin is not None):
                    tokens += len(o.token_ids)
                    parts.append(enc.event(o.text, fin, o.stop_reason))
                    done = fin is not None
                if out.finished:
                    usage[0] += len(out.prompt_token_ids)
                    self._record(out, [tokens])
            usage[1] = tokens
            if parts:
                yield "".join(parts)

    async def generate_stream(self, streams: list, parsed: _Parsed, rid: str) -> AsyncIterator[str]:
        n = parsed.params.n
        chat = parsed.kind == "chat"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_null = parsed.include_usage
        n_choices = len(parsed.prompts) * n
        tokens = [0] * n_choices
        offsets = [0] * n_choices
        done = [False] * n_choices
        prompt_tokens = 0

        def chunk(choices, usage=None):
            c = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if usage is not None or usage_null:
                c["usage"] = usage
            return f"data: {_dumps(c)}\n\n"

        try:
            if chat:
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in range(n_choices)])
            elif parsed.echo:
                yield chunk([{"index": i * n + k, "text": self._prompt_text(p), "logprobs": None,
                              "finish_reason": None} for i, p in enumerate(parsed.prompts) for k in range(n)])
            if len(streams) == 1 and n == 1 and parsed.logprobs is None:
                usage = [0, 0]
                enc = ChunkEncoder(rid, created, self.model_name, chat, parsed.include_usage)
                async with aclosing(self._single_events(streams[0], enc, usage)) as events:
                    async for ev in events:
                        yield ev
                prompt_tokens, tokens[0] = usage
            else:
                async with aclosing(self._merged(streams)) as outs:
                    async for i, out in outs:
                        choices = self._stream_choices(parsed, i, out, tokens, offsets, done)
                        if out.finished:
                            prompt_tokens += len(out.prompt_token_ids)
                            self._record(out, tokens[i * n:(i + 1) * n])
                        if choices:
                            yield chunk(choices)
            if parsed.include_usage:
                comp = sum(tokens)
                yield chunk([], {"prompt_tokens": prompt_tokens, "completion_tokens": comp,
                                 "total_tokens": prompt_tokens + comp})
        except APIError as e:
            yield f"data: {_dumps(e.body())}\n\n"
        except (ValueError, TypeError) as e:  # the engine refused the request
            yield f"data: {_dumps(_bad('body', str(e)).body())}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream has begun: report in-band, then end it
            from . import EngineClosedError

            if isinstance(e, EngineClosedError):
                err = APIError(503, "the engine is shut down", code="engine_closed")
            else:
                logging.getLogger("conveyor.serve").exception("internal error while streaming")
                err = APIError(500, f"internal error: {type(e).__name__}: {e}")
            yield f"data: {_dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    # -- endpoints --------------------------------------------------------
    async def handle_generate(self, request, kind: str):
        self.check_auth(request)
        body = await self.read_json(request)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model", f"'model' must be a string, got {_type_name(model)}")
        if model is not None:
            _check_text("model", model)
        self.check_model(model)
        parsed = self.validator.completion(body) if kind == "completion" else self.validator.chat(body)
        if self.engine.closed:
            raise APIError(503, "the engine is shut down", code="engine_closed")
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        streams = self.start(parsed, rid, parsed.params.clone(output_kind="delta" if parsed.stream else "final_only"))
        if parsed.stream:
            return self._stream_response(streams, parsed, rid)
        self.in_flight += 1
        try:
            gen = asyncio.ensure_future(self.generate_full(streams, parsed, rid))
        except BaseException:
            self.in_flight -= 1
            for s in streams:
                s.close()
            raise
        watch = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
            if gen not in done:
                # The client went away: cancelling aborts the engine requests.
                self.metrics.disconnects += 1
                gen.cancel()
                await asyncio.gather(gen, return_exceptions=True)
                return _json_response({"error": {"message": "client disconnected", "type": "aborted",
                                                  "param": None, "code": None}}, 499)
            try:
                result = gen.result()
            except (ValueError, TypeError) as e:  # the engine refused the request
                raise _bad("body", str(e)) from None
            return _json_response(result)
        except BaseException:
            if not gen.done():
                gen.cancel()
            raise
        finally:
            self.in_flight -= 1
            for s in streams:  # aborts what did not finish (a disconnect, an error)
                s.close()
            if not watch.done():
                watch.cancel()

    def _stream_response(self, streams: list, parsed: _Parsed, rid: str):
        server = self

        def on_disconnect():
            server.metrics.disconnects += 1

        def on_end():
            server.in_flight -= 1
            for s in streams:  # also when the response never started streaming
                s.close()

        server.in_flight += 1
        return _SSEResponse(server.generate_stream(streams, parsed, rid), on_disconnect, on_end)


def build_app(engine, *, model_name: str, api_key: Optional[str] = None, request_timeout: Optional[float] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The ASGI app serving `engine` (an AsyncLLM) under the name `model_name`.

    api_key: when set, /v1/* needs "Authorization: Bearer <api_key>".
    request_timeout: the deadline (seconds) of a request that names no "timeout".
    max_body_bytes: larger bodies get 413. Overload control is the engine's: an AsyncLLM
    made with max_queued_requests refuses the excess, answered 503 with Retry-After.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    if not isinstance(model_name, str) or not model_name:
        raise ValueError("model_name must be a non-empty string")
    if request_timeout is not None and not (isinstance(request_timeout, (int, float)) and
                                            not isinstance(request_timeout, bool) and 0 < request_timeout <= 1e9):
        raise ValueError(f"request_timeout must be a number of seconds in (0, 1e9], got {request_timeout!r}")
    server = _Server(engine, model_name, api_key, request_timeout, max_body_bytes)

    def guarded(fn):
        async def endpoint(request):
            try:
                return await fn(request)
            except APIError as e:
                if e.status >= 400:
                    server.metrics.http_errors[e.status] = server.metrics.http_errors.get(e.status, 0) + 1
                return _error_response(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never a bare 500 page
                from . import EngineClosedError

                if isinstance(e, EngineClosedError):
                    return _error_response(APIError(503, "the engine is shut down", code="engine_closed"))
                logging.getLogger("conveyor.serve").exception("internal error")
                return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                type_="server_error"))
        return endpoint

    async def completions(request):
        return await server.handle_generate(request, "completion")

    async def chat_completions(request):
        return await server.handle_generate(request, "chat")

    def model_card():
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "conveyor",
                "root": server.model_name, "parent": None, "max_model_len": server.max_model_len,
                "vocab_size": server.vocab_size}

    async def models(request):
        server.check_auth(request)
        return _json_response({"object": "list", "data": [model_card()]})

    async def model_one(request):
        server.check_auth(request)
        server.check_model(request.path_params["model"])
        return _json_response(model_card())

    async def health(request):
        if engine.closed:
            return _json_response({"status": "closed"}, 503)
        return _json_response({"status": "ok"})

    async def metrics(request):
        try:
            stats = engine.stats()
        except Exception:  # noqa: BLE001 - a closed engine still answers /metrics
            stats = {}
        text = server.metrics.render(stats, server.in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request, exc):
        msg = {404: f"no route for {request.url.path}", 405: f"method {request.method} not allowed here"}
        err = APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)))
        if exc.status_code == 404:
            err.type = "not_found_error"
        return _error_response(err)

    routes = [
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model_one), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app


# ---------------------------------------------------------------------------- CLI


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor serve", description="Run the OpenAI-compatible HTTP server.")
    p.add_argument("model", help="a HF model folder or a llama2.c .bin file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $CONVEYOR_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="answer 503 (with Retry-After) to a request that would make more than this many wait "
                        "to be scheduled; 0: no limit")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="deadline in seconds of a request without 'timeout'; past it the request ends with "
                        "finish_reason 'timeout' (default: none)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="answer 413 to larger request bodies")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--kv-cache-memory", default=None, help="bytes or a size such as 4GiB")
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--scheduling", default=None, choices=["continuous", "static", "priority"])
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--device", default=None, choices=["cpu", "cuda"])
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                   help="prompt tokens per step while sequences decode (default 64 on the CPU, 512 on CUDA; 0: "
                        "no cap)")
    return p


_ENGINE_KNOBS = ("tokenizer", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_memory", "kv_cache_dtype", "enable_prefix_caching", "enable_chunked_prefill",
                 "scheduling", "num_threads", "device", "seed", "gpu_memory_utilization",
                 "max_prefill_tokens_while_decoding")


def engine_kwargs(args) -> dict:
    """The AsyncLLM keyword arguments of parsed `conveyor serve` arguments."""
    knobs = {k: getattr(args, k) for k in _ENGINE_KNOBS if getattr(args, k) is not None}
    knobs["max_queued_requests"] = args.max_queued_requests or None
    return knobs


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        import uvicorn
        import starlette  # noqa: F401
    except ImportError as e:
        print(f"conveyor serve: needs the server extra ({e.name} is missing): pip install 'conveyor[server]'",
              file=sys.stderr)
        return 1
    if not (0 <= args.port <= 65535):
        print(f"conveyor serve: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.max_queued_requests < 0 or args.max_body_bytes < 1:
        print("conveyor serve: --max-queued-requests must be >= 0 and --max-body-bytes >= 1", file=sys.stderr)
        return 2
    if args.request_timeout is not None and not (0 < args.request_timeout <= 1e9):
        print("conveyor serve: --request-timeout must be in (0, 1e9] seconds", file=sys.stderr)
        return 2
    from . import AsyncLLM, ConveyorError

    knobs = engine_kwargs(args)
    try:
        engine = AsyncLLM(args.model, **knobs)
    except (OSError, ValueError, TypeError, ConveyorError) as e:
        print(f"conveyor serve: cannot load the model: {e}", file=sys.stderr)
        return 1
    name = args.served_model_name or args.model
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"conveyor serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    app = build_app(engine, model_name=name, api_key=args.api_key, request_timeout=args.request_timeout,
                    max_body_bytes=args.max_body_bytes)
    try:
        # Bound here, not by uvicorn, so that --port 0 works: the line below names the real port.
        sock = _bind(args.host, args.port)
    except OSError as e:
        engine.close()
        print(f"conveyor serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                            timeout_graceful_shutdown=5)
    print(f"conveyor serve: serving {name} at http://{shown}:{port}/v1", file=sys.stderr, flush=True)
    import signal

    def _exit(signum, frame):
        raise SystemExit(0)

    # uvicorn shuts down gracefully, then re-raises the signal it caught: exit through
    # Python so that the engine below is closed.
    signal.signal(signal.SIGTERM, _exit)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        engine.close()
    return 0


def _bind(host: str, port: int):
    import socket

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    # proto must be IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY on accepted sockets only
    # then, and without it Nagle holds each streamed chunk for the client's delayed ACK.
    sock = socket.socket(family, socktype, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


if __name__ == "__main__":
    raise SystemExit(main())
