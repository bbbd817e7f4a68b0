"""Requests that wait for a LoRA slot (every slot held by running requests): they count
against max_queued_requests while they wait and are never refused afterwards, their timeout
runs from the call, an abort while waiting is counted, an adapter unloaded while in use
leaves when its last request ends, and AsyncLLM reads a new adapter off the event loop."""
import asyncio
import threading
import time

import pytest

from conveyor import AsyncLLM, EngineOverloadedError, LLM, LoRARequest, SamplingParams
from conveyor import testing as T

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    with LLM("stories260K") as llm:
        cfg = llm.model_config
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i in range(2):
        w = T.random_lora_weights(cfg, 4, seed=i + 1, scale=0.3)
        path = T.write_peft_adapter(root / f"ad{i}", w, rank=4, alpha=4)
        out.append(LoRARequest(f"ad{i}", i + 1, str(path)))
    return out


async def _until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        await asyncio.sleep(0.005)


def _run(body, **engine):
    """body(engine) on a fresh AsyncLLM over stories260K with adapters enabled, closed after."""
    async def main():
        eng = AsyncLLM("stories260K", enable_lora=True, **engine)
        try:
            await body(eng)
        finally:
            eng.close()

    asyncio.run(main())


async def _running(eng, adapter, request_id="A"):
    """A long request under `adapter`, scheduled (its slot held) by the time this returns."""
    stream = eng.add_request("Once upon a time", LONG, request_id, lora_request=adapter)
    await stream.__anext__()
    return stream


async def _drain(stream):
    last = None
    async for out in stream:
        last = out
    return last.outputs[0].finish_reason, len(last.outputs[0].token_ids)


def test_a_waiting_request_counts_against_the_queue_and_starts_later(adapters):
    async def body(eng):
        a = await _running(eng, adapters[0])  # holds the one slot
        b = eng.add_request("Once upon a time", SHORT, "B", lora_request=adapters[1])
        await _until(lambda: eng.stats()["lora_requests_waiting"] == 1)  # read, and waits for the slot
        c = eng.add_request("The dog", SHORT, "C")  # queued in the engine: two wait now
        with pytest.raises(EngineOverloadedError, match="max_queued_requests=2"):
            eng.add_request("The cat", SHORT, "D")
        with pytest.raises(EngineOverloadedError):
            eng.add_request("The cat", SHORT, "E", lora_request=adapters[1])
        got = await asyncio.wait_for(asyncio.gather(_drain(a), _drain(b), _drain(c)), 60)
        assert got == [("length", 400), ("length", 5), ("length", 5)]
        assert eng._thread.is_alive()
        st = eng.stats()
        assert st["lora_requests"] == {"ad0": 1, "ad1": 1} and st["lora_requests_waiting"] == 0

    _run(body, max_loras=1, max_num_seqs=1, max_queued_requests=2)


def test_a_waiting_requests_timeout_runs_from_the_call(adapters):
    with LLM("stories260K", enable_lora=True, max_loras=1, num_threads=1) as llm:
        core = llm._core
        ids = llm.get_tokenizer().encode("Once upon a time")
        a = core.add_request("A", None, ids, LONG, lora_request=adapters[0])
        b = core.add_request("B", None, ids, LONG, timeout=0.2, lora_request=adapters[1])
        core.step()
        assert not a.finished and not b.finished  # B waits for A's slot
        time.sleep(0.3)
        core.step()
        assert b.finished and not a.finished  # ended at its deadline, while A still holds the slot
        out = core.build_output(b)
        assert out.outputs[0].finish_reason == "timeout" and out.outputs[0].token_ids == []
        while not a.finished:
            core.step()
        assert core.build_output(a).outputs[0].finish_reason == "length"
        st = llm.stats()
        assert st["requests_timed_out"] == 1 and st["lora_requests"] == {"ad0": 1, "ad1": 1}


def test_an_abort_while_waiting_is_counted(adapters):
    async def body(eng):
        a = await _running(eng, adapters[0])
        b = eng.add_request("Once upon a time", SHORT, "B", lora_request=adapters[1])
        await _until(lambda: eng.stats()["lora_requests_waiting"] == 1)
        await eng.abort("B")
        assert (await asyncio.wait_for(_drain(b), 60))[0] == "abort"
        assert (await asyncio.wait_for(_drain(a), 60))[0] == "length"
        st = eng.stats()
        assert st["requests_aborted"] == 1 and st["lora_requests_waiting"] == 0

    _run(body, max_loras=1)


def test_an_adapter_forgotten_in_use_leaves_when_its_request_ends(adapters):
    async def body(eng):
        a = await _running(eng, adapters[0])
        assert eng.stats()["lora_resident"] == 1
        assert eng._core.forget_lora(adapters[0].lora_int_id) is False  # A runs under it
        assert (await asyncio.wait_for(_drain(a), 60)) == ("length", 400)
        assert eng.stats()["lora_resident"] == 0
        assert not eng._core.is_lora_read(adapters[0])  # out of host memory too

    _run(body, max_loras=2)


def test_async_reads_a_new_adapter_off_the_event_loop(adapters, monkeypatch):
    from conveyor.lora_slots import LoRASlots

    readers = []
    load = LoRASlots.load

    def record(self, req):
        readers.append(threading.current_thread())
        return load(self, req)

    monkeypatch.setattr(LoRASlots, "load", record)

    async def body(eng):
        got = await asyncio.wait_for(_drain(eng.add_request("Once", SHORT, lora_request=adapters[1])), 60)
        assert got == ("length", 5)
        assert readers and threading.main_thread() not in readers
        readers.clear()  # read already: the next request adds inline, reading nothing
        await asyncio.wait_for(_drain(eng.add_request("Once", SHORT, lora_request=adapters[1])), 60)
        assert readers == []

    _run(body, max_loras=2)


def test_chat_takes_a_lora_request(adapters):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    with LLM("stories260K", enable_lora=True) as llm, pytest.warns(UserWarning, match="chat template"):
        chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12), lora_request=adapters[0], use_tqdm=False)
        base = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        prompt = {"prompt_token_ids": chat[0].prompt_token_ids}
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), lora_request=adapters[0],
                            use_tqdm=False)
    assert chat[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert chat[0].outputs[0].token_ids != base[0].outputs[0].token_ids


@pytest.mark.parametrize("bad", [0, -1, 2**63, 2**70])
def test_lora_int_id_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", bad, "/nonexistent")
