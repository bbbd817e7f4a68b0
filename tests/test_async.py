"""AsyncLLM: streaming, concurrency, aborts, closing."""
import asyncio
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
    assert len(seen) > 3  # incremental
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
