"""Serving under load, in the engine and AsyncLLM: stall-free mixed steps (the prefill
cap while sequences decode), per-request deadlines, the queue limit and priorities."""
import asyncio
from pathlib import Path

import pytest

import conveyor
from conveyor import LLM, AsyncLLM, SamplingParams
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not STORIES.exists(), reason="stories260K not found")

GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
# Holds the only seat for seconds however fast the kernels are (16 completions of 500
# tokens run one after another with max_num_seqs=1); tests close it when done with it.
BLOCKER = SamplingParams(temperature=0.0, max_tokens=500, n=16, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


async def _first_output(stream):
    out = await stream.__anext__()
    assert not out.finished
    return out


async def _drain(stream):
    last = None
    async for out in stream:
        last = out
    return last


async def _wait_free(engine, timeout=10.0):
    """Blocks are returned on the engine thread; wait for the stats to show it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        st = engine.stats()
        if st["blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0:
            return st
        await asyncio.sleep(0.01)
    return engine.stats()


# ---------------------------------------------------------------- mixed steps


def test_long_prompt_while_16_decode_is_capped_and_outputs_match_solo():
    cap = 16
    prompts = [f"Once upon a time, there was a {w}" for w in
               ("cat", "dog", "bird", "fish", "girl", "boy", "king", "queen",
                "tree", "car", "ball", "cake", "frog", "bear", "duck", "star")]
    with LLM(str(STORIES), num_threads=1) as llm:
        tok = llm.get_tokenizer()
        long_ids = (tok.encode("Tom and Sue went to the park to play with a big red ball. ") * 12)[:300]
        # LONG (400 tokens): the 16 still decode when the long prompt arrives, however
        # fast the machine (with 60 they could all be done before it is added)
        solo = [out.outputs[0].token_ids for out in llm.generate(prompts, LONG, use_tqdm=False)]
        solo_long = llm.generate({"prompt_token_ids": long_ids}, SamplingParams(temperature=0.0, max_tokens=8),
                                 use_tqdm=False)[0].outputs[0].token_ids
    assert len(long_ids) == 300

    async def go():
        engine = AsyncLLM(str(STORIES), num_threads=1, max_prefill_tokens_while_decoding=cap)
        try:
            engine._core.set_trace(True)
            streams = [engine.add_request(p, LONG) for p in prompts]
            for s in streams:  # every one decodes before the long prompt arrives
                await _first_output(s)
            long = engine.add_request({"prompt_token_ids": long_ids},
                                      SamplingParams(temperature=0.0, max_tokens=8))
            outs = await asyncio.gather(*[_drain(s) for s in streams + [long]])
            trace = engine._core.take_trace()
            ids = [s._req.internal_id for s in streams]
            return outs, trace, ids, long._req.internal_id, await _wait_free(engine)
        finally:
            engine.close()

    outs, trace, ids, long_id, st = run(go())
    for want, out in zip(solo, outs[:16]):
        assert out.outputs[0].token_ids == want
    assert outs[16].outputs[0].token_ids == solo_long
    by_step = {}
    for step, _t0, _t1, rid, _idx, n_new, _n_prompt_work in trace:
        by_step.setdefault(step, {})[rid] = n_new
    long_steps = [s for s in sorted(by_step) if by_step[s].get(long_id, 0) > 1]
    assert len(long_steps) >= 300 // cap  # the prompt went in chunks
    prefill_total = 0
    for s in long_steps:
        plan = by_step[s]
        assert plan[long_id] <= cap, plan
        decoding = [rid for rid in ids if rid in plan]
        assert decoding and all(plan[rid] == 1 for rid in decoding)
        prefill_total += plan[long_id]
    assert prefill_total + sum(1 for s in by_step if by_step[s].get(long_id) == 1) >= 300
    assert st["blocks_used"] == 0


def test_prefill_cap_argument_is_checked():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        LLM(str(STORIES), max_prefill_tokens_while_decoding=-1)
    with pytest.raises(TypeError, match="max_queued_requests"):
        LLM(str(STORIES), max_queued_requests="8")


# ---------------------------------------------------------------- deadlines


def test_deadline_ends_running_and_queued_requests_and_frees_blocks():
    # Stepped by hand, so that "running" and "queued" are certain: one seat, the first
    # request runs, the second waits behind it; both deadlines pass between two steps.
    import time

    with LLM(str(STORIES), num_threads=1, max_num_seqs=1) as llm:
        core = llm._core
        tok = llm.get_tokenizer()
        # the default policy starts the least work first: the shorter prompt runs
        running = core.add_request(None, "a", tok.encode("The dog"), LONG, timeout=0.3)
        queued = core.add_request(None, "b", tok.encode("Once upon a time"), LONG, timeout=0.3)
        for _ in range(5):
            core.step()
        assert len(running.seqs[0].token_ids) == 5 and queued.seqs[0].token_ids == []
        assert core.stats()["blocks_used"] > 0
        time.sleep(0.35)
        core.step()
        for req in (running, queued):
            assert req.finished and req.seqs[0].finish_reason == "timeout"
        assert len(running.seqs[0].token_ids) == 5
        st = core.stats()
        assert st["requests_timed_out"] == 2 and st["blocks_used"] == 0 and st["num_queued"] == 0
        assert not core.has_unfinished()


def test_deadline_through_async_generate():
    async def go():
        engine = AsyncLLM(str(STORIES), num_threads=1, max_num_seqs=1)
        try:
            blocker = engine.add_request("Once upon a time", BLOCKER)  # holds the only seat
            await _first_output(blocker)
            queued = await _drain(engine.generate("The dog", LONG, timeout=0.05))
            blocker.close()
            ok = await _drain(engine.generate("A bird", GREEDY, timeout=60))
            return queued, ok, await _wait_free(engine)
        finally:
            engine.close()

    queued, ok, st = run(go())
    assert queued.finished and queued.outputs[0].finish_reason == "timeout"
    assert queued.outputs[0].token_ids == []
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 60
    assert st["requests_timed_out"] == 1 and st["blocks_used"] == 0


def test_deadline_through_llm_generate():
    # One seat, taken in arrival order: the blocker runs, the second request waits; both
    # deadlines pass.
    with LLM(str(STORIES), num_threads=1, max_num_seqs=1, scheduling="fcfs") as llm:
        blocker, queued = llm.generate(["Once upon a time", "The dog"], [BLOCKER, GREEDY], timeout=0.3,
                                       use_tqdm=False)
        assert blocker.finished and queued.finished
        reasons = [o.finish_reason for o in blocker.outputs]
        assert "timeout" in reasons and len(blocker.outputs[0].token_ids) > 0  # keeps what it generated
        assert queued.outputs[0].finish_reason == "timeout" and len(queued.outputs[0].token_ids) < 60
        st = llm._core.stats()
        assert st["requests_timed_out"] == 2 and st["blocks_used"] == 0
        # no deadline: runs to its length; a bad deadline is refused before anything is queued
        (ok,) = llm.generate(["A bird"], GREEDY, use_tqdm=False)
        assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 60
        for bad, exc in ((0, ValueError), ("1", TypeError)):
            with pytest.raises(exc, match="timeout"):
                llm.generate(["A bird"], GREEDY, use_tqdm=False, timeout=bad)
        assert llm._core.stats()["num_queued"] == 0


def test_timeout_argument_is_checked():
    async def go():
        with AsyncLLM(str(STORIES), num_threads=1) as engine:
            for bad, exc in ((0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                             ("1", TypeError), (True, TypeError)):
                with pytest.raises(exc, match="timeout"):
                    engine.add_request("hi", GREEDY, timeout=bad)

    run(go())


# ---------------------------------------------------------------- queue limit


def test_queue_limit_refuses_the_excess_at_once():
    async def go():
        engine = AsyncLLM(str(STORIES), num_threads=1, max_num_seqs=1, max_queued_requests=3)
        try:
            # scheduled: it no longer counts as queued; 400 tokens keep the only seat
            # busy while the eight requests below arrive, however fast the CPU
            blocker = engine.add_request("Once upon a time", LONG)
            await _first_output(blocker)
            admitted, refused = [blocker], []
            for i in range(8):
                try:
                    admitted.append(engine.add_request(f"Story {i}", GREEDY))
                except conveyor.EngineOverloadedError as e:
                    refused.append(str(e))
            outs = await asyncio.gather(*[_drain(s) for s in admitted])
            later = await _drain(engine.generate("After the rush", GREEDY))  # room again
            return outs, refused, later, await _wait_free(engine)
        finally:
            engine.close()

    outs, refused, later, st = run(go())
    assert len(outs) == 4 and len(refused) == 5
    assert "max_queued_requests=3" in refused[0]
    assert all(o.finished for o in outs) and len(outs[0].outputs[0].token_ids) == 400
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs[1:])
    assert later.outputs[0].finish_reason == "length"
    assert st["requests_rejected"] == 5 and st["num_queued"] == 0 and st["blocks_used"] == 0
    assert issubclass(conveyor.EngineOverloadedError, conveyor.ConveyorError)


# ---------------------------------------------------------------- priority


def test_high_priority_request_overtakes_the_queue_and_preempts_the_running_one():
    with LLM(str(STORIES), num_threads=1) as llm:
        solo_blocker = llm.generate("Once upon a time", LONG, use_tqdm=False)[0].outputs[0].token_ids

    async def go():
        engine = AsyncLLM(str(STORIES), num_threads=1, max_num_seqs=1, scheduling="priority")
        try:
            # LONG: it must outlast the seven arrivals below, however loaded the machine
            blocker = engine.add_request("Once upon a time", LONG, priority=5)
            await _first_output(blocker)
            order = []

            async def track(name, stream):
                await _drain(stream)
                order.append(name)

            tasks = [track(f"low{i}", engine.add_request(f"Story {i}", GREEDY, priority=10)) for i in range(6)]
            tasks.append(track("high", engine.add_request("The king", GREEDY, priority=-1)))
            outs = {}

            async def keep(stream):
                outs["blocker"] = await _drain(stream)
                order.append("blocker")

            tasks.append(keep(blocker))
            await asyncio.gather(*tasks)
            return order, outs["blocker"], engine._core.stats()
        finally:
            engine.close()

    order, blocker_out, st = run(go())
    # the blocker held the only seat; the high one takes it (the blocker is preempted,
    # then resumes before the low ones, which it outranks); the low ones go in arrival order
    assert order == ["high", "blocker"] + [f"low{i}" for i in range(6)]
    assert st["num_preemptions"] >= 1
    assert blocker_out.outputs[0].token_ids == solo_blocker  # recomputed, same text


def test_prefill_cap_defaults_per_frontend():
    """LLM (offline batches) runs without the prefill cap; AsyncLLM (and so the server) keeps
    the serving default (96 on the CPU). Either takes an explicit value."""
    from conveyor.engine import DEFAULT_PREFILL_CAP, OFFLINE_PREFILL_CAP

    with LLM(str(STORIES), num_threads=1) as llm:
        assert llm._core.args.resolved_prefill_cap() == OFFLINE_PREFILL_CAP == 0
    with LLM(str(STORIES), num_threads=1, max_prefill_tokens_while_decoding=32) as llm:
        assert llm._core.args.resolved_prefill_cap() == 32
    engine = AsyncLLM(str(STORIES), num_threads=1)
    try:
        assert engine._core.args.resolved_prefill_cap() == DEFAULT_PREFILL_CAP["cpu"] == 96
    finally:
        engine.close()
