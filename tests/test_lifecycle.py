"""Closing: close(), context managers, and interpreter exit with requests in
flight neither hang nor crash."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not STORIES.exists(), reason="stories260K not found")


def run_script(body: str) -> subprocess.CompletedProcess:
    code = f"MODEL = {str(STORIES)!r}\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_exit_with_async_requests_in_flight():
    r = run_script("""
        import asyncio
        from conveyor import AsyncLLM, SamplingParams
        engine = AsyncLLM(MODEL)
        async def main():
            gens = [engine.generate("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
                    for _ in range(8)]
            for g in gens:
                await g.__anext__()
            print("started", flush=True)
        asyncio.run(main())
        # no close(): the interpreter exits with 8 requests running
    """)
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout


def test_exit_from_a_thread_while_generating():
    r = run_script("""
        import threading, os
        from conveyor import LLM, SamplingParams
        llm = LLM(MODEL)
        def work():
            llm.generate(["Once upon a time"] * 32, SamplingParams(max_tokens=400, ignore_eos=True),
                         use_tqdm=False)
        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(0.2)
        print("exiting", flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert "exiting" in r.stdout
    # the exit closed the engine under the thread: it ends quietly, like any daemon thread
    assert "Exception in thread" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_close_twice_and_context_manager():
    r = run_script("""
        import asyncio
        from conveyor import LLM, AsyncLLM, SamplingParams
        with LLM(MODEL) as llm:
            print(len(llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)))
        llm.close(); llm.close()
        e = AsyncLLM(MODEL); e.close(); e.close()
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "ok"]
