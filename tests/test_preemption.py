"""Preemption that keeps what it can, and admission that avoids it.

A preempted sequence's blocks stay reclaimable at the tail of the free queue;
resuming takes back those not handed out since and recomputes only the rest.
The engine's outputs after preemption must equal an uninterrupted run's, bit
for bit (greedy and seeded, at every SIMD level this CPU has), and the
admission margin must keep a workload whose requests each fit the pool free of
preemption. The random-workload model test (no starvation, recomputed tokens
as the model counts them) is test_scheduler.py's Driver.
"""
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams, _core
from conveyor._testing import Scheduler
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
needs_stories = pytest.mark.skipif(not STORIES.exists(), reason="stories260K not found")
ALL_LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
TOKEN_BYTES = 1280  # stories260K: 5 layers x 4 KV heads x 8 dims x (K, V) x float32
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird",
           "The sun was", "A cat named Tom", "There was a big tree", "Sam had a red ball"]


# ---------------------------------------------------------------- scheduler: both resume paths


def step(s, token=1):
    """One step with a fake runner: sample for fully computed sequences, finish at max_tokens."""
    plan = s.schedule()
    s.commit()
    for sid in plan["seq_ids"]:
        info = s.seq_info(sid)
        if info["status"] == "running" and info["n_computed"] == info["n_tokens"]:
            s.append_token(sid, token)
            if info["n_tokens"] + 1 >= info["max_total"]:
                s.finish(sid, "length")
    s.check()
    return plan


def test_kept_blocks_partly_reused_are_taken_back_and_the_rest_recomputed():
    # 5 usable blocks of 4; A (8 + 8) and B (4 + 12) both start without a margin.
    s = Scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=16, enable_prefix_caching=False, admission_reserve=-1)
    s.add(1, [3] * 8, 8)
    s.add(2, [4] * 4, 12)
    for _ in range(20):
        plan = step(s)
        if plan["preempted"]:
            break
    # A needed its 4th block with none free: B, the newest, let go of its 2 computed blocks.
    assert plan["preempted"] == [2]
    b = s.seq_info(2)
    assert b["status"] == "waiting" and b["block_table"] == [] and b["n_kept"] == 2
    assert b["kept_computed"] == 8
    # The free queue gave A the block at its head: B's last (the leading one is evicted last).
    st = s.stats()
    assert st["n_recomputed_tokens"] == 0 and st["n_resumed_tokens"] == 0
    resumed_at = None
    while s.num_unfinished():
        plan = step(s)
        if 2 in plan["seq_ids"] and resumed_at is None:
            resumed_at = plan["start_pos"][plan["seq_ids"].index(2)]
    assert resumed_at == 4  # its first block was still its own: only the second is recomputed
    st = s.stats()
    assert st["n_resumed_tokens"] == 4 and st["n_recomputed_tokens"] == 4
    assert st["n_preempted_total"] == 1


@pytest.mark.parametrize("prefix", [False, True])
def test_kept_blocks_not_reused_are_all_taken_back(prefix):
    # One seat: a better-ranked arrival preempts the running one for its seat. Its blocks
    # come from the untouched part of the pool, so the victim's kept blocks survive.
    s = Scheduler(num_blocks=20, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=32, enable_prefix_caching=prefix, policy="priority",
                  admission_reserve=-1)
    s.add(1, [5, 6, 7, 8, 9, 10], 10, priority=1)
    for _ in range(4):
        step(s)
    low = s.seq_info(1)
    assert low["status"] == "running" and low["n_computed"] == 9
    s.add(2, [1, 2, 3], 3, priority=0)
    plan = step(s)
    assert plan["preempted"] == [1] and plan["seq_ids"] == [2]
    assert s.seq_info(1)["kept_computed"] == 9 and s.seq_info(1)["n_kept"] == 3
    while s.seq_info(2)["status"] == "running":
        step(s)
    plan = step(s)  # the victim resumes where it stopped
    assert plan["seq_ids"] == [1] and plan["start_pos"] == [9]
    st = s.stats()
    assert st["n_resumed_tokens"] == 9 and st["n_recomputed_tokens"] == 0
    while s.num_unfinished():
        step(s)
    assert s.seq_info(1)["status"] == "length"


def test_kept_blocks_all_reused_are_recomputed():
    # 4 usable blocks: the arrival needs them all, so nothing of the victim survives.
    s = Scheduler(num_blocks=5, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=16, enable_prefix_caching=False, policy="priority", admission_reserve=-1)
    s.add(1, [5, 6, 7, 8, 9], 3, priority=1)
    step(s)
    s.add(2, [1] * 12, 4, priority=0)
    plan = step(s)
    assert plan["preempted"] == [1] and s.seq_info(1)["kept_computed"] == 5
    while s.seq_info(2)["status"] == "running":
        step(s)
    plan = step(s)
    assert plan["seq_ids"] == [1] and plan["start_pos"] == [0]
    st = s.stats()
    assert st["n_recomputed_tokens"] == 5 and st["n_resumed_tokens"] == 0


def run_workload(reserve, lens, num_blocks=25, bs=4, budget=256, chunked=True, arrivals=None, limit=3000):
    """Drives a workload to completion; returns the stats and, per step, (admitted any, preempted any)."""
    s = Scheduler(num_blocks=num_blocks, block_size=bs, max_num_seqs=16, max_num_batched_tokens=budget,
                  max_model_len=64, enable_prefix_caching=False, enable_chunked_prefill=chunked,
                  admission_reserve=reserve)
    arrivals = arrivals or [0] * len(lens)
    pending = sorted(range(len(lens)), key=lambda i: arrivals[i])
    trace = []
    t = 0
    while pending or s.num_unfinished():
        while pending and arrivals[pending[0]] <= t:
            i = pending.pop(0)
            s.add(i, [1 + i % 7] * lens[i][0], lens[i][1])
        waiting = {sid for sid in range(len(lens)) if sid not in pending
                   and s.seq_info(sid)["status"] == "waiting"}
        plan = step(s)
        admitted = any(sid in waiting for sid in plan["seq_ids"])
        trace.append((admitted, bool(plan["preempted"])))
        t += 1
        assert t < limit, "a request starved"
    return s.stats(), trace


def test_margin_cuts_preemption_on_a_pool_that_cannot_hold_all():
    """Requests that each fit the pool, more than fit at once: the margin preempts far less
    than admission by the first chunk, and not at all when it reserves the whole mean."""
    lens = [(10, 20 + 2 * i) for i in range(12)]  # 30..52 tokens: 8..13 of the 24 blocks
    plain, _ = run_workload(-1, lens)
    default, _ = run_workload(0, lens)
    assert plain["n_preempted_total"] >= 10
    assert default["n_preempted_total"] * 3 <= plain["n_preempted_total"]
    assert default["n_recomputed_tokens"] * 3 <= plain["n_recomputed_tokens"]
    for reserve in (100, 300):
        st, _ = run_workload(reserve, lens)
        assert st["n_preempted_total"] == 0 and st["n_recomputed_tokens"] == 0, reserve


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=14),
       st.sampled_from([0, 25, 50, 300]), st.sampled_from([1, 2, 4, 8]), st.integers(0, 40),
       st.booleans(), st.integers(2, 64))
def test_no_admission_into_certain_preemption(reqs, reserve, bs, spare, chunked, budget):
    """Random workloads and pool sizes: every request ends (none starves), and a step that
    admitted a sequence is never followed by a preemption: admission left room for every
    running sequence's next token and every admitted prompt."""
    lens = [(p, m) for p, m, _ in reqs]
    need = max(-(-(p + m) // bs) for p, m in lens)
    budget = budget if chunked else 64
    _, trace = run_workload(reserve, lens, num_blocks=1 + need + spare, bs=bs, budget=budget, chunked=chunked,
                            arrivals=[a for _, _, a in reqs])
    for (admitted, _), (_, preempted_next) in zip(trace, trace[1:]):
        assert not (admitted and preempted_next)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=14),
       st.sampled_from([1, 2, 4, 8]), st.integers(0, 40), st.booleans())
def test_outputs_that_run_to_max_tokens_are_never_preempted(reqs, bs, spare, chunked):
    """Every output runs to its max_tokens (ignore_eos, a benchmark): the default margin
    then reserves each request's own max_tokens, and counts on the blocks a decoding
    sequence gives back when it reaches it. Any pool that holds each request alone runs
    the workload without one preemption, and every request ends."""
    lens = [(p, m) for p, m, _ in reqs]
    need = max(-(-(p + m) // bs) for p, m in lens)
    st_, _ = run_workload(0, lens, num_blocks=1 + need + spare, bs=bs, budget=64, chunked=chunked,
                          arrivals=[a for _, _, a in reqs])
    assert st_["n_preempted_total"] == 0 and st_["n_recomputed_tokens"] == 0


def test_outputs_cut_at_max_tokens_do_not_make_outputs_look_short():
    """The expected output is learned from outputs that end by a stop; one cut at its
    max_tokens only says the output would have been longer. Until a stop, admission
    reserves each request's max_tokens (admission_reserve_tokens -1)."""
    s = Scheduler(num_blocks=1 + 64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64, enable_prefix_caching=False)
    for sid in range(3):
        s.add(sid, [2] * 4, 2)
    while s.num_unfinished():
        step(s)
    assert s.stats()["admission_reserve_tokens"] == -1  # three short outputs, all cut at max_tokens
    s.add(10, [2] * 4, 40)
    s.add(11, [3] * 4, 40)
    for _ in range(7):  # 10 and 11 sample their first token, then 6 more each
        plan = s.schedule()
        s.commit()
        for sid in plan["seq_ids"]:
            s.append_token(sid, 1)
    s.finish(10, "stopped")  # an EOS after 7 tokens
    # tokens seen: 3 x 2 cut + 7 stopped + 7 running = 20, over 1 stop; the default margin is half
    assert s.stats()["admission_reserve_tokens"] == 20 * 50 // 100 + 1


@pytest.mark.parametrize("usable, admitted", [(23, True), (22, False)])
def test_admission_counts_on_the_blocks_a_sequence_gives_back_when_it_ends(usable, admitted):
    """A running sequence that will reach its max_tokens soon gives its blocks back before
    the others need theirs: a newcomer that fits the peak ahead starts at once, where the
    sum of every running sequence's growth would make it wait; one block less and it
    waits. Nothing is preempted."""
    s = Scheduler(num_blocks=1 + usable, block_size=1, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=16, enable_prefix_caching=False)
    s.add(1, [2] * 2, 3)   # ends at 5 tokens
    s.add(2, [3] * 2, 10)  # ends at 12 tokens
    step(s)                # both prefill and sample: 3 tokens each
    s.add(3, [4] * 2, 6)   # ends at 8 tokens: 8 blocks
    plan = step(s)
    # In that step 1 and 2 decode first (3 blocks each; usable - 6 free), then 3 asks for
    # 8 blocks in all, 1 will need 2 more and 2 will need 9 more: 19 if nobody ended.
    # But 1 ends after 2 steps, when 2 has grown by 2: at most 9 are needed at once,
    # so 3 starts when 9 + 8 <= usable - 6.
    assert (3 in plan["seq_ids"]) == admitted
    assert s.seq_info(1)["status"] == "running"
    while s.num_unfinished():
        step(s)
    assert s.stats()["n_preempted_total"] == 0


def test_a_lone_request_that_fits_always_starts():
    # The margin never blocks a sequence that would run alone, however large.
    s = Scheduler(num_blocks=1 + 8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=32, enable_prefix_caching=False)
    s.add(1, [2] * 20, 12)  # 32 tokens: the whole pool
    s.add(2, [3] * 4, 4)
    steps = 0
    while s.num_unfinished():
        step(s)
        steps += 1
        assert steps < 100
    assert s.stats()["n_preempted_total"] == 0


@pytest.mark.parametrize("bad", [-2, 10001])
def test_admission_reserve_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="admission_reserve"):
        Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=16,
                  admission_reserve=bad)


# ---------------------------------------------------------------- engine: outputs and counters


def level_or_skip(level):
    if level not in _core.kernel_info()["levels"]:
        pytest.skip(f"this CPU lacks the {level} level")


def generate(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


@needs_stories
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_resumed_outputs_equal_uninterrupted(monkeypatch, level, sampling, prefix):
    level_or_skip(level)
    monkeypatch.setenv("CONVEYOR_SIMD", level)
    params = (SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, ignore_eos=True) if sampling == "greedy"
              else SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=40, logprobs=1,
                                  ignore_eos=True))
    with LLM(str(STORIES), num_threads=2, enable_prefix_caching=prefix) as big:
        alone = [generate_one(big, p, params) for p in PROMPTS]
    # 12 blocks of 8: each request fits (at most ~50 tokens), all 8 together do not
    with LLM(str(STORIES), num_threads=2, block_size=8, kv_cache_memory=TOKEN_BYTES * 8 * 12,
             enable_prefix_caching=prefix, admission_reserve=0) as tight:
        got = generate(tight, params)
        st = tight.stats()
    assert got == alone, f"{level} {sampling}: preemption changed the outputs"
    assert st["num_preemptions"] > 0
    assert st["num_resumed_tokens"] > 0  # kept blocks were taken back
    assert st["num_recomputed_tokens"] > 0  # and some had been reused
    assert st["blocks_used"] == 0


def generate_one(llm, prompt, params):
    o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return o.token_ids, [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]


@needs_stories
def test_engine_workload_that_fits_is_not_preempted():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 8 requests of at most ~50 tokens: 7 blocks of 8 each, 56 blocks in all; the pool has 60
    with LLM(str(STORIES), num_threads=2, block_size=8, kv_cache_memory=TOKEN_BYTES * 8 * 60) as roomy:
        roomy.generate(PROMPTS, params, use_tqdm=False)
        st = roomy.stats()
    assert st["num_preemptions"] == 0 and st["num_recomputed_tokens"] == 0 and st["num_resumed_tokens"] == 0


@needs_stories
def test_engine_margin_preempts_less_on_a_tight_pool():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(num_threads=2, block_size=8, kv_cache_memory=TOKEN_BYTES * 8 * 12)
    with LLM(str(STORIES), **kw) as margin:
        got = [o.outputs[0].token_ids for o in margin.generate(PROMPTS, params, use_tqdm=False)]
        with_margin = margin.stats()
    with LLM(str(STORIES), admission_reserve=0, **kw) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
        without = plain.stats()
    assert got == want
    assert with_margin["num_preemptions"] < without["num_preemptions"]
    assert with_margin["num_recomputed_tokens"] < without["num_recomputed_tokens"]


@needs_stories
def test_recomputed_and_resumed_tokens_in_stats_and_metrics():
    from conveyor.server.metrics import ServerMetrics

    with LLM(str(STORIES), num_threads=2, block_size=8, kv_cache_memory=TOKEN_BYTES * 8 * 12,
             admission_reserve=0) as tight:
        tight.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        st = tight.stats()
    assert st["num_recomputed_tokens"] > 0 and st["num_resumed_tokens"] > 0
    text = ServerMetrics("m").render(st, 0)
    assert f'conveyor_num_recomputed_tokens_total{{model_name="m"}} {st["num_recomputed_tokens"]}' in text
    assert f'conveyor_num_resumed_tokens_total{{model_name="m"}} {st["num_resumed_tokens"]}' in text


@needs_stories
@pytest.mark.parametrize("bad, err", [(-1, ValueError), (10001, ValueError), (True, TypeError), (0.5, TypeError)])
def test_engine_admission_reserve_is_checked(bad, err):
    with pytest.raises(err, match="admission_reserve"):
        LLM(str(STORIES), admission_reserve=bad)


# ---------------------------------------------------------------- the adaptive batch limit


@needs_stories
def test_adaptive_batch_limit_changes_no_output_and_can_be_turned_off():
    """The running target the step-time model sets never exceeds max_num_seqs, turning it
    off leaves max_num_seqs as the only seat limit, and either way every request's tokens
    are the same (a request's output does not depend on the batch it ran in, nor on the
    steps whose decodes the model held back to time another batch size: at most one in
    eight, none when it is off)."""
    prompts = PROMPTS * 6
    sp = [SamplingParams(max_tokens=8 + 5 * (i % 7), temperature=0.0) for i in range(len(prompts))]
    got = {}
    for adaptive in (True, False):
        llm = LLM(str(STORIES), max_num_seqs=32, adaptive_batch_limit=adaptive)
        try:
            got[adaptive] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            st = llm.stats()
            target = st["running_target"]
        finally:
            llm.close()
        assert 1 <= target <= 32
        assert st["num_held_back_steps"] <= st["steps"] // 8 + 1
        if not adaptive:
            assert target == 32 and st["num_held_back_steps"] == 0
    assert got[True] == got[False]


def test_adaptive_batch_limit_must_be_a_bool():
    with pytest.raises(TypeError, match="adaptive_batch_limit"):
        LLM(str(STORIES), adaptive_batch_limit=1)
