"""Serving: completions and chat answered by the engine (plain JSON or
server-sent events), with admission control and client-disconnect aborts."""
from __future__ import annotations

import asyncio
import bisect
import hmac
import json
import logging
import math
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from .. import _core
from ..request_budget import REQUEST_BUDGET_BYTES
from ..sampling_params import SamplingParams
from .body_fields import IGNORED_FIELDS_HEADER, header_value, unknown_fields
from .chunks import ChunkEncoder
from .metrics import ServerMetrics
from .protocol import (APIError, Parsed, Prompt, Validator, bad_request, check_text, dumps, refused,
                       type_name)
from .tool_parsers import ToolCallStream, parse_answer, tool_call_deltas

# ---------------------------------------------------------------------------- responses


def json_response(obj, status: int = 200, headers: Optional[dict] = None):
    from starlette.responses import Response

    # "replace": a lone surrogate echoed from the request must not break the answer.
    body = dumps(obj).encode("utf-8", errors="replace")
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(err: APIError):
    headers = dict(err.headers or {})
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return json_response(err.body(), err.status, headers or None)


async def wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class SSEResponse:
    """Streams `data: ...` events from an async iterator of str; a client that goes away
    cancels the stream (and with it the engine requests) at once."""

    def __init__(self, events: AsyncIterator[str], on_disconnect=None, on_end=None,
                 headers: Optional[dict] = None):
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_end = on_end
        self.headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def _stream(self, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")] + self.headers})
        try:
            async for ev in self.events:
                await send({"type": "http.response.body", "body": ev.encode("utf-8"), "more_body": True})
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send):
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
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


def tool_call_message(tc, text: str, finish: Optional[str]) -> tuple[dict, Optional[str]]:
    """The assistant message for a guided tool call: the grammar made `text`
    the arguments (named function) or {"name", "arguments"} ("required"). A
    completion cut short (length, abort) is not valid JSON: it stays content."""
    try:
        value = json.loads(text)
    except ValueError:
        return {"role": "assistant", "content": text}, finish
    if tc.name is not None:
        name, args = tc.name, value
    else:
        name, args = value["name"], value["arguments"]
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"


def auto_tool_message(auto, text: str, finish: Optional[str]) -> tuple[dict, Optional[str]]:
    """The assistant message of a tool_choice "auto" answer: its calls, read by the tool
    parser, as tool_calls (finish_reason "tool_calls"), or the text as it is."""
    answer = parse_answer(auto.parser, text, auto.tools, auto.parallel)
    if not answer.calls:
        return {"role": "assistant", "content": text}, finish
    calls = [{k: v for k, v in c.items() if k != "index"} for c in tool_call_deltas(answer.calls)]
    return {"role": "assistant", "content": answer.content, "tool_calls": calls}, "tool_calls"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def text_offsets(text: str, pieces: list[bytes], base: int = 0) -> list[int]:
    """Where each token starts in ``text``, in characters, plus ``base``.

    The tokens' bytes line up with the text's at the end when they hold more (a prompt
    whose decoded text drops a leading space or special tokens) and at the start
    otherwise (an output a stop string cut short). Counting in bytes first keeps a
    character split across tokens from counting once a token; a token that starts
    inside a character gets that character's offset.
    """
    data = text.encode("utf-8", "surrogatepass")
    joined = b"".join(pieces)
    skip = len(joined) - len(data) if len(joined) > len(data) and joined.endswith(data) else 0
    if len(data) == len(text):  # ASCII: a byte is a character
        starts = None
    else:
        starts, at = [], 0
        for ch in text:
            starts.append(at)
            at += len(ch.encode("utf-8", "surrogatepass"))
    out, at = [], 0
    for piece in pieces:
        q = min(max(at - skip, 0), len(data))
        if q == len(data):
            out.append(base + len(text))
        else:
            out.append(base + (q if starts is None else bisect.bisect_right(starts, q) - 1))
        at += len(piece)
    return out


RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full queue

# The body types a web page may POST to another site without asking it first (a CORS
# "simple request"): a JSON endpoint refuses them from a browser, so that no page can
# make its visitors' browsers run requests here.
_SIMPLE_FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def check_content_type(headers) -> None:
    """A 415 for a browser's (it sends Origin) body of a type a cross-site form can send
    unasked; curl and the SDKs, which send no Origin, may leave the type out."""
    mime = headers.get("content-type", "").split(";")[0].strip().lower()
    if mime in _SIMPLE_FORM_TYPES and headers.get("origin") is not None:
        raise APIError(415, f"a request body from a browser must be sent as Content-Type: application/json, "
                            f"not {mime}", param="body", code="unsupported_media_type")


# The budget bytes a request's value costs at least (a number 8, a string its length
# and quotes; empty strings aside), for the bound on the values of a body.
BODY_BYTES_PER_VALUE = 4


def parse_body(data, max_values: Optional[int] = None) -> dict:
    """A request body (bytes, or the list of its chunks): UTF-8 JSON holding an object
    (a 400 naming "body" otherwise). max_values: a body that may hold more values is
    refused before json.loads, which holds the GIL for its whole parse (counting them
    does not)."""
    if isinstance(data, list):
        data = b"".join(data)
    if max_values is not None and _core.json_value_count(data, max_values) > max_values:
        raise bad_request("body", f"the request body holds more than {max_values} JSON values (one per "
                                  f"{BODY_BYTES_PER_VALUE} bytes of the request budget)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request("body", f"the request body is not valid UTF-8 (at byte {e.start})") from None

    def no_constants(c):
        raise ValueError(f"{c} is not valid JSON")

    try:
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise bad_request("body", f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("body", f"the request body must be a JSON object, got {type_name(body)}")
    return body


class Server:
    def __init__(self, engine, model_names: list, api_key: Optional[str], request_timeout: Optional[float],
                 max_body_bytes: int):
        self.engine = engine
        self.model_names = list(model_names)  # every name a request may use; answers carry the first
        self.model_name = self.model_names[0]
        self.loras: dict = {}  # adapter name -> LoRARequest: the request's "model" selects it
        self._next_lora_id = 1
        self.api_key = api_key
        self.request_timeout = request_timeout  # the deadline of a request that names none
        self.max_body_bytes = int(max_body_bytes)
        self.tok = engine.tokenizer
        st = engine.stats()
        self.max_model_len = int(st.get("max_model_len") or engine.model_config.get("max_pos") or 2048)
        self.vocab_size = int(engine.model_config["vocab_size"])
        self.validator = Validator(self.tok, self.max_model_len, engine.check_request,
                                   getattr(engine, "encode_prompt", None), getattr(engine, "prepare_params", None),
                                   getattr(engine, "check_prompt_size", None),
                                   getattr(engine, "request_budget_bytes", REQUEST_BUDGET_BYTES),
                                   request_room=st.get("request_room"))
        # a body of more values than the request budget could hold is refused unparsed
        self.max_body_values = self.validator.budget_bytes // BODY_BYTES_PER_VALUE
        self.metrics = ServerMetrics(self.model_name)
        self.created = int(time.time())
        self.in_flight = 0   # HTTP generation requests being answered
        self.live_streams: set = set()  # their engine streams, for a shutdown to end
        self.shutting_down = False
        self._piece_cache: dict[int, tuple[str, list]] = {}

    # -- shutdown ---------------------------------------------------------
    def begin_shutdown(self, grace_s: float) -> None:
        """The process was told to stop (on the event loop). No new generation starts;
        a request with no token yet ends now, one that runs may finish within grace_s
        and ends then. Each ends as 503 engine_closed (a stream: an error event, then
        [DONE]), so that no client is left with a dropped connection when the server
        closes them. Called again (a second signal), it ends everything now."""
        first = not self.shutting_down
        self.shutting_down = True
        self._end_streams(waiting_only=first and grace_s > 0)
        if first and grace_s > 0:
            asyncio.get_running_loop().call_later(grace_s, self._end_streams, False)

    def _end_streams(self, waiting_only: bool) -> None:
        from .. import EngineClosedError

        for s in list(self.live_streams):
            if not (waiting_only and s.has_output):
                s.fail(EngineClosedError("the server is shutting down"))

    def _release(self, streams: list) -> None:
        """A generation request's end, however it came: it leaves the in-flight count and
        the shutdown's view, and its engine requests that did not finish are aborted."""
        self.in_flight -= 1
        self.live_streams.difference_update(streams)
        for s in streams:
            s.close()

    def closed_error(self) -> APIError:
        """The 503 of a request the engine's end (or the server's) cut off."""
        return APIError(503, "the server is shutting down" if self.shutting_down else "the engine is shut down",
                        code="engine_closed")

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
        from starlette.requests import ClientDisconnect

        check_content_type(request.headers)
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise bad_request("body", "the Content-Length header is not an integer") from None
            if n > self.max_body_bytes:
                raise APIError(413, f"the request body has {n} bytes; the limit is {self.max_body_bytes}",
                               code="body_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise APIError(413, f"the request body is over the limit of {self.max_body_bytes} bytes",
                                   code="body_too_large")
        except ClientDisconnect:  # gone while sending its body: nobody to answer, not a server error
            self.metrics.disconnects += 1
            raise APIError(499, "the client closed the connection while sending the body",
                           code="client_closed_request") from None
        # joining, decoding and parsing megabytes take the GIL for milliseconds: off the loop
        return await self.off_loop(parse_body, chunks, self.max_body_values)

    async def off_loop(self, fn, *args):
        """fn(*args) on the engine's preparation threads (AsyncLLM.run_off_loop), so that
        a request's tokenizing, chat template and grammar never hold up the event loop."""
        run = getattr(self.engine, "run_off_loop", None)
        return await run(fn, *args) if run is not None else fn(*args)

    def prepare(self, body: dict, kind: str) -> Parsed:
        """The request read, tokenized and checked, its params for the engine and, when
        guided, its grammar matchers built (one set per prompt): all the work that grows
        with what the client sent. Runs on a worker thread."""
        parsed = self.validator.completion(body) if kind == "completion" else self.validator.chat(body)
        # the validator's own params object, prepared for the engine: set, not cloned
        # (a clone would drop the bad words tokenized with it)
        parsed.params.output_kind = "delta" if parsed.stream else "final_only"
        if parsed.params.guided_decoding is not None:
            prepare = getattr(self.engine, "prepare_guided", None)
            if prepare is not None:
                try:
                    first = prepare(parsed.params)
                except (ValueError, TypeError) as e:
                    raise refused(e, parsed.renames) from None
                matchers, mask = first
                parsed.guided = [first] + [([m.deep_copy() for m in matchers], mask)
                                           for _ in parsed.prompts[1:]]
        return parsed

    def add_lora(self, name: str, path: str):
        """Serves the adapter at path under name (read and checked now: LoRAError names the key)."""
        from ..lora import LoRARequest

        if name in self.model_names or name in self.loras:
            raise bad_request("lora_name", f"the name '{name}' is already served")
        req = LoRARequest(name, self._next_lora_id, path)
        self.engine._core.read_lora(req)
        self._next_lora_id += 1
        self.loras[name] = req
        return req

    def remove_lora(self, name: str):
        req = self.loras.pop(name, None)
        if req is None:
            raise APIError(404, f"the LoRA adapter '{name}' is not loaded", param="lora_name",
                           code="model_not_found")
        self.engine._core.forget_lora(req.lora_int_id)  # its running requests finish under it

    def check_model(self, model: Optional[str]):
        """The LoRARequest the request's model names (None: the base model)."""
        if model is not None and model in self.loras:
            return self.loras[model]
        if model is not None and model not in self.model_names:
            served = ", ".join(f"'{n}'" for n in self.model_names + list(self.loras))
            raise APIError(404, f"the model '{model}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    def start(self, parsed: Parsed, rid: str, params: SamplingParams, lora=None) -> list:
        """Adds every prompt's request to the engine now, before any response starts, so
        that a full queue (the engine's max_queued_requests) is answered 503 with
        Retry-After at once and a refused request 400; all or nothing. Returns the
        RequestStreams; the caller closes them."""
        from .. import EngineOverloadedError

        timeout = parsed.timeout if parsed.timeout is not None else self.request_timeout
        limit = getattr(self.engine, "max_queued_requests", None)
        share = max(1, limit // 4) if limit else None
        if share is not None and len(parsed.prompts) > share:
            # one request must not fill the queue for everyone
            raise bad_request("prompt", f"'prompt' holds {len(parsed.prompts)} prompts; one request may queue "
                                        f"at most {share} (a quarter of max_queued_requests={limit})")
        streams = []
        try:
            for i, p in enumerate(parsed.prompts):
                guided = {"guided": parsed.guided[i]} if parsed.guided is not None else {}
                streams.append(self.engine.add_request({"prompt": p.text, "prompt_token_ids": p.ids}, params,
                                                       request_id=f"{rid}-{i}", priority=parsed.priority,
                                                       timeout=timeout, lora_request=lora, **guided))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, EngineOverloadedError):
                self.metrics.rejected += 1
                raise APIError(503, f"the server is overloaded: {e}", code="server_overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(e, (ValueError, TypeError)):  # the engine refused the request
                raise refused(e, parsed.renames) from None
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

    def _completion_logprobs(self, lps, token_ids, offset0: int, text: Optional[str] = None):
        """The legacy logprobs of these tokens and the offset after them. With ``text`` (the
        tokens' whole text in the answer) each offset points into it; without (a stream's
        delta) the offsets add up the tokens' own text."""
        if lps is None:
            return None, offset0
        tokens, token_lps, tops = [], [], []
        for tid, entry in zip(token_ids, lps):
            tokens.append(self.piece(tid)[0])
            lp = entry.get(tid)
            token_lps.append(_finite(lp.logprob) if lp is not None else None)
            tops.append({self.piece(t)[0]: _finite(v.logprob) for t, v in entry.items()})
        if text is not None:
            ids = list(token_ids)[:len(tokens)]
            offsets = text_offsets(text, [bytes(self.piece(t)[1]) for t in ids], offset0)
            off = offset0 + len(text)
        else:
            offsets, off = [], offset0
            for s in tokens:
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

    async def generate_full(self, streams: list, parsed: Parsed, rid: str):
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
                completion_tokens += 0 if parsed.prompt_only else len(o.token_ids)
                idx = i * n + o.index
                if chat:
                    message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
                    if parsed.tool_call is not None:
                        message, finish = tool_call_message(parsed.tool_call, o.text, finish)
                    elif parsed.auto_tools is not None:
                        message, finish = auto_tool_message(parsed.auto_tools, o.text, finish)
                    choices.append({
                        "index": idx, "message": message,
                        "logprobs": self._chat_logprobs(o.logprobs, o.token_ids, parsed.logprobs or 0),
                        "finish_reason": finish, "stop_reason": o.stop_reason})
                else:
                    choices.append(self._completion_choice(parsed, i, out, o, idx))
        choices.sort(key=lambda c: c["index"])
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": parsed.model or self.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def _completion_choice(self, parsed: Parsed, i: int, out, o, idx: int) -> dict:
        """One /v1/completions choice; with echo the prompt comes first, and with
        echo + logprobs its tokens lead the legacy logprobs lists (the first
        token has no logprob: null)."""
        toks, lps = o.token_ids, o.logprobs
        text, reason = o.text, o.finish_reason
        if parsed.prompt_only:
            toks, lps, text, reason = [], ([] if lps is not None else None), "", "length"
        if not parsed.echo:
            lp, _ = self._completion_logprobs(lps, toks, 0, text)
            return {"index": idx, "text": text, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": o.stop_reason}
        prompt_text = self._prompt_text(parsed.prompts[i])
        lp = None
        if parsed.logprobs is not None:
            plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            head, off = self._completion_logprobs([e or {} for e in plp], out.prompt_token_ids, 0,
                                                  prompt_text)
            head["token_logprobs"][0] = None
            head["top_logprobs"][0] = None
            tail, _ = self._completion_logprobs(lps or [], toks, off, text)
            lp = {k: head[k] + tail[k] for k in head}
        return {"index": idx, "text": prompt_text + text, "logprobs": lp, "finish_reason": reason,
                "stop_reason": None if parsed.prompt_only else o.stop_reason}

    def _prompt_text(self, p: Prompt) -> str:
        if p.text is not None:
            return p.text
        return self.tok.decode(p.ids) if self.tok is not None else ""

    def _stream_choices(self, parsed: Parsed, i: int, out, tokens, offsets, done, held, held_lp) -> list:
        """The chunk choices for one delta RequestOutput of prompt i; updates the per-choice state.
        Tool calls are held back (held[j]: the text so far, or with tool_choice "auto" a
        ToolCallStream that lets the text before a call through, held_lp[j] the logprobs of
        the tokens held) and sent whole with the finish."""
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
            if chat and parsed.tool_call is not None:
                held[j] += o.text
                lp = self._chat_logprobs(o.logprobs, o.token_ids, parsed.logprobs or 0)
                if lp is not None:  # the call goes out whole at the end, its tokens' logprobs with it
                    held_lp[j] += lp["content"]
                if fin is None:
                    continue
                message, fin = tool_call_message(parsed.tool_call, held[j], fin)
                delta = ({"tool_calls": [{"index": 0, **message["tool_calls"][0]}]} if "tool_calls" in message
                         else {"content": message["content"]})
                lp = {"content": held_lp[j]} if parsed.logprobs is not None else None
                choices.append({"index": j, "delta": delta, "logprobs": lp, "finish_reason": fin, **tail})
            elif chat and parsed.auto_tools is not None:
                if not isinstance(held[j], ToolCallStream):
                    held[j] = ToolCallStream(parsed.auto_tools.parser, parsed.auto_tools.tools,
                                             parsed.auto_tools.parallel)
                text = held[j].feed(o.text)
                calls = []
                if fin is not None:
                    rest, calls = held[j].finish()
                    text += rest
                    fin = "tool_calls" if calls else fin
                lp = self._chat_logprobs(o.logprobs, o.token_ids, parsed.logprobs or 0)
                if lp is not None:  # the held tokens' logprobs go out with the next chunk
                    held_lp[j] += lp["content"]
                if text or calls or fin is not None:
                    delta = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = tool_call_deltas(calls)
                    lp = {"content": held_lp[j]} if lp is not None else None
                    held_lp[j] = []
                    choices.append({"index": j, "delta": delta, "logprobs": lp, "finish_reason": fin, **tail})
            elif chat:
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

    async def generate_stream(self, streams: list, parsed: Parsed, rid: str) -> AsyncIterator[str]:
        n = parsed.params.n
        chat = parsed.kind == "chat"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_null = parsed.include_usage
        n_choices = len(parsed.prompts) * n
        tokens = [0] * n_choices
        offsets = [0] * n_choices
        done = [False] * n_choices
        held = [""] * n_choices
        held_lp: list = [[] for _ in range(n_choices)]
        prompt_tokens = 0

        def chunk(choices, usage=None):
            c = {"id": rid, "object": obj, "created": created, "model": parsed.model or self.model_name,
                 "choices": choices}
            if usage is not None or usage_null:
                c["usage"] = usage
            return f"data: {dumps(c)}\n\n"

        try:
            if chat:
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in range(n_choices)])
            elif parsed.echo:
                yield chunk([{"index": i * n + k, "text": self._prompt_text(p), "logprobs": None,
                              "finish_reason": None} for i, p in enumerate(parsed.prompts) for k in range(n)])
            if len(streams) == 1 and n == 1 and parsed.logprobs is None and parsed.tool_call is None \
                    and parsed.auto_tools is None:
                usage = [0, 0]
                enc = ChunkEncoder(rid, created, parsed.model or self.model_name, chat, parsed.include_usage)
                async with aclosing(self._single_events(streams[0], enc, usage)) as events:
                    async for ev in events:
                        yield ev
                prompt_tokens, tokens[0] = usage
            else:
                async with aclosing(self._merged(streams)) as outs:
                    async for i, out in outs:
                        choices = self._stream_choices(parsed, i, out, tokens, offsets, done, held, held_lp)
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
            yield f"data: {dumps(e.body())}\n\n"
        except (ValueError, TypeError) as e:  # the engine refused the request (or its grammar)
            yield f"data: {dumps(refused(e, parsed.renames).body())}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream has begun: report in-band, then end it
            from .. import EngineClosedError

            if isinstance(e, EngineClosedError):
                err = self.closed_error()
            else:
                logging.getLogger("conveyor.serve").exception("internal error while streaming")
                err = APIError(500, f"internal error: {type(e).__name__}: {e}")
            yield f"data: {dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    # -- endpoints --------------------------------------------------------
    async def handle_generate(self, request, kind: str):
        self.check_auth(request)
        body = await self.read_json(request)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request("model", f"'model' must be a string, got {type_name(model)}")
        if model is not None:
            check_text("model", model)
        lora = self.check_model(model)
        headers = self._ignored_fields(body, kind)
        parsed = await self.off_loop(self.prepare, body, kind)
        parsed.model = lora.lora_name if lora is not None else None  # answers name the adapter asked for
        if self.engine.closed or self.shutting_down:
            raise self.closed_error()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        streams = self.start(parsed, rid, parsed.params, lora)
        self.live_streams.update(streams)
        if parsed.stream:
            return self._stream_response(streams, parsed, rid, headers)
        self.in_flight += 1
        try:
            gen = asyncio.ensure_future(self.generate_full(streams, parsed, rid))
        except BaseException:
            self._release(streams)
            raise
        watch = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
            if gen not in done:
                # The client went away: cancelling aborts the engine requests.
                self.metrics.disconnects += 1
                gen.cancel()
                await asyncio.gather(gen, return_exceptions=True)
                return json_response({"error": {"message": "client disconnected", "type": "aborted",
                                                  "param": None, "code": None}}, 499)
            try:
                result = gen.result()
            except (ValueError, TypeError) as e:  # the engine refused the request (or its grammar)
                raise refused(e, parsed.renames) from None
            return json_response(result, headers=headers)
        except BaseException:
            if not gen.done():
                gen.cancel()
            raise
        finally:
            self._release(streams)  # aborts what did not finish (a disconnect, an error)
            if not watch.done():
                watch.cancel()

    @staticmethod
    def _ignored_fields(body: dict, kind: str) -> Optional[dict]:
        """Body fields this endpoint does not read: a warning in the log, and the response
        header that names them (None: there are none)."""
        ignored = unknown_fields(body, kind)
        if not ignored:
            return None
        value = header_value(ignored)
        logging.getLogger("conveyor.serve").warning("request fields ignored (not read by this endpoint): %s", value)
        return {IGNORED_FIELDS_HEADER: value}

    def _stream_response(self, streams: list, parsed: Parsed, rid: str, headers: Optional[dict] = None):
        server = self

        def on_disconnect():
            server.metrics.disconnects += 1

        def on_end():  # also when the response never started streaming
            server._release(streams)

        server.in_flight += 1
        return SSEResponse(server.generate_stream(streams, parsed, rid), on_disconnect, on_end, headers)


