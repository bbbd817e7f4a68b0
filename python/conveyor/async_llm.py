"""AsyncLLM: streaming generation for asyncio applications and notebooks.

The engine loop runs on a C thread (GIL released) while work exists. After a
step with outputs it writes to an eventfd. A dispatcher thread blocks on that
fd, applies the outputs and hands each request's output to the event loop that
is consuming it with call_soon_threadsafe (which wakes that loop through its
own self-pipe). Nothing polls or sleeps, an idle engine uses no CPU, and any
number of event loops in any threads (Jupyter's included) can share one engine.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional

import numpy as np

from .engine import (NO_TOKEN_ERROR, NON_FINITE_LOGITS, EngineArgs, EngineCore, EngineFrontend, check_priority,
                     check_timeout)
from .models import resolve_model
from .outputs import RequestOutput
from .sampling_params import SamplingParams

# A text prompt of at most this many characters is tokenized in add_request itself, on
# the loop (well under a millisecond), so that its errors are raised at once; a longer
# one, bad words and grammars are prepared on the preparation threads.
INLINE_PREPARE_CHARS = 1024


def _make_wake_fd():
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_CLOEXEC)
        return fd, fd
    return os.pipe()


def _deliver(items):
    for queue, out in items:
        queue.put_nowait(out)


def _dispatch_loop(core: EngineCore, rfd: int, stopping: threading.Event):
    while True:
        try:
            os.read(rfd, 8)
        except InterruptedError:
            continue
        except OSError:
            return
        if stopping.is_set():
            return
        by_loop: dict = {}

        def snapshot(req):
            if req.consumer is None:
                return
            kind = req.params.output_kind
            if kind == "final_only" and not req.finished:
                return
            if len(req.seqs) > req.params.n and not req.finished:
                return  # best_of > n: the n best are known only at the end
            # One output per event (a completion's token), so the consumer sees every
            # token in order, however many steps the dispatcher takes at once.
            out = EngineCore.build_output(req, delta=kind == "delta")
            loop, queue = req.consumer
            by_loop.setdefault(loop, []).append((queue, out))

        try:
            core.process_events(snapshot)
        except Exception:  # the engine was closed under us: nothing more to deliver
            if core.closed:
                return
            raise
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting for these outputs


def _shutdown(core: EngineCore, rfd: int, wfd: int, stopping: threading.Event, thread, prepare_pool=None):
    if prepare_pool is not None:
        prepare_pool.shutdown(wait=False, cancel_futures=True)
    core.close()  # stops the C loop first, so nothing writes to the fd any more
    stopping.set()
    try:
        os.write(wfd, (1).to_bytes(8, "little"))
    except OSError:
        pass
    if thread is not threading.current_thread():
        thread.join(timeout=10)
    # Requests still in flight end as aborted, so no consumer waits forever.
    for req in core.fail_pending():
        if req.consumer is not None:
            loop, queue = req.consumer
            try:
                out = EngineCore.build_output(req, delta=req.params.output_kind == "delta")
                loop.call_soon_threadsafe(_deliver, [(queue, out)])
            except RuntimeError:
                pass
    for fd in {rfd, wfd}:
        try:
            os.close(fd)
        except OSError:
            pass


def _raise_guided_error(out: RequestOutput, params) -> None:
    """A grammar the grammar engine gave up on midway is the request's error, not a
    silent "abort": ValueError with .field "guided_decoding"; so is a completion whose
    constraints left no token (finish_reason "error"; .field: the first constraint the
    request set of allowed_token_ids, bad_words, min_tokens, the grammar)."""
    if out.guided_error:
        e = ValueError(out.guided_error)
        e.field = (_no_token_field(params) if out.guided_error.startswith(NO_TOKEN_ERROR) else
                   "model" if out.guided_error.startswith(NON_FINITE_LOGITS) else "guided_decoding")
        raise e


def _no_token_field(params) -> str:
    if params is None or params.allowed_token_ids is not None:
        return "allowed_token_ids"
    if params.bad_words:
        return "bad_words"
    if params.min_tokens:
        return "min_tokens"
    return "guided_decoding"


class _Refused:
    """What a stream's queue holds when its request never reached the engine: the
    error its reader gets (None: the stream was closed while it was prepared)."""

    __slots__ = ("error",)
    finished = True

    def __init__(self, error: Optional[BaseException]):
        self.error = error


class RequestStream:
    """The outputs of one request added with AsyncLLM.add_request: `async for out in
    stream`, or `await stream.next_batch()` for every output already delivered (a
    consumer that writes once per engine step). close() aborts it if unfinished."""

    __slots__ = ("_core", "_req", "_queue", "_done", "_name", "_held", "_failed")

    def __init__(self, core: EngineCore, req, queue: asyncio.Queue, name: Optional[str] = None):
        self._core = core
        self._req = req  # None while the request is being prepared
        self._queue = queue
        self._done = False
        self._name = name
        self._held: Optional[_Refused] = None  # an error next_batch reads behind outputs: the next read's
        self._failed = False  # fail() was called: a request still being prepared is never added

    @property
    def has_output(self) -> bool:
        """Whether any completion of the request has a token yet."""
        return self._req is not None and any(st.token_ids for st in self._req.seqs)

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error`, which its reader gets after the outputs already
        delivered, and aborts the request (a server shutting down ends its requests this
        way, so that each client gets an error, not a dropped connection)."""
        if self._done or self._failed:
            return
        self._failed = True
        if self._req is not None and not self._req.finished:
            self._core.abort(self._req.request_id)
        self._queue.put_nowait(_Refused(error))

    @property
    def request_id(self) -> Optional[str]:
        """The request's id (None while an unnamed request is being prepared)."""
        return self._req.request_id if self._req is not None else self._name

    def __aiter__(self):
        return self

    def _raise_held(self) -> None:
        held, self._held = self._held, None
        self._done = True
        if held.error is not None:
            raise held.error

    async def __anext__(self) -> RequestOutput:
        if self._held is not None:
            self._raise_held()
        if self._done:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._done = True
            if isinstance(out, _Refused):
                raise out.error if out.error is not None else StopAsyncIteration
            _raise_guided_error(out, self._params())
        return out

    async def next_batch(self) -> list:
        """Waits for at least one output and returns all that are ready, in order
        ([] once the request has finished)."""
        if self._held is not None:
            self._raise_held()
        if self._done:
            return []
        outs = [await self._queue.get()]
        if isinstance(outs[0], _Refused):
            self._done = True
            if outs[0].error is None:
                return []
            raise outs[0].error
        q = self._queue
        while not outs[-1].finished and not q.empty():
            outs.append(q.get_nowait())
        if isinstance(outs[-1], _Refused):  # failed behind these outputs: they first
            self._held = outs.pop()
            return outs
        self._done = outs[-1].finished
        if self._done:
            _raise_guided_error(outs[-1], self._params())
        return outs

    def _params(self):
        return self._req.params if self._req is not None else None

    def close(self):
        """Aborts the request unless it finished; frees its KV blocks. Safe to call twice."""
        if self._req is None:
            if not self._done:  # still being prepared: it is never added
                self._queue.put_nowait(_Refused(None))  # wakes a reader waiting for it
        elif not self._req.finished:
            self._core.abort(self._req.request_id)
        self._done = True


class AsyncLLM(EngineFrontend):
    """Same constructor as LLM. `async for out in engine.generate(prompt, params)`."""

    def __init__(self, model=None, **kwargs):
        self._core = EngineCore(EngineArgs.from_kwargs(resolve_model(model), kwargs))
        self._rfd, self._wfd = _make_wake_fd()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=_dispatch_loop, name="conveyor-dispatch",
                                        args=(self._core, self._rfd, self._stopping), daemon=True)
        self._thread.start()
        self._core.start_background(self._wfd)
        # Work a request brings that can take long (tokenizing, rendering a chat template,
        # building grammar matchers) runs here, not on the event loop; two threads, so
        # that the loop keeps its share of the GIL.
        self._prepare_pool = ThreadPoolExecutor(2, thread_name_prefix="conveyor-prepare")
        self._preparing: dict[str, RequestStream] = {}  # named requests not yet added, by id
        self._aborted_preparing: set = set()  # streams abort() was called for while they were prepared
        self._finalizer = weakref.finalize(self, _shutdown, self._core, self._rfd, self._wfd,
                                           self._stopping, self._thread, self._prepare_pool)

    # -- public API -----------------------------------------------------------
    async def run_off_loop(self, fn, *args):
        """fn(*args) on this engine's preparation threads (tokenizing, chat templates,
        grammar matchers: work that must not hold up the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)

    def prepare_guided(self, params: SamplingParams):
        """The grammar matchers of a guided request (None when unconstrained), for
        add_request(guided=...): seconds for a hard grammar, so call it through
        run_off_loop. ValueError (.field "guided_decoding") for a grammar the grammar
        engine refuses or gives up on at once."""
        return self._core.prepare_guided(params)

    def add_request(self, prompt, sampling_params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, *, priority: int = 0,
                    timeout: Optional[float] = None, guided=None, lora_request=None) -> "RequestStream":
        """Adds a request (from a running event loop) and returns its stream of
        RequestOutputs at once; close the stream (or let it finish) to release it.

        Work that grows with the request (tokenizing a text prompt, tokenizing bad
        words, building a guided request's grammar matchers) runs on the preparation
        threads, never on the loop: such a request reaches the engine once prepared,
        and what is wrong with it (ValueError/TypeError, EngineOverloadedError when
        max_queued_requests requests already wait) is raised by the stream's first read.
        A request with nothing to prepare (token ids, or a text prompt of at most
        INLINE_PREPARE_CHARS characters, no bad words to tokenize, no grammar to build)
        is added here, and its errors are raised here. Bad types, priority and timeout
        are checked here either way. guided: prepare_guided(params)'s result, when the
        caller built it."""
        if self._core.closed:
            from . import EngineClosedError

            raise EngineClosedError("the AsyncLLM is closed")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(prompt, (list, tuple)) and prompt and not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise TypeError("AsyncLLM.generate takes one prompt: a str, token ids or a NumPy array")
        check_priority(priority)
        check_timeout(timeout)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        if request_id is not None and request_id in self._preparing:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not self._needs_preparing(prompt, params, guided, lora_request):
            text, ids = self._core.tokenize_prompt(prompt, exclusive=False)
            req = self._core.add_request(request_id, text, ids, params, priority=priority,
                                         consumer=(loop, queue), timeout=timeout, guided=guided,
                                         lora_request=lora_request)
            return RequestStream(self._core, req, queue)
        stream = RequestStream(self._core, None, queue, request_id)
        if request_id is not None:
            self._preparing[request_id] = stream
        prepared = loop.run_in_executor(self._prepare_pool, self._prepare, prompt, params, guided, lora_request)

        def add_prepared(fut):
            if request_id is not None and self._preparing.get(request_id) is stream:
                del self._preparing[request_id]
            aborted = stream in self._aborted_preparing
            self._aborted_preparing.discard(stream)
            if stream._done or stream._failed:  # closed or failed while it was being prepared
                if not fut.cancelled():
                    fut.exception()  # retrieved: asyncio logs no error that nobody reads
                return
            try:
                if fut.cancelled():
                    from . import EngineClosedError

                    raise EngineClosedError("the AsyncLLM is closed")
                text, ids, engine_params, matchers = fut.result()
                if aborted:  # its id is free already: it ends here, never added
                    queue.put_nowait(self._core.aborted_before_start(request_id, text, ids, engine_params))
                    return
                stream._req = self._core.add_request(request_id, text, ids, engine_params, priority=priority,
                                                     consumer=(loop, queue), timeout=timeout,
                                                     guided=matchers, lora_request=lora_request)
            except Exception as e:
                queue.put_nowait(_Refused(e))
                return

        prepared.add_done_callback(add_prepared)
        return stream

    def _needs_preparing(self, prompt, params: SamplingParams, guided, lora_request=None) -> bool:
        """Whether adding this request means work that grows with it (a grammar to build,
        an adapter's files to read): then it is prepared on the preparation threads."""
        if params.guided_decoding is not None and guided is None:
            return True
        if lora_request is not None and self._core.lora_enabled and not self._core.is_lora_read(lora_request):
            return True
        if params.bad_words and params._bad_words_token_ids is None:
            return True  # tokenized one request at a time: the loop must not wait for that
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            prompt = prompt.get("prompt")
        return isinstance(prompt, str) and len(prompt) > INLINE_PREPARE_CHARS  # up to 4 bytes a character

    def _prepare(self, prompt, params: SamplingParams, guided, lora_request=None):
        """On a preparation thread: (prompt text, token ids, the params as the engine
        reads them, the grammar matchers). The engine's checks run here too, so that a
        prompt too long for the context is refused before its ids reach the loop."""
        text, ids = self._core.tokenize_prompt(prompt)
        params = self._core.prepare_params(params)
        self._core.check_request(ids, params)
        if guided is None:
            guided = self._core.prepare_guided(params)
        if lora_request is not None and self._core.lora_enabled:
            self._core.read_lora(lora_request)
        return text, ids, params, guided

    async def generate(self, prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, priority: int = 0,
                       timeout: Optional[float] = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs as tokens are produced: cumulative by default,
        new tokens only with SamplingParams(output_kind="delta"), or just the
        last one with output_kind="final_only". Closing or cancelling the
        iterator aborts the request and frees its KV blocks.

        priority: under scheduling="priority", lower values are scheduled first, and a
        waiting request that outranks a running one preempts it when no seat or KV
        blocks are free.
        timeout: seconds from arrival; past it the request ends with
        finish_reason "timeout" and its KV blocks return to the pool.
        Raises EngineOverloadedError when max_queued_requests requests wait."""
        stream = self.add_request(prompt, sampling_params, request_id, priority=priority, timeout=timeout,
                                  lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> bool:
        """Aborts a request; returns False when no such request is running."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        stream = self._preparing.pop(request_id, None)
        if stream is not None:  # ends as "abort" once prepared; the id is free at once
            self._aborted_preparing.add(stream)
            return True
        return self._core.abort(request_id)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
