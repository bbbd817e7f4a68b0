"""A wall-clock cap on Python code that a request or a model file controls (a chat
template's loops): past the deadline a timer raises an exception in the running
thread, which Python delivers between two bytecodes. C code (a tokenizer's Rust
core, a regex) is not interrupted; those get size caps instead.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class _Expired(BaseException):
    """Raised into the thread by the timer; a BaseException so that the capped code's
    own `except Exception` blocks do not swallow it."""


def _raise_in(thread_id: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


def call_with_deadline(seconds: float, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), or TimeoutError naming `what` when it runs past `seconds`."""
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"running": True, "fired": False}

    def fire():
        with lock:
            if state["running"]:
                state["fired"] = True
                _raise_in(tid, ctypes.py_object(_Expired))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return fn(*args, **kwargs)
        finally:
            with lock:
                state["running"] = False
            timer.cancel()
            if state["fired"]:
                _raise_in(tid, None)  # an exception not delivered yet must not land later
    except _Expired:
        raise TimeoutError(f"{what} took longer than {seconds:g} s") from None
