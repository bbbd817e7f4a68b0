"""AsyncLLM: streaming, concurrency, aborts, closing."""
import asyncio
import os
import threading
from pathlib import Path

import pytest

import conveyor
from conveyor import AsyncLLM, LLM, SamplingParams
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not STORIES.exists(), reason="stories260K not found")


@pytest.fixture(scope="module")
def engine():
    e = AsyncLLM(str(STORIES), num_threads=2)
    yield e
    e.close()


def run(coro):
    return asyncio.run(coro)


def test_stream_matches_generate(engine):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with LLM(str(STORIES), num_threads=1) as llm:
        want = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]

    async def go():
        seen = []
        async for out in engine.generate("Once upon a time", params):
            seen.append(out)
        return seen

    seen = run(go())
    assert len(seen) == 40  # incremental: one output a token
    lens = [len(o.outputs[0].token_ids) for o in seen]
    assert lens == sorted(lens)
    for a, b in zip(seen, seen[1:]):  # cumulative: each extends the last
        assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert seen[-1].finished and not seen[0].finished
    assert seen[-1].outputs[0].token_ids == want.token_ids
    assert seen[-1].outputs[0].text == want.text


def test_delta_mode(engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, output_kind="delta")

    async def go():
        toks, text = [], ""
        async for out in engine.generate("Once upon a time", params):
            toks += out.outputs[0].token_ids
            text += out.outputs[0].text
        return toks, text

    toks, text = run(go())
    full = run(_collect(engine, "Once upon a time", SamplingParams(temperature=0.0, max_tokens=30)))
    assert toks == full.outputs[0].token_ids and text == full.outputs[0].text


async def _collect(engine, prompt, params, request_id=None):
    last = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        last = out
    return last


def test_200_concurrent_streams(engine):
    async def one(i):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=10 + i % 20)
        n_prev = 0
        chunks = 0
        async for out in engine.generate(f"Story {i}: once upon a time", params):
            n = len(out.outputs[0].token_ids)
            assert n >= n_prev
            n_prev = n
            chunks += 1
            last = out
        return last, chunks

    async def go():
        return await asyncio.gather(*(one(i) for i in range(200)))

    results = run(go())
    for i, (out, chunks) in enumerate(results):
        assert out.finished
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == 10 + i % 20
    assert engine.stats()["blocks_used"] == 0


def test_abort_mid_stream_frees_blocks(engine):
    async def go():
        gen = engine.generate("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True),
                              request_id="to-abort")
        got = 0
        async for out in gen:
            got += 1
            if got == 5:
                break
        await gen.aclose()
        # the abort reaches the engine at its next step
        for _ in range(200):
            if engine.stats()["blocks_used"] == 0 and engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)
        return got

    assert run(go()) == 5
    assert engine.stats()["blocks_used"] == 0


def test_explicit_abort_and_cancel(engine):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def go():
        first = asyncio.Event()

        async def consume():
            last = None
            async for out in engine.generate("Once upon a time", long, request_id="abc"):
                last = out
                first.set()
            return last

        task = asyncio.create_task(consume())
        await first.wait()
        assert await engine.abort("abc")
        out = await task
        assert out.outputs[0].finish_reason == "abort"
        assert len(out.outputs[0].token_ids) < 400
        assert not await engine.abort("abc")  # unknown now

        started = asyncio.Event()

        async def consume_forever():
            async for _ in engine.generate("x", long):
                started.set()

        t2 = asyncio.create_task(consume_forever())
        await started.wait()
        t2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t2
        for _ in range(200):
            if engine.stats()["blocks_used"] == 0 and engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)

    run(go())
    assert engine.stats()["blocks_used"] == 0


def test_duplicate_request_id(engine):
    async def go():
        gen1 = engine.generate("a", SamplingParams(max_tokens=300, ignore_eos=True), request_id="dup")
        await gen1.__anext__()
        with pytest.raises(ValueError, match="dup"):
            await _collect(engine, "b", SamplingParams(max_tokens=5), request_id="dup")
        await gen1.aclose()

    run(go())


def test_add_request_from_threads(engine):
    results = {}

    def worker(i):
        async def go():
            return await _collect(engine, "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12))
        results[i] = asyncio.run(go())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    texts = {r.outputs[0].text for r in results.values()}
    assert len(results) == 4 and len(texts) == 1


def test_bad_input_raises_before_queueing(engine):
    async def go():
        with pytest.raises(ValueError):
            await _collect(engine, "", SamplingParams())
        with pytest.raises(TypeError):
            await _collect(engine, "hi", "not params")
        with pytest.raises(ValueError):
            await _collect(engine, [1] * 600, SamplingParams())

    run(go())
    assert engine.num_unfinished() == 0


def test_closed_engine():
    e = AsyncLLM(str(STORIES), num_threads=1)

    async def go():
        gen = e.generate("Once", SamplingParams(max_tokens=500, ignore_eos=True))
        await gen.__anext__()
        e.close()  # with a request in flight
        with pytest.raises(conveyor.EngineClosedError):
            await _collect(e, "hi", SamplingParams())

    run(go())
    e.close()


def test_context_managers():
    async def go():
        async with AsyncLLM(str(STORIES), num_threads=1) as e:
            out = await _collect(e, "Hello", SamplingParams(max_tokens=3))
            assert out.finished
        assert e.closed

    run(go())


# ------------------------------------------------- preparation off the event loop

async def _max_tick_gap(work):
    """Runs work() beside a coroutine that sleeps 5 ms at a time; returns (work's
    result or exception, the longest gap between two of its ticks, in seconds)."""
    import time

    gaps, done = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    gaps.clear()
    try:
        result = await work()
    except Exception as e:
        result = e
    done.set()
    await task
    return result, max(gaps)


def _spy_preparation(eng):
    """Wraps eng._prepare so that the names of the threads it runs on are recorded."""
    names, prepare = [], eng._prepare

    def spy(*args):
        names.append(threading.current_thread().name)
        return prepare(*args)

    eng._prepare = spy
    return names


def _assert_loop_kept_ticking(gap, what):
    """The loop's longest stall is well under the second or more that the work took on the
    loop before it moved to the preparation threads (the threads' names are the exact
    check; on 2 shared cores a tick can wait 150-400 ms for a core, so the limit is loose).
    Not timed under ASan (tools/sanitize.sh), where the preparation runs several times
    slower."""
    if os.environ.get("CONVEYOR_SANITIZED") == "1":
        return
    assert gap < 0.5, f"the event loop stalled {gap * 1000:.0f} ms while {what}"


async def _drain_stream(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_add_request_prepares_long_bad_words_off_the_loop():
    """1000 bad words of 250 characters (near the request budget) took the pure-Python
    tokenizer about a second on the event loop inside add_request; now they are
    tokenized on a preparation thread and the loop keeps ticking. The answer is the one
    LLM.generate gives with the same bad words."""
    words = [f"w{i} " + "ab" * 120 for i in range(1000)]
    params = SamplingParams(temperature=0.0, max_tokens=16, bad_words=words)

    async def go():
        with AsyncLLM(str(STORIES), num_threads=1) as eng:
            threads = _spy_preparation(eng)
            res = await _max_tick_gap(lambda: _drain_stream(eng.add_request("Once upon a time", params)))
            return res, threads

    (out, gap), threads = run(go())
    with LLM(str(STORIES), num_threads=1) as llm:
        want = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert not isinstance(out, Exception), out
    assert out.finished and out.outputs[0].token_ids == want.token_ids
    assert len(threads) == 1 and threads[0].startswith("conveyor-prepare"), threads
    _assert_loop_kept_ticking(gap, "the request was prepared")


SMOL = Path.home() / ".cache" / "conveyor" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not SMOL.exists(), reason="SmolLM2 GGUF not found")
def test_add_request_tokenizes_a_huge_prompt_off_the_loop():
    """A text prompt just under the byte bound (about 1.3 MB for SmolLM2) took seconds
    to tokenize inside add_request, on the event loop, with the GIL held throughout.
    Now add_request returns at once, the loop keeps ticking while a preparation thread
    tokenizes it (GIL released), and the stream's first read raises the engine's
    refusal (too long for max_model_len), naming the prompt."""
    import random

    async def go():
        with AsyncLLM(str(SMOL), num_threads=1) as eng:
            threads = _spy_preparation(eng)
            rng = random.Random(0)
            words = (''.join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(2, 9)))
                     for _ in range(10 ** 7))
            text = ""
            while len(text) < eng._core.max_prompt_bytes - 1000:
                text += " ".join(next(words) for _ in range(10000)) + " "
            text = text[:eng._core.max_prompt_bytes - 1000]
            async def work():
                big = eng.add_request(text, SamplingParams(max_tokens=2))
                # a short prompt, tokenized on the loop, does not wait behind the long one
                ok = await _drain_stream(eng.add_request("Hello", SamplingParams(max_tokens=2)))
                try:
                    await _drain_stream(big)
                except ValueError as e:
                    return e, ok
                return None, ok

            (res, ok), gap = await _max_tick_gap(work)
            return res, gap, ok, len(text), threads

    res, gap, ok, n, threads = run(go())
    assert n > 1_000_000
    assert isinstance(res, ValueError) and "prompt" in str(res), res
    assert ok.finished and len(ok.outputs[0].token_ids) == 2  # the engine goes on serving
    # only the long prompt goes to the preparation threads; "Hello" is tokenized on the loop
    assert len(threads) == 1 and threads[0].startswith("conveyor-prepare"), threads
    _assert_loop_kept_ticking(gap, "the prompt was tokenized")


def test_request_added_while_prepared_can_be_aborted_and_closed():
    """A request being prepared is aborted by id (it ends as "abort" once added), and a
    stream closed before its preparation ends never reaches the engine."""
    text = "Once upon a time " * 70  # long enough to be prepared off the loop (~280 tokens)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def go():
        with AsyncLLM(str(STORIES), num_threads=1) as eng:
            stream = eng.add_request(text, params, request_id="slow")
            assert stream._req is None  # still being prepared
            assert await eng.abort("slow")
            aborted = await _drain_stream(stream)
            closed = eng.add_request(text, params, request_id="gone")
            reader = asyncio.create_task(_drain_stream(closed))  # waits for its first output
            await asyncio.sleep(0)
            closed.close()
            last = await asyncio.wait_for(reader, 30)  # the close wakes it: no output
            await asyncio.sleep(0.5)
            return aborted, last, eng.num_unfinished(), await eng.abort("gone")

    aborted, last, unfinished, again = run(go())
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) < 200
    assert last is None and unfinished == 0 and not again


def test_close_during_a_delta_stream_ends_with_a_delta():
    """The output a close() leaves is a delta like every other: joined, the deltas are the
    tokens once."""
    async def go():
        eng = AsyncLLM(str(STORIES), num_threads=1)
        params = SamplingParams(max_tokens=480, ignore_eos=True, output_kind="delta", seed=1)
        outs = []

        async def consume():
            async for o in eng.generate("Once upon a time", params):
                outs.append(o)

        task = asyncio.create_task(consume())
        while sum(len(o.outputs[0].token_ids) for o in outs) < 20 and not task.done():
            await asyncio.sleep(0.001)
        ended_first = task.done()
        eng.close()
        await asyncio.wait_for(task, 30)
        return outs, ended_first

    outs, ended_first = run(go())
    if ended_first:
        pytest.skip("the request ended before close()")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    joined = [t for o in outs for t in o.outputs[0].token_ids]
    assert 20 <= len(joined) < 480, len(joined)
    assert len(outs[-1].outputs[0].token_ids) < len(joined)  # not the whole completion again


def test_abort_during_preparation_frees_the_id_at_once():
    """A request aborted while it is prepared (a text over 1 KiB) ends "abort" with nothing
    generated; its id may name a new request at once, which runs."""
    text = "Once upon a time " * 70

    async def last(stream):
        out = None
        async for out in stream:
            pass
        return out.outputs[0].finish_reason, len(out.outputs[0].token_ids)

    async def go():
        async with AsyncLLM(str(STORIES), num_threads=1) as eng:
            first = eng.add_request(text, SamplingParams(max_tokens=150, ignore_eos=True), "job")
            for prompt in (text, "short, added inline"):  # while it is prepared, its id is taken
                with pytest.raises(ValueError, match="already in use"):
                    eng.add_request(prompt, SamplingParams(max_tokens=3), "job")
            assert await eng.abort("job")
            second = eng.add_request(text, SamplingParams(max_tokens=3, ignore_eos=True), "job")
            return await asyncio.wait_for(asyncio.gather(last(first), last(second)), 60)

    assert run(go()) == [("abort", 0), ("length", 3)]


def test_a_stream_closed_while_its_bad_request_is_prepared_logs_nothing(caplog):
    async def go():
        async with AsyncLLM(str(STORIES), num_threads=1) as eng:
            s = eng.add_request("x" * 20000, SamplingParams(max_tokens=4))  # too long: preparing it raises
            s.close()
            await asyncio.sleep(0.3)
            import gc

            gc.collect()
            await asyncio.sleep(0.05)

    with caplog.at_level("ERROR", logger="asyncio"):
        run(go())
    assert "never retrieved" not in caplog.text


class _Gone(Exception):
    pass


@pytest.mark.parametrize("read", ["iterate", "next_batch"])
def test_a_failed_stream_gives_what_was_delivered_then_the_error_and_frees_its_blocks(engine, read):
    """RequestStream.fail (a server shutting down): the reader gets the outputs already
    delivered, then the error; the request is aborted."""
    async def go():
        stream = engine.add_request("Once upon a time", SamplingParams(max_tokens=480, ignore_eos=True))
        first = await stream.__anext__()
        for _ in range(3):  # let a few more outputs in (the request is far from its end)
            await asyncio.sleep(0)
        assert stream.has_output
        stream.fail(_Gone("bye"))
        stream.fail(_Gone("twice"))  # a second fail changes nothing
        got = [first]
        with pytest.raises(_Gone, match="bye"):
            if read == "iterate":
                async for out in stream:
                    got.append(out)
            else:
                while True:
                    got.extend(await stream.next_batch())
        assert await stream.next_batch() == [] and not [o async for o in stream]
        for _ in range(200):
            if engine.stats()["blocks_used"] == 0 and engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)
        return got

    got = run(go())
    lens = [len(o.outputs[0].token_ids) for o in got]
    assert lens == sorted(lens) and not got[-1].finished and len(got[-1].outputs[0].token_ids) < 480
    assert engine.stats()["blocks_used"] == 0


def test_a_stream_failed_while_prepared_is_never_added(engine):
    async def go():
        stream = engine.add_request("Once upon a time " * 2000, SamplingParams(max_tokens=4))  # prepared off the loop
        assert not stream.has_output
        stream.fail(_Gone("bye"))
        with pytest.raises(_Gone):
            await stream.__anext__()
        await asyncio.sleep(0.3)
        return engine.num_unfinished()

    assert run(go()) == 0
