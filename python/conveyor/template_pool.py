"""Chat templates rendered in a small pool of worker processes with hard limits.

A chat template is code from the model file (or the request) run on every chat
request. Operator-by-operator caps cannot bound it: one C call (`join`, `format`,
`str.format` widths, a chain of `+`) builds a gigabyte before any check runs. So
templates render in worker processes whose address space is capped (`RLIMIT_AS`)
and whose CPU time per render is capped (`RLIMIT_CPU`, reset before each render),
at a lower CPU priority than the server's own threads:
an allocation past the cap is a MemoryError inside the worker, a spin past the CPU
limit kills it, and either way the caller gets a ValueError naming the template.
Workers are started on first use and reused across requests (a render costs one
round trip over a pipe); a worker that died is replaced.

Protocol (pipes, one request at a time per worker): a 4-byte little-endian length
then a JSON array each way (JSON, not pickle: nothing a worker sends can run code
here). Requests: ["render", source, messages, add_generation_prompt, bos_token,
eos_token]. Replies: ["ok", text] or ["error", exception type name, message].
"""
from __future__ import annotations

import os
import json
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Optional

# The worker's address space beyond what the interpreter holds after start-up: far
# above what a real template needs (its output is about the size of the messages).
TEMPLATE_MAX_MEMORY = 256 << 20
# CPU seconds one render may take in the worker (past it the kernel kills it); the
# renderer's own 2 s deadline answers first with a TimeoutError for a Python loop.
TEMPLATE_MAX_CPU_SECONDS = 4
# Wall-clock seconds the caller waits for a render (a loaded machine is slower).
TEMPLATE_MAX_WAIT_SECONDS = 20.0
POOL_SIZE = 2
# Workers run this much nicer than the server: a template spinning to its CPU limit
# takes the CPU the event loop and the engine leave, not theirs.
TEMPLATE_NICENESS = 10


def _send(fd: int, obj) -> None:
    data = json.dumps(obj).encode("ascii")  # ASCII: lone surrogates travel as escapes
    data = struct.pack("<I", len(data)) + data
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _recv_exact(fd: int, n: int, deadline: Optional[float]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer in time")
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("the worker is gone")
        buf += chunk
    return bytes(buf)


def _recv(fd: int, deadline: Optional[float] = None):
    (n,) = struct.unpack("<I", _recv_exact(fd, 4, deadline))
    return json.loads(_recv_exact(fd, n, deadline))


# ------------------------------------------------------------------ the worker side


def _vm_size() -> int:
    """This process's address space in bytes (0 where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker_main() -> None:
    """Reads render requests from stdin, answers on stdout, until stdin closes."""
    from .chat_template import render_chat_template
    from .deadline import start_watchdog

    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr  # nothing printed may reach the protocol pipe
    start_watchdog()  # its thread's stack is reserved before the address space is capped
    size = _vm_size()
    if size:  # where the size is unknown (no /proc), the CPU limit alone applies
        limit = size + TEMPLATE_MAX_MEMORY
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]  # inherited: a limit may only go down
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker killed for CPU leaves no core file
    try:
        os.nice(TEMPLATE_NICENESS)
    except OSError:
        pass  # the priority is a courtesy to the server, not a limit
    while True:
        try:
            req = _recv(rfd)
        except EOFError:
            return
        _, source, messages, add_generation_prompt, bos, eos = req
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu + TEMPLATE_MAX_CPU_SECONDS, resource.RLIM_INFINITY))
        try:
            reply = ["ok", render_chat_template(source, messages, add_generation_prompt, bos, eos)]
        except MemoryError:
            reply = ["error", "ValueError", f"chat template failed to render: it needs more than "
                                            f"{TEMPLATE_MAX_MEMORY >> 20} MiB of memory"]
        except Exception as e:  # noqa: BLE001 (every error goes back to the caller)
            reply = ["error", type(e).__name__, str(e)]
        try:
            _send(wfd, reply)
        except MemoryError:
            _send(wfd, ["error", "ValueError", "chat template failed to render: its output is too large"])


# ------------------------------------------------------------------ the caller side


class _Worker:
    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if "ASAN_OPTIONS" in env:
            # Under AddressSanitizer, its own bookkeeping also lives in the capped address
            # space: freed memory held in quarantine, the allocation stacks it records and the
            # exit-time leak scan (which maps memory and starts a thread) would fail at the
            # cap, a report about the cap and not about any code. The worker runs no C code
            # of its own to check.
            env["ASAN_OPTIONS"] += ":detect_leaks=0:quarantine_size_mb=0:malloc_context_size=0"
        self.proc = subprocess.Popen([sys.executable, "-c", "from conveyor.template_pool import _worker_main; "
                                      "_worker_main()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, close_fds=True, start_new_session=True)

    def render(self, request: list):
        _send(self.proc.stdin.fileno(), request)
        return _recv(self.proc.stdout.fileno(), time.monotonic() + TEMPLATE_MAX_WAIT_SECONDS)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class TemplatePool:
    """Up to `size` worker processes, each rendering one template at a time."""

    def __init__(self, size: int = POOL_SIZE):
        self.size = size
        self._idle: list[_Worker] = []
        self._started = 0
        self._cond = threading.Condition()

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle and self._started >= self.size:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Worker()
        except BaseException:
            self._drop()
            raise

    def _give_back(self, w: _Worker) -> None:
        with self._cond:
            self._idle.append(w)
            self._cond.notify()

    def _drop(self) -> None:
        with self._cond:
            self._started -= 1
            self._cond.notify()

    def render(self, source: str, messages: list, add_generation_prompt: bool, bos_token: str,
               eos_token: str) -> str:
        """The rendered template; ValueError (or ModelFormatError for a template that
        does not compile) when it fails or runs past the worker's limits."""
        from ._core import ModelFormatError

        w = self._take()
        try:
            reply = w.render(["render", source, messages, add_generation_prompt, bos_token, eos_token])
        except (EOFError, TimeoutError, OSError, ValueError, struct.error) as e:
            w.kill()
            self._drop()
            why = "took too long" if isinstance(e, TimeoutError) else \
                f"ran past its limits ({TEMPLATE_MAX_MEMORY >> 20} MiB, {TEMPLATE_MAX_CPU_SECONDS} s of CPU)"
            raise ValueError(f"chat template failed to render: the renderer {why}") from None
        except BaseException:
            w.kill()
            self._drop()
            raise
        self._give_back(w)
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        if kind == "ModelFormatError":
            raise ModelFormatError(message)
        if kind == "TypeError":
            raise TypeError(message)
        raise ValueError(message if message.startswith("chat template") else
                         f"chat template failed to render: {kind}: {message}")

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for w in idle:
            w.kill()


_pool: Optional[TemplatePool] = None
_pool_lock = threading.Lock()


def render_in_pool(source: str, messages: list, add_generation_prompt: bool, bos_token: str,
                   eos_token: str) -> str:
    """Renders a chat template in the process-wide pool (started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = TemplatePool()
            import atexit

            atexit.register(_pool.close)
    return _pool.render(source, messages, add_generation_prompt, bos_token, eos_token)
