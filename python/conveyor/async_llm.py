"""AsyncLLM: streaming generation for asyncio applications and notebooks.

The engine loop runs on a C thread (GIL released) while work exists. After a
step with outputs it writes to an eventfd; the asyncio loop watches that fd
with add_reader, so nothing polls or sleeps, and an idle engine uses no CPU.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from typing import AsyncIterator, Optional

from .engine import EngineCore
from .llm import _engine_kwargs
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def _make_wake_fd():
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w


def _shutdown(core: EngineCore, fds):
    core.close()
    for fd in set(fds):
        try:
            os.close(fd)
        except OSError:
            pass


class AsyncLLM:
    """Same constructor as LLM. `async for out in engine.generate(prompt, params)`."""

    def __init__(self, model, **kwargs):
        self._core = EngineCore(_engine_kwargs(model, kwargs))
        self._rfd, self._wfd = _make_wake_fd()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_lock = threading.Lock()
        self._core._engine.start_loop(self._wfd)
        self._finalizer = weakref.finalize(self, _shutdown, self._core, (self._rfd, self._wfd))

    @property
    def tokenizer(self):
        return self._core.tokenizer

    def get_tokenizer(self):
        return self._core.tokenizer

    @property
    def model_config(self) -> dict:
        return dict(self._core.model_config)

    @property
    def closed(self) -> bool:
        return self._core.closed

    def stats(self) -> dict:
        return self._core.stats()

    # -- the wake-up path ---------------------------------------------------
    def _attach(self, loop: asyncio.AbstractEventLoop):
        with self._loop_lock:
            if self._loop is loop:
                return
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(self._rfd)
                except Exception:
                    pass
            loop.add_reader(self._rfd, self._on_wake)
            self._loop = loop

    def _on_wake(self):
        try:
            while True:
                os.read(self._rfd, 8)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return
        self._dispatch()

    def _dispatch(self):
        if self._core.closed:
            return
        for req in self._core.process_events():
            q = req.consumer
            if q is not None:
                q.put_nowait(req)

    # -- public API -----------------------------------------------------------
    async def generate(self, prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs as tokens are produced: cumulative by default,
        new tokens only with SamplingParams(output_kind="delta"), or just the
        last one with output_kind="final_only". Closing or cancelling the
        iterator aborts the request and frees its KV blocks."""
        if self._core.closed:
            from . import EngineClosedError

            raise EngineClosedError("the AsyncLLM is closed")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(prompt, (list, tuple)) and prompt and not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError("AsyncLLM.generate takes one prompt: a str, token ids or a NumPy array")
        loop = asyncio.get_running_loop()
        self._attach(loop)
        text, ids = self._core.tokenize_prompt(prompt)
        queue: asyncio.Queue = asyncio.Queue()
        req = self._core.add_request(request_id, text, ids, params, priority=priority, consumer=queue)
        delta = params.output_kind == "delta"
        final_only = params.output_kind == "final_only"
        try:
            while True:
                await queue.get()
                # Coalesce whatever else arrived for this request.
                while not queue.empty():
                    queue.get_nowait()
                if final_only and not req.finished:
                    continue
                yield EngineCore.build_output(req, delta=delta)
                if req.finished:
                    return
        finally:
            if not req.finished:
                self._core.abort(req.request_id)

    async def abort(self, request_id: str) -> bool:
        """Aborts a request; returns False when no such request is running."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        return self._core.abort(request_id)

    def close(self):
        with self._loop_lock:
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(self._rfd)
                except Exception:
                    pass
            self._loop = None
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
