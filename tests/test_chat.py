"""`conveyor chat`: a real process fed through a pipe and through a pseudo-terminal. The
answers are checked against LLM.chat on the same conversation (greedy), so the history
kept, /reset and the streaming are all held to an independent path."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conveyor.testing import subprocess_env
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
ARGS = ["--temperature", "0", "--max-tokens", "24"]


def chat_cmd(model, *extra):
    return [sys.executable, "-m", "conveyor", "chat", str(model), *ARGS, *extra]


@pytest.fixture(scope="module")
def reference():
    """The answer LLM.chat gives to a conversation (the stop the chat adds for a model
    without a template included)."""
    import conveyor
    from conveyor import SamplingParams

    llm = conveyor.LLM(str(MODEL), max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=24, stop=["\nuser:"])

    def answer(conversation):
        with warnings.catch_warnings():  # stories260K has no template: the built-in format
            warnings.simplefilter("ignore")
            return llm.chat([conversation], params, use_tqdm=False)[0].outputs[0].text
    yield answer
    llm.close()


def test_piped_conversation_keeps_history_and_resets(tmp_path, reference):
    lines = ["Hello there", "/help", "Tell me about a dog", "/reset", "", "Tell me about a dog", "/bogus"]
    r = subprocess.run(chat_cmd(MODEL), input="\n".join(lines) + "\n", capture_output=True, text=True,
                       timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "no chat template" in r.stderr
    first = reference([{"role": "user", "content": "Hello there"}])
    second = reference([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
                        {"role": "user", "content": "Tell me about a dog"}])
    fresh = reference([{"role": "user", "content": "Tell me about a dog"}])
    assert second != fresh  # the history changes the answer, so the check below means something
    expected = (f"{first}\n\n" + "  /reset  forget the conversation\n  /exit   leave (also /bye, Ctrl-D)\n"
                "  /help   list the commands\n" + f"{second}\n\n(conversation forgotten)\n{fresh}\n\n"
                "unknown command /bogus; /help lists them\n")
    assert r.stdout == expected


def test_exit_command_and_long_message(tmp_path):
    r = subprocess.run(chat_cmd(MODEL, "--max-model-len", "64"),
                       input="word " * 200 + "\n/exit\nnever read\n", capture_output=True, text=True,
                       timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "(that message is too long for the context of 64 tokens)\n"


def test_a_system_message_too_long_for_the_context_is_named(tmp_path):
    r = subprocess.run(chat_cmd(MODEL, "--max-model-len", "64", "--system", "word " * 200),
                       input="hi\n", capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("conveyor chat: error: --system: the system message takes"), r.stderr
    assert r.stdout == ""


def _read_until(fd, marker: bytes, timeout: float = 60.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"{marker!r} not seen; got {buf[-400:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            buf += chunk
    return buf


def _spawn_on_pty(cmd):
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        env = subprocess_env()
        os.execve(sys.executable, cmd, {k: str(v) for k, v in env.items()})
    return pid, fd


def _wait(pid, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("conveyor chat did not exit")


def test_terminal_prompt_ctrl_c_and_ctrl_d(reference):
    """On a terminal: the prompt, an answer, Ctrl-C at the prompt (a reminder, not an exit),
    Ctrl-D (leaves, status 0)."""
    pid, fd = _spawn_on_pty(chat_cmd(MODEL))
    try:
        _read_until(fd, b">>> ")
        os.write(fd, b"Hello there\n")
        out = _read_until(fd, b">>> ").decode("utf-8", "replace").replace("\r\n", "\n")
        assert reference([{"role": "user", "content": "Hello there"}]) in out
        os.write(fd, b"\x03")  # Ctrl-C
        assert b"/exit or Ctrl-D" in _read_until(fd, b">>> ")
        os.write(fd, b"\x04")  # Ctrl-D
        assert _wait(pid) == 0
    finally:
        os.close(fd)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(234, pid, tid, sig) != 0:  # SYS_tgkill on x86-64
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="directs the signal at one thread with Linux x86-64's tgkill")
def test_ctrl_c_taken_by_another_thread_still_reaches_the_prompt():
    """A Ctrl-C is a signal to the whole process, and the kernel may hand it to any of its
    threads (the engine's among them). Sent to one that is not the main thread, it must still
    end the wait at the prompt, as a blocking read of the line would not."""
    pid, fd = _spawn_on_pty(chat_cmd(MODEL))
    try:
        _read_until(fd, b">>> ")
        os.write(fd, b"Hello there\n")
        _read_until(fd, b">>> ")
        others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
        assert others, "the engine runs threads of its own"
        _tgkill(pid, others[0], signal.SIGINT)
        assert b"/exit or Ctrl-D" in _read_until(fd, b">>> ", timeout=20)
        os.write(fd, b"/exit\n")
        assert _wait(pid) == 0
    finally:
        os.close(fd)


def test_ctrl_c_stops_the_answer_not_the_program(tmp_path):
    """A long answer from the default model (cached), interrupted: it stops at once, the
    program goes on and takes the next line."""
    from conveyor.default_model import find_default_model

    smol = find_default_model()
    if smol is None:
        pytest.skip("the default model is not fetched here")
    p = subprocess.Popen([sys.executable, "-m", "conveyor", "chat", str(smol), "--temperature", "0",
                          "--max-tokens", "2000", "--max-model-len", "2048"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=subprocess_env(), cwd=tmp_path)
    try:
        p.stdin.write(b"Write a very long story about a dragon and a knight.\n")
        p.stdin.flush()
        assert _read_until(p.stdout.fileno(), b" ", timeout=120)  # the answer is streaming
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        assert b"[stopped]" in _read_until(p.stdout.fileno(), b"[stopped]", timeout=30)
        assert time.monotonic() - t0 < 10
        p.stdin.write(b"/exit\n")
        p.stdin.flush()
        assert p.wait(30) == 0
        assert b"Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
