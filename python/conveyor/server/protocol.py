"""The server's protocol: OpenAI request fields read into SamplingParams and
prompts, and errors in OpenAI's shape. Types and the server's own limits only:
the engine (check_request) decides every range and answers with the field."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from ..guided import GuidedDecodingParams
from ..request_budget import REQUEST_BUDGET_BYTES, SEQUENCE_BYTES, RequestBudget
from ..sampling_params import SamplingParams
from ..tokenizer_base import message_text

DEFAULT_MAX_QUEUED_REQUESTS = 1024
# Bodies past 4x the default request budget (request_budget.py) could only be refused
# by it, and parsing JSON holds the GIL (~4 ms a MB, more on a busy machine): they get
# 413 unread.
DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_N = 128                 # choices per prompt
MAX_PROMPTS = 256           # prompts in one batched completions request
MAX_SEQUENCES = 1024        # prompts x n in one request
MAX_STOP = 16
MAX_LOGIT_BIAS = 1024       # logit_bias entries
MAX_ALLOWED_IDS = 1 << 16   # allowed_token_ids entries
DEFAULT_CHAT_MAX_TOKENS_CAP = 4096
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.headers = headers  # extra response headers (Retry-After)
        self.message = message
        self.param = param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 405: "invalid_request_error",
                              413: "invalid_request_error", 415: "invalid_request_error",
                              499: "invalid_request_error", 503: "service_unavailable_error"
                              }.get(status, "server_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------------------- validation


def type_name(v) -> str:
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


def check_text(param: str, s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(param, f"'{param}' contains invalid Unicode (a lone surrogate)") from None
    return s


class Fields:
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
            raise bad_request(self.name(key), f"'{self.name(key)}' must be an integer, got {type_name(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(self.name(key), f"'{self.name(key)}' must be in [{lo if lo is not None else '-inf'}, "
                                       f"{hi if hi is not None else 'inf'}], got {v}")
        return v

    def number(self, key, default=None, lo=None, hi=None, lo_open=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad_request(self.name(key), f"'{self.name(key)}' must be a number, got {type_name(v)}")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        ok = math.isfinite(f) and (lo is None or (f > lo if lo_open else f >= lo)) and (hi is None or f <= hi)
        if not ok:
            left = "(" if lo_open else "["
            raise bad_request(self.name(key), f"'{self.name(key)}' must be a finite number in {left}"
                                       f"{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], "
                                       f"got {v!r}")
        return f

    def bool(self, key, default=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(self.name(key), f"'{self.name(key)}' must be a boolean, got {type_name(v)}")
        return v

    def str(self, key, default=None):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad_request(self.name(key), f"'{self.name(key)}' must be a string, got {type_name(v)}")
        return check_text(self.name(key), v)

    def obj_(self, key) -> Optional[dict]:
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise bad_request(self.name(key), f"'{self.name(key)}' must be an object, got {type_name(v)}")
        return v


@dataclass
class Prompt:
    text: Optional[str]
    ids: list


@dataclass
class Parsed:
    """A validated request: prompts, sampling, and how to answer."""

    kind: str                       # "completion" or "chat"
    prompts: list                   # [Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # completions: top-N; chat: top_logprobs (when logprobs is on)
    echo: bool = False
    model: Optional[str] = None
    priority: int = 0                # vLLM's extension: lower runs first under scheduling="priority"
    timeout: Optional[float] = None  # seconds from arrival; past it: finish_reason "timeout"
    tool_call: Optional["ToolCall"] = None  # chat: answer with tool_calls (named or required)
    auto_tools: Optional["AutoTools"] = None  # chat: tool_choice "auto", calls read by the tool parser
    prompt_only: bool = False       # completions max_tokens 0 (with echo): no completion tokens
    renames: Optional[dict] = None  # engine error fields -> this request's fields (guided_decoding -> guided_regex)
    guided: Optional[list] = None   # per prompt: AsyncLLM.prepare_guided's matchers (built off the loop)


@dataclass
class ToolCall:
    """Function calling through guided decoding: `name` set -> the output is
    that function's arguments; None ("required") -> {"name", "arguments"} of
    one of the tools."""

    name: Optional[str]
    tools: dict  # name -> parameters schema


@dataclass
class AutoTools:
    """tool_choice "auto": the model answers with text or with calls in its own format,
    which `parser` (a conveyor.server.tool_parsers parser) reads."""

    tools: dict  # name -> {"description", "parameters"}
    parser: object
    parallel: bool = True  # parallel_tool_calls: False keeps only an answer's first call


def _parse_stop(f: Fields):
    v = f.obj.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("stop", "'stop' must be a string or an array of strings")
    if len(v) > MAX_STOP:
        raise bad_request("stop", f"'stop' has {len(v)} entries; at most {MAX_STOP} are allowed")
    for s in v:
        if s == "":
            raise bad_request("stop", "'stop' must not contain an empty string")
        check_text("stop", s)
    return v or None


def _int_list(f: Fields, key: str, limit: int) -> Optional[list]:
    v = f.obj.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(key, f"'{key}' must be an array of integers")
    if len(v) > limit:
        raise bad_request(key, f"'{key}' may hold at most {limit} entries")
    return v


def _logit_controls(f: Fields, n: int, allow_best_of: bool) -> dict:
    """logit_bias (OpenAI sends token ids as string keys), allowed_token_ids,
    bad_words, best_of (completions). Types only: the engine checks ranges."""
    kw: dict = {}
    lb = f.obj.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise bad_request("logit_bias", f"'logit_bias' must be an object {{token id: bias}}, got {type_name(lb)}")
        if len(lb) > MAX_LOGIT_BIAS:
            raise bad_request("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries")
        bias = {}
        for k, v in lb.items():
            try:
                tid = int(k, 10) if isinstance(k, str) else None
            except ValueError:
                tid = None
            if tid is None or not k.strip().lstrip("-").isdigit():
                raise bad_request("logit_bias", f"'logit_bias' keys must be token ids (integers), got {k!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad_request("logit_bias", f"'logit_bias' values must be numbers, got {type_name(v)} "
                                                f"for {k!r}")
            bias[tid] = v
        kw["logit_bias"] = bias or None
    ids = _int_list(f, "allowed_token_ids", MAX_ALLOWED_IDS)
    if ids is not None:
        kw["allowed_token_ids"] = ids
    bw = f.obj.get("bad_words")
    if bw is not None:
        if not isinstance(bw, list) or not all(isinstance(w, str) for w in bw):
            raise bad_request("bad_words", "'bad_words' must be an array of strings")
        kw["bad_words"] = [check_text("bad_words", w) for w in bw] or None
    bo = f.obj.get("best_of")
    if bo is not None:
        if not allow_best_of and bo != n:
            raise bad_request("best_of", "'best_of' is only supported on /v1/completions")
        kw["best_of"] = f.int("best_of", None, lo=1, hi=MAX_N)
    return kw


def _common_sampling(f: Fields, max_tokens: Optional[int], logprobs: Optional[int], n: int,
                     allow_best_of: bool = False) -> dict:
    """The request fields every endpoint maps onto SamplingParams. Types only:
    the C engine checks every range (see _make_params)."""
    kw = dict(
        n=n,
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0),
        top_p=f.number("top_p", 1.0),
        top_k=f.int("top_k", 0),
        min_p=f.number("min_p", 0.0),
        repetition_penalty=f.number("repetition_penalty", 1.0),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
        seed=f.int("seed", None),
        stop=_parse_stop(f),
        ignore_eos=f.bool("ignore_eos", False),
        min_tokens=f.int("min_tokens", 0),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        logprobs=logprobs,
    )
    sti = f.obj.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
            raise bad_request("stop_token_ids", "'stop_token_ids' must be an array of integers")
        if len(sti) > 64:
            raise bad_request("stop_token_ids", "'stop_token_ids' may hold at most 64 ids")
        kw["stop_token_ids"] = sti
    kw.update(_logit_controls(f, n, allow_best_of))
    return kw


_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _guided(f: Fields, tool_schema=None) -> tuple[Optional[dict], Optional[str]]:
    """The guided-decoding request (vLLM's guided_* fields, OpenAI's
    response_format, or a tool-call schema) as GuidedDecodingParams fields,
    and the body field it came from."""
    found = []
    for key in _GUIDED_FIELDS:
        if f.obj.get(key) is not None:
            found.append(key)
    rf = f.obj_("response_format")
    rf_type = None
    if rf is not None:
        rf_type = rf.get("type", "text")
        if rf_type not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format", "response_format type must be 'text', 'json_object' or "
                                                 f"'json_schema', got {rf_type!r}")
        if rf_type != "text":
            found.append("response_format")
    if tool_schema is not None:
        found.append("tools")
    if len(found) > 1:
        raise bad_request(found[1], f"only one of {', '.join(found)} may be given")
    if not found:
        return None, None
    key = found[0]
    if key == "tools":
        return {"json": tool_schema}, "tools"
    if key == "response_format":
        if rf_type == "json_object":
            return {"json_object": True}, key
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request("response_format", "response_format.json_schema must be an object with a 'schema' "
                                                 "object (and a 'name')")
        return {"json": js.get("schema", {"type": "object"})}, key
    v = f.obj[key]
    if isinstance(v, str):
        check_text(key, v)
    elif isinstance(v, list):
        for c in v:
            if isinstance(c, str):
                check_text(key, c)
    if key == "guided_json":
        if not isinstance(v, (dict, str)):
            raise bad_request(key, f"'{key}' must be a JSON schema (an object or a string)")
        return {"json": v}, key
    if key == "guided_choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad_request(key, f"'{key}' must be a non-empty array of non-empty strings")
        return {"choice": v}, key
    if not isinstance(v, str) or not v:
        raise bad_request(key, f"'{key}' must be a non-empty string")
    return {"regex" if key == "guided_regex" else "grammar": v}, key


def _tools(f: Fields, parser=None):
    """tools + tool_choice: a named function or "required" -> a ToolCall (guided
    decoding); "auto" (the default when tools are given) -> AutoTools read by `parser`;
    "none" (or no tools) -> None."""
    if f.obj.get("functions"):
        raise bad_request("functions", "'functions' is deprecated and not supported; use 'tools'")
    tools = f.obj.get("tools")
    choice = f.obj.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "'tools' must be an array of {type: 'function', function: {...}} objects")
    by_name: dict = {}
    described: dict = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("tools", f"'tools[{i}]' must be {{type: 'function', function: {{name, parameters}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters", "function parameters must be a JSON schema object")
        _check_tool_schema(i, params)
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad_request(f"tools[{i}].function.description", "a function's description must be a string")
        if fn["name"] in by_name:
            raise bad_request(f"tools[{i}].function.name", f"two tools are named {fn['name']!r}")
        by_name[fn["name"]] = params
        described[fn["name"]] = {"description": check_text(f"tools[{i}].function.description", description),
                                 "parameters": params}
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if parser is None:
            raise bad_request("tool_choice", "tool_choice 'auto' needs a tool-call parser, which this server "
                                             "has not; use 'required' or {type: 'function', function: {name}}")
        parallel = f.obj.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise bad_request("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
        return AutoTools(described, parser, parallel)
    if choice == "required":
        return ToolCall(None, by_name)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in by_name:
            raise bad_request("tool_choice", f"tool_choice names function {name!r}, which is not among 'tools'")
        return ToolCall(name, by_name)
    raise bad_request("tool_choice", "tool_choice must be 'none', 'required', 'auto' or "
                                     "{type: 'function', function: {name}}")


def _check_tool_schema(i: int, params: dict) -> None:
    """A tool's parameters must compile as a JSON schema whatever tool_choice is: under
    "auto" the model may call any tool, and its arguments are read against them."""
    try:
        GuidedDecodingParams(json=params)
    except ValueError as e:
        reason = str(e).removeprefix("guided_decoding.json: ")
        raise bad_request(f"tools[{i}].function.parameters",
                          f"tools[{i}].function.parameters is not a JSON schema this server can follow: {reason}")


def _history_tool_calls(i: int, calls) -> list:
    """An assistant message's tool_calls, as [{"name", "arguments": dict}] for a parser
    to write in the model's format."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(param, f"'{param}' must be an array")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{param}[{j}]", f"'{param}[{j}]' must be {{type: 'function', function: "
                                               "{name, arguments}}")
        args = fn.get("arguments") or "{}"
        arg_param = f"{param}[{j}].function.arguments"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad_request(arg_param, f"'{arg_param}' must be a JSON object")
        out.append({"name": fn["name"], "arguments": args})
    return out


def _with_tools_prompt(conv: list, auto: "AutoTools") -> list:
    """The conversation with the tools described in its system message, in the words of
    the parser's format (the chat template is given messages only)."""
    prompt = auto.parser.system_prompt(auto.tools)
    if conv and conv[0]["role"] in ("system", "developer"):
        return [{"role": conv[0]["role"], "content": prompt + "\n\n" + conv[0]["content"]}] + conv[1:]
    return [{"role": "system", "content": prompt}] + conv


def _tool_schema(tc: ToolCall) -> dict:
    if tc.name is not None:
        return tc.tools[tc.name]
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for n, p in tc.tools.items()]}


def _with_guided(kw: dict, f: Fields, tool: Optional[ToolCall] = None) -> tuple[dict, dict]:
    """kw with guided_decoding set from the body; the rename of its error field."""
    g, source = _guided(f, _tool_schema(tool) if tool is not None else None)
    if g is None:
        return kw, {}
    return {**kw, "guided_decoding": g}, {"guided_decoding": source}


def refused(e: Exception, renames: Optional[dict] = None) -> APIError:
    """The engine's refusal (ValueError/TypeError whose .field names the
    request field) as a 400; renames maps engine fields to this endpoint's."""
    field_name = getattr(e, "field", None)
    return bad_request((renames or {}).get(field_name, field_name) or "body", str(e))


def _make_params(kw: dict, renames: Optional[dict] = None) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise refused(e, renames) from None


def _load_fields(f: Fields) -> dict:
    """The serving-under-load fields of any generation request, types only (the engine
    checks the ranges when the request is added): priority and timeout."""
    return {"priority": f.int("priority", 0), "timeout": f.number("timeout", None)}


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.bool("stream", False)
    so = f.obj_("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise bad_request("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = Fields(so, "stream_options.").bool("include_usage", False)
    return stream, include_usage


# The fields charged against a request's byte budget, in this order (the one that goes
# over is named): what the client sends for the engine to tokenize, compile or copy.
_BUDGET_FIELDS = ("prompt", "messages", "tools", "tool_choice", "bad_words", "stop", "stop_token_ids",
                  "logit_bias", "allowed_token_ids", *_GUIDED_FIELDS, "response_format")


def charge_request_budget(body: dict, budget: Optional[RequestBudget] = None,
                          check_prompt_size=None) -> RequestBudget:
    """Charges every field of a request body that costs work by its size, and its
    sequences (prompts x max(n, best_of)), against one budget, before anything is
    tokenized or compiled: a 400 naming the field that goes over. A text prompt too
    long for the engine's context (check_prompt_size) is said so first."""
    budget = budget or RequestBudget()
    try:
        prompt = body.get("prompt")
        if check_prompt_size is not None:
            texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
            for i, text in enumerate(texts):
                if isinstance(text, str):
                    try:
                        check_prompt_size(text)
                    except ValueError as e:
                        param = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
                        raise bad_request(param, f"'{param}': {e}") from None
        budget.charge_fields(body, _BUDGET_FIELDS)
        n_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        # the sequences it runs, up to MAX_SEQUENCES (past it, or out of range, the fields'
        # own checks answer more precisely)
        counts = {key: v for key in ("n", "best_of") for v in [body.get(key)]
                  if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_N}
        if counts:
            key = max(counts, key=counts.get)
            budget.charge_bytes(key, min(n_prompts * counts[key], MAX_SEQUENCES) * SEQUENCE_BYTES)
    except ValueError as e:
        raise bad_request(e.field, str(e)) from None
    return budget


class Validator:
    """Turns request JSON into a Parsed, tokenizing prompts; the engine's own
    check (check_request) decides whether each prompt fits."""

    def __init__(self, tokenizer, max_model_len: int, check_request, encode_prompt=None, prepare_params=None,
                 check_prompt_size=None, budget_bytes: int = REQUEST_BUDGET_BYTES, request_room=None):
        self.tok = tokenizer
        self.max_model_len = max_model_len
        # tokens one sequence can hold (prompt and output): the engine's stats()["request_room"]
        self.request_room = max_model_len if request_room is None else request_room
        self.check_request = check_request
        # the engine's tokenizing, with its byte-length bound first (EngineCore.encode_prompt)
        self.encode_prompt = encode_prompt
        self.tool_parser = None  # reads tool_choice "auto" answers (conveyor.server.tool_parsers)
        # the engine's params preparation (bad words tokenized once, here on the worker)
        self.prepare_params = prepare_params
        # the engine's bound on a prompt text's bytes, before the request budget
        self.check_prompt_size = check_prompt_size
        self.budget_bytes = budget_bytes

    def _engine_params(self, kw: dict, renames: dict) -> SamplingParams:
        """SamplingParams from kw, prepared for the engine (bad words tokenized: the
        engine takes them as they are, with no tokenizing on the event loop)."""
        params = _make_params(kw, renames)
        if self.prepare_params is None:
            return params
        try:
            return self.prepare_params(params)
        except (TypeError, ValueError) as e:
            raise refused(e, renames) from None

    def _ids(self, param: str, ids: list) -> list:
        if not ids:
            raise bad_request(param, f"'{param}' is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise bad_request(param, f"'{param}' must hold integer token ids, got {type_name(t)}")
        return list(ids)

    def _encode(self, param: str, text: str, add_special_tokens: bool = True) -> list:
        check_text(param, text)
        if self.tok is None:
            raise bad_request(param, "this server has no tokenizer; send token ids")
        if text == "":
            raise bad_request(param, f"'{param}' is empty")
        if self.encode_prompt is not None:
            try:
                return self.encode_prompt(text, add_special_tokens)
            except (TypeError, ValueError) as e:
                if getattr(e, "field", None) == "prompt":  # the length bound
                    raise bad_request(param, f"'{param}': {e}") from None
                raise bad_request(param, f"'{param}' could not be tokenized: {e}") from None
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:
            raise bad_request(param, f"'{param}' could not be tokenized: {e}") from None

    def _check(self, params: SamplingParams, prompts: list, names: list, renames: Optional[dict] = None):
        """The engine's checks for each prompt; a prompt error names that prompt."""
        for p, name in zip(prompts, names):
            try:
                self.check_request(p.ids, params)
            except (TypeError, ValueError) as e:
                raise refused(e, {**(renames or {}), "prompt": name}) from None

    def completion(self, body: dict) -> Parsed:
        charge_request_budget(body, RequestBudget(self.budget_bytes), self.check_prompt_size)
        f = Fields(body)
        model = f.str("model")
        n = f.int("n", 1, lo=1, hi=MAX_N)
        max_tokens = f.int("max_tokens", 16)
        logprobs = f.int("logprobs", None)
        echo = f.bool("echo", False)
        stream_flag = f.obj.get("stream") is True
        if max_tokens == 0 and not echo:
            raise bad_request("max_tokens", "'max_tokens' 0 is only allowed with 'echo' (prompt logprobs)")
        if echo and stream_flag and (logprobs is not None or max_tokens == 0):
            raise bad_request("echo", "'echo' with 'logprobs' or max_tokens 0 is not supported when streaming")
        if stream_flag and f.obj.get("best_of") not in (None, n):
            raise bad_request("best_of", "'best_of' greater than 'n' cannot be streamed")
        if f.obj.get("suffix") not in (None, ""):
            raise bad_request("suffix", "'suffix' is not supported by this server")
        stream, include_usage = _stream_flags(f)

        raw = body.get("prompt")
        if raw is None:
            raise bad_request("prompt", "'prompt' is required")
        if isinstance(raw, str):
            items = [raw]
        elif isinstance(raw, list):
            if not raw:
                raise bad_request("prompt", "'prompt' is empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
                items = [raw]
            elif all(isinstance(p, (str, list)) for p in raw):
                items = raw
            else:
                raise bad_request("prompt", "'prompt' must be a string, an array of strings, an array of token ids "
                                     "or an array of token-id arrays")
        else:
            raise bad_request("prompt", f"'prompt' must be a string or an array, got {type_name(raw)}")
        if len(items) > MAX_PROMPTS:
            raise bad_request("prompt", f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} are allowed")
        if len(items) * n > MAX_SEQUENCES:
            raise bad_request("n", f"{len(items)} prompts x n={n} is more than {MAX_SEQUENCES} sequences")
        prompts = []
        for i, p in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                prompts.append(Prompt(p, self._encode(param, p)))
            else:
                prompts.append(Prompt(None, self._ids(param, p)))
        kw = _common_sampling(f, max_tokens, logprobs, n, allow_best_of=True)
        if len(items) * max(n, kw.get("best_of") or 0) > MAX_SEQUENCES:
            raise bad_request("best_of", f"{len(items)} prompts x best_of={kw['best_of']} is more than "
                                         f"{MAX_SEQUENCES} sequences")
        if echo and logprobs is not None:
            kw["prompt_logprobs"] = logprobs  # the prompt's logprobs, answered in the legacy shape
        if max_tokens == 0:
            # the engine always samples one token; the answer leaves it out
            kw["max_tokens"] = 1
        kw, renames = _with_guided(kw, f)
        params = self._engine_params(kw, renames)
        self._check(params, prompts, ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))],
                    renames)
        return Parsed("completion", prompts, params, stream, include_usage, logprobs, echo, model,
                      prompt_only=max_tokens == 0, renames=renames, **_load_fields(f))

    def _message_text(self, i: int, content) -> str:
        param = f"messages[{i}].content"
        try:
            return check_text(param, message_text(content, param))
        except (TypeError, ValueError) as e:  # the part at fault leads the message: name it
            named = str(e).split(" ", 1)[0].rstrip(":")
            raise bad_request(named if named.startswith(param) else param, str(e)) from None

    def chat(self, body: dict) -> Parsed:
        charge_request_budget(body, RequestBudget(self.budget_bytes), self.check_prompt_size)
        f = Fields(body)
        model = f.str("model")
        n = f.int("n", 1, lo=1, hi=MAX_N)
        mt = f.int("max_completion_tokens", None)  # the newer name: it wins when both are sent
        max_tokens = f.int("max_tokens", None) if mt is None else mt
        want_lp = f.bool("logprobs", False)
        top = f.int("top_logprobs", None)
        if top is not None and not want_lp:
            raise bad_request("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
        logprobs = (top or 0) if want_lp else None
        stream, include_usage = _stream_flags(f)
        tool = _tools(f, self.tool_parser)
        auto = tool if isinstance(tool, AutoTools) else None
        tool = None if auto is not None else tool

        text, ids = self.render_chat(body, auto_tools=auto)
        if max_tokens is None:  # the rest of what one sequence can hold, capped
            max_tokens = max(1, min(self.request_room - len(ids), DEFAULT_CHAT_MAX_TOKENS_CAP))
        sampling = _common_sampling(f, max_tokens, logprobs, n)
        if auto is not None and body.get("skip_special_tokens") is None:
            sampling["skip_special_tokens"] = False  # call markers may be special tokens ([TOOL_CALLS])
        kw, renames = _with_guided(sampling, f, tool)
        renames["logprobs"] = "top_logprobs"
        if mt is not None:
            renames["max_tokens"] = "max_completion_tokens"
        params = self._engine_params(kw, renames)
        prompts = [Prompt(text, ids)]
        self._check(params, prompts, ["messages"], renames)
        return Parsed("chat", prompts, params, stream, include_usage, logprobs, False, model, tool_call=tool,
                      auto_tools=auto, renames=renames, **_load_fields(f))

    def render_chat(self, body: dict, add_generation_prompt: bool = True,
                    auto_tools: Optional[AutoTools] = None) -> tuple[str, list]:
        """body["messages"] through the chat template: (text, token ids). With auto_tools
        the system message describes the tools; an assistant message's tool_calls are
        written in the tool parser's format."""
        msgs = body.get("messages")
        if msgs is None:
            raise bad_request("messages", "'messages' is required")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("messages", "'messages' must be a non-empty array of {role, content} objects")
        conv = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad_request(f"messages[{i}]", f"'messages[{i}]' must be an object, got {type_name(m)}")
            role = m.get("role")
            if not isinstance(role, str) or role not in _CHAT_ROLES:
                raise bad_request(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(_CHAT_ROLES)}")
            content = self._message_text(i, m.get("content"))
            if m.get("tool_calls") and self.tool_parser is not None:
                content += self.tool_parser.format_calls(_history_tool_calls(i, m["tool_calls"]))
            conv.append({"role": role, "content": content})
        if auto_tools is not None:
            conv = _with_tools_prompt(conv, auto_tools)
        if self.tok is None:
            raise bad_request("messages", "this server has no tokenizer, so chat is unavailable")
        try:
            # the server said at start-up that there is no template: no warning per request
            text = self.tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                warn_without_template=False)
        except (TypeError, ValueError) as e:
            raise bad_request("messages", f"the chat template failed: {e}") from None
        except Exception as e:  # a template's own error (jinja2)
            raise bad_request("messages", f"the chat template failed: {type(e).__name__}: {e}") from None
        if getattr(self.tok, "chat_template", None):
            ids = self._encode("messages", text, add_special_tokens=False)
        else:
            ids = self._encode("messages", text)
        return text, ids

    def tokenize(self, body: dict) -> list:
        """/tokenize: the ids of body["prompt"] or of the rendered body["messages"]."""
        charge_request_budget(body, RequestBudget(self.budget_bytes), self.check_prompt_size)
        f = Fields(body)
        f.str("model")
        if body.get("messages") is not None:
            return self.render_chat(body, f.bool("add_generation_prompt", True))[1]
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt", "'prompt' (a string) or 'messages' is required")
        return self._encode("prompt", prompt, f.bool("add_special_tokens", True))

    def detokenize(self, body: dict) -> str:
        """/detokenize: the text of body["tokens"]."""
        Fields(body).str("model")
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise bad_request("tokens", "'tokens' must be an array of token ids")
        ids = self._ids("tokens", ids)
        if self.tok is None:
            raise bad_request("tokens", "this server has no tokenizer")
        for t in ids:
            if not 0 <= t < self.tok.vocab_size:
                raise bad_request("tokens", f"token id {t} is outside the vocabulary [0, {self.tok.vocab_size})")
        return self.tok.decode(ids)
