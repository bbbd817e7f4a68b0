"""One LLM shared by several threads (a thread-pool web server's use), and the
SamplingParams and logprob fields a user reads back."""
import sys
import threading

import pytest

from conveyor import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    with LLM("stories260K", num_threads=1) as engine:
        yield engine


def _in_threads(n, fn):
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a generate() thread hung"
    if errors:
        raise errors[0]


def test_greedy_outputs_from_threads_equal_one_thread(llm):
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ref = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids
    got = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: events taken by one, applied by another
    try:
        def work():
            for _ in range(3):
                got.extend(o.outputs[0].token_ids for o in llm.generate(["Once upon a time"] * 3, sp, use_tqdm=False))
        _in_threads(4, work)
    finally:
        sys.setswitchinterval(old)
    assert len(got) == 36
    assert all(g == ref for g in got)


def test_guided_requests_from_threads_end_as_alone(llm):
    pytest.importorskip("llguidance")
    from conveyor import GuidedDecodingParams

    sp = SamplingParams(temperature=0, max_tokens=30,
                        guided_decoding=GuidedDecodingParams(regex=r"[a-z]{3,8} [0-9]{2}"))
    alone = llm.generate("Q:", sp, use_tqdm=False)[0].outputs[0]
    assert alone.finish_reason == "stop"
    aborted0 = llm.stats()["requests_aborted"]
    outs = []
    _in_threads(4, lambda: outs.extend(llm.generate(["Q:"] * 2, sp, use_tqdm=False)))
    assert [(o.outputs[0].text, o.outputs[0].finish_reason, o.guided_error) for o in outs] == \
        [(alone.text, "stop", None)] * 8
    assert llm.stats()["requests_aborted"] == aborted0


def test_a_short_call_returns_while_another_threads_run_goes_on(llm):
    long_sp = SamplingParams(max_tokens=480, ignore_eos=True)
    started = threading.Event()

    def long_run():
        started.set()
        llm.generate(["Once upon a time"] * 48, long_sp, use_tqdm=False)

    th = threading.Thread(target=long_run)
    th.start()
    try:
        started.wait(10)
        while llm.stats()["num_running"] == 0 and th.is_alive():
            pass
        out = llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)[0]
        still_running = llm.stats()["num_running"] + llm.stats()["num_waiting"]
    finally:
        th.join(timeout=120)
    assert len(out.outputs[0].token_ids) == 1
    # it did not wait for the other thread's 48 x 480 tokens to end
    assert still_running > 0


def test_stop_changed_after_construction_is_used(llm):
    sp = SamplingParams(temperature=0, max_tokens=20)
    sp.stop = "girl"
    o = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == "girl"
    assert "girl" not in o.text
    sp.stop = 5
    with pytest.raises(TypeError) as e:
        llm.generate("Once upon a time", sp, use_tqdm=False)
    assert e.value.field == "stop"


def test_stop_strings_without_a_tokenizer_are_refused():
    with LLM("stories260K", num_threads=1, skip_tokenizer_init=True) as bare:
        with pytest.raises(ValueError, match="need a tokenizer") as e:
            bare.generate([[1, 403, 407]], SamplingParams(max_tokens=3, stop="a"), use_tqdm=False)
        assert e.value.field == "stop"
        # stop_token_ids need none
        out = bare.generate([[1, 403, 407]], SamplingParams(max_tokens=3, stop_token_ids=[2]), use_tqdm=False)
        assert out[0].outputs[0].token_ids


@pytest.mark.parametrize("kw, field", [
    ({"stop_token_ids": [10**12]}, "stop_token_ids"),
    ({"allowed_token_ids": [-(10**15)]}, "allowed_token_ids"),
    ({"logit_bias": {10**30: 1.0}}, "logit_bias"),
])
def test_ids_beyond_int32_are_named_as_given(llm, kw, field):
    with pytest.raises(ValueError) as e:
        llm.generate("Hi", SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert e.value.field == field
    given = str(next(iter(kw[field])))
    assert given in str(e.value) and "2147483647" not in str(e.value)


def test_priority_must_be_a_list(llm):
    with pytest.raises(TypeError, match="priority"):
        llm.generate("Hi", SamplingParams(max_tokens=1), priority=5, use_tqdm=False)


def test_logprobs_carry_each_tokens_text(llm):
    tok = llm.get_tokenizer()
    o = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 4
    for tid, entry in zip(o.token_ids, o.logprobs):
        assert entry[tid].rank == 1  # greedy: the chosen token is the likeliest
        for t, lp in entry.items():
            assert lp.decoded_token == tok.token_bytes(t).decode("utf-8", errors="replace")
    assert "".join(e[t].decoded_token for t, e in zip(o.token_ids, o.logprobs)) == o.text


def test_a_sampled_tokens_rank_is_given_outside_the_top_logprobs(llm):
    sp = dict(temperature=1.5, seed=3, max_tokens=24)
    wide = llm.generate(["Once upon a time"], SamplingParams(logprobs=20, **sp), use_tqdm=False)[0].outputs[0]
    narrow = llm.generate(["Once upon a time"], SamplingParams(logprobs=1, **sp), use_tqdm=False)[0].outputs[0]
    assert wide.token_ids == narrow.token_ids
    for tid, w, n in zip(wide.token_ids, wide.logprobs, narrow.logprobs):
        assert w[tid].rank == n[tid].rank >= 1
        better = sum(lp.logprob > w[tid].logprob for t, lp in w.items() if t != tid)
        if w[tid].rank <= 20:  # among the 20: its place there
            assert w[tid].rank == better + 1
        else:  # beyond them: all 20 are likelier
            assert better == 20
    assert any(n[t].rank > 1 for t, n in zip(narrow.token_ids, narrow.logprobs))


def test_a_positive_value_below_floats_range_stays_positive(llm):
    greedy = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tiny = llm.generate(["Once upon a time"], SamplingParams(temperature=0.8, seed=1, top_p=1e-300, max_tokens=8),
                        use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids  # only the likeliest is left
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["x"], SamplingParams(top_p=-1e-300), use_tqdm=False)


def test_numpy_scalars_are_taken_as_numbers(llm):
    np = pytest.importorskip("numpy")
    sp = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.0), top_k=np.int32(3),
                        stop_token_ids=[np.int64(2)], logit_bias={np.int64(5): np.float32(0.5)})
    assert type(sp.max_tokens) is int and type(sp.temperature) is float
    assert sp.stop_token_ids == [2] and sp.logit_bias == {5: 0.5}
    plain = SamplingParams(max_tokens=4, temperature=0.0, top_k=3, stop_token_ids=[2], logit_bias={5: 0.5})
    got = llm.generate(["Once upon a time"] * 2, [sp, plain], use_tqdm=False)
    assert got[0].outputs[0].token_ids == got[1].outputs[0].token_ids


def test_best_of_zero_is_refused():
    with pytest.raises(ValueError) as e:
        SamplingParams(best_of=0)
    assert e.value.field == "best_of"


def test_no_token_left_names_the_constraint_the_request_set():
    pytest.importorskip("llguidance")
    import asyncio

    from conveyor import AsyncLLM, GuidedDecodingParams

    async def run():
        eng = AsyncLLM("stories260K", num_threads=1)
        try:
            # the grammar allows one token, then only the end; min_tokens forbids the end
            sp = SamplingParams(max_tokens=4, min_tokens=3, guided_decoding=GuidedDecodingParams(choice=["y"]))
            with pytest.raises(ValueError) as e:
                async for _ in eng.generate("Q:", sp):
                    pass
            return e.value.field
        finally:
            eng.close()

    assert asyncio.run(run()) == "min_tokens"
