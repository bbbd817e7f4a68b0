"""A wall-clock cap on Python code that a request or a model file controls (a chat
template's loops): past the deadline a watchdog raises an exception in the running
thread, which Python delivers between two bytecodes. C code (a tokenizer's Rust
core, a regex) is not interrupted; those get size caps instead.

One watchdog thread per process serves every call. Starting a thread per call would
need a fresh stack each time, which fails in a process whose address space is capped
(the chat-template workers) once a render has used most of the cap;
`start_watchdog()` lets such a process start it before the cap is set.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class _Expired(BaseException):
    """Raised into the thread by the watchdog; a BaseException so that the capped code's
    own `except Exception` blocks do not swallow it."""


def _raise_in(thread_id: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


class _Call:
    __slots__ = ("due", "tid", "fired")

    def __init__(self, due: float, tid: int):
        self.due, self.tid, self.fired = due, tid, False


class _Watchdog:
    """Raises _Expired into each registered thread whose deadline passes while it is
    still registered; the lock makes "fired" and "finished" exclusive."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.calls: set[_Call] = set()
        self.thread = threading.Thread(target=self._run, name="conveyor-deadline", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                for c in self.calls:
                    if not c.fired and c.due <= now:
                        c.fired = True
                        _raise_in(c.tid, ctypes.py_object(_Expired))
                pending = [c.due for c in self.calls if not c.fired]
                self.cond.wait(min(pending) - now if pending else None)


_watchdog: Optional[_Watchdog] = None
_watchdog_lock = threading.Lock()


def start_watchdog() -> None:
    """Starts this process's watchdog thread if it is not running (after a fork the
    child has none and gets its own)."""
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None or _watchdog.pid != os.getpid():
            _watchdog = _Watchdog()


def call_with_deadline(seconds: float, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), or TimeoutError naming `what` when it runs past `seconds`."""
    start_watchdog()
    dog = _watchdog
    call = _Call(time.monotonic() + seconds, threading.get_ident())
    try:
        with dog.cond:
            dog.calls.add(call)
            dog.cond.notify()
        try:
            return fn(*args, **kwargs)
        finally:
            with dog.cond:
                dog.calls.discard(call)
                if call.fired:
                    _raise_in(call.tid, None)  # an exception not delivered yet must not land later
    except _Expired:
        with dog.cond:  # delivered inside the finally above, before its discard ran
            dog.calls.discard(call)
        raise TimeoutError(f"{what} took longer than {seconds:g} s") from None
