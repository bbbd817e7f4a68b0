"""Speculative decoding with n-gram (prompt lookup) proposals.

What a user checks: greedy (and seeded) outputs are the same token for token with
and without speculation, whatever shares the batch, under preemption and prefix
caching; speculation actually happened (proposals accepted, fewer steps); every KV
block returns to the pool; bad configurations are refused naming the field; the
sampled distribution is the model's (a chi-square test with its power stated).
"""
import json
import math

import numpy as np
import pytest

from conveyor import LLM, AsyncLLM, SamplingParams

STORY = ("Once upon a time, there was a little girl named Lily. She liked to play outside with her ball. "
         "One day, Lily went to the park with her mom. Once upon a time, there was a little")
PROMPTS = [STORY, "The cat sat on the mat. The dog sat on the log. The cat sat on the",
           "Tom had a big red ball. Tom had a", "Sue was happy."]


def spec(k, lo=1, hi=3, **kw):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi,
            "disable_by_batch_size": 0, **kw}


def token_ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def stories(stories_dir):
    return str(stories_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def plain(stories):
    with LLM(stories, max_num_seqs=16) as llm:
        yield llm


def check_all_free(llm):
    llm._core._engine.check_invariants()
    st = llm.stats()
    assert st["blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("k,lo,hi", [(1, 1, 1), (3, 1, 3), (5, 2, 4), (8, 1, 5)])
def test_greedy_identical_stories(stories, plain, k, lo, hi):
    sp = SamplingParams(temperature=0, max_tokens=96)
    ref = token_ids(plain.generate(PROMPTS, sp, use_tqdm=False))
    with LLM(stories, max_num_seqs=16, speculative_config=spec(k, lo, hi)) as llm:
        got = token_ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        st = llm.stats()
        assert got == ref
        assert st["spec_accepted"] > 0 and st["spec_proposed"] > st["spec_accepted"]
        assert len(st["spec_proposed_at"]) == k and st["spec_proposed_at"][0] >= st["spec_proposed_at"][-1]
        assert sum(st["spec_accepted_at"]) == st["spec_accepted"]
        assert st["generation_tokens"] == sum(len(t[0]) for t in ref)
        check_all_free(llm)


def test_greedy_alone_takes_fewer_steps(stories, plain):
    sp = SamplingParams(temperature=0, max_tokens=96)
    s0 = plain.stats()["steps"]
    ref = token_ids(plain.generate([STORY], sp, use_tqdm=False))
    plain_steps = plain.stats()["steps"] - s0
    with LLM(stories, speculative_config=spec(4)) as llm:
        assert token_ids(llm.generate([STORY], sp, use_tqdm=False)) == ref
        assert llm.stats()["steps"] < plain_steps


def test_mixed_batch_with_non_speculating_sequences(stories, plain):
    """Prompts without repeats (nothing to look up), a long prompt prefilled in chunks
    while others verify proposals, n > 1, varied max_tokens."""
    rng = np.random.default_rng(3)
    distinct = [list(map(int, rng.permutation(np.arange(3, 500))[:n])) for n in (12, 40)]
    long_prompt = list(map(int, rng.integers(3, 500, size=300)))
    prompts = PROMPTS + distinct + [long_prompt]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (80, 17, 64, 33, 50, 71, 40)]
    params[1] = SamplingParams(temperature=0, max_tokens=30, n=2)
    ref = token_ids(plain.generate(prompts, params, use_tqdm=False))
    with LLM(stories, max_num_seqs=16, max_num_batched_tokens=64,
             speculative_config=spec(4, 2, 4)) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == ref
        assert llm.stats()["spec_accepted"] > 0
        check_all_free(llm)


def test_greedy_identical_random_hf_model(tiny_hf_dir):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, size=n))) for n in (5, 23, 60)]
    prompts.append(prompts[1] * 3)  # repeats: proposals from the prompt itself
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(tiny_hf_dir, max_num_seqs=8) as llm:
        ref = token_ids(llm.generate(prompts, sp, use_tqdm=False))
    for k in (2, 6):
        with LLM(tiny_hf_dir, max_num_seqs=8, speculative_config=spec(k, 1, 4)) as llm:
            assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
            assert llm.stats()["spec_accepted"] > 0
            check_all_free(llm)


def test_greedy_identical_smollm2(smollm2_gguf):
    passage = ("The lighthouse keeper climbed the narrow stairs every evening at dusk. He polished the "
               "great lens, trimmed the wick and wrote the weather in his log: wind from the west, a "
               "light rain, three fishing boats returning before dark.")
    prompt = f"Repeat the following passage exactly.\n\n{passage}\n\nPassage: "
    sp = SamplingParams(temperature=0, max_tokens=48)
    with LLM(smollm2_gguf, max_model_len=512, max_num_seqs=4) as llm:
        ref = llm.generate([prompt, "What is the capital of France?"], sp, use_tqdm=False)
    with LLM(smollm2_gguf, max_model_len=512, max_num_seqs=4, speculative_config=spec(5, 2, 4)) as llm:
        got = llm.generate([prompt, "What is the capital of France?"], sp, use_tqdm=False)
        assert token_ids(got) == token_ids(ref)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
        st = llm.stats()
        assert st["spec_accepted"] > 10, st
        check_all_free(llm)


# ---------------------------------------------------------------- KV: preemption, prefix cache, rollback


def test_preemption_with_a_tiny_kv_cache(stories, plain):
    prompts = PROMPTS * 2
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ref = token_ids(plain.generate(prompts, sp, use_tqdm=False))
    for prefix in (True, False):
        # no admission margin: every request starts when its prompt fits, so the pool runs out
        with LLM(stories, max_num_seqs=8, block_size=4, kv_cache_memory=40 * 4 * 1280, admission_reserve=0,
                 enable_prefix_caching=prefix, speculative_config=spec(6, 1, 3)) as llm:
            assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
            st = llm.stats()
            assert st["num_preemptions"] > 0 and st["spec_accepted"] > 0
            check_all_free(llm)


def test_prefix_cache_holds_only_verified_tokens(stories):
    """A second request whose prompt is the first one's prompt + output reuses the
    blocks the first one filled while speculating: wrong KV (a rejected proposal
    cached) would change its output."""
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(stories, block_size=4, speculative_config=spec(6, 1, 2)) as llm:
        first = llm.generate([STORY], sp, use_tqdm=False)[0]
        follow = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)[:50]
        hits0 = llm.stats()["prefix_hits"]
        got = token_ids(llm.generate([follow], sp, use_tqdm=False))
        assert llm.stats()["prefix_hits"] - hits0 >= 4 * ((len(follow) - 1) // 4) - 4
        assert llm.stats()["spec_proposed"] > llm.stats()["spec_accepted"] > 0
        check_all_free(llm)
    with LLM(stories, block_size=4, enable_prefix_caching=False) as llm:
        assert got == token_ids(llm.generate([follow], sp, use_tqdm=False))


def test_every_step_keeps_the_invariants_under_many_rejections(stories):
    """Stepping by hand: the scheduler's and pool's checker after every step, and
    every block free at the end, with many proposals rejected."""
    with LLM(stories, max_num_seqs=8, block_size=4, speculative_config=spec(8, 1, 1)) as llm:
        core = llm._core
        reqs = [core.add_request(None, p, core.tokenize_prompt(p)[1],
                                 SamplingParams(temperature=t, seed=i, max_tokens=70, ignore_eos=True))
                for i, (p, t) in enumerate(zip(PROMPTS * 2, [0, 0.8] * 4))]
        while core.has_unfinished():
            core.step()
            core._engine.check_invariants()
        assert all(r.finished for r in reqs)
        st = llm.stats()
        assert st["spec_proposed"] - st["spec_accepted"] > 100
        check_all_free(llm)


# ---------------------------------------------------------------- stops, lengths, logprobs, seeds


def test_stops_max_tokens_and_logprobs_keep_their_meaning(stories, plain):
    cases = [SamplingParams(temperature=0, max_tokens=7),
             SamplingParams(temperature=0, max_tokens=90, stop=["park"], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=90, stop=[" the"]),
             SamplingParams(temperature=0, max_tokens=90, stop_token_ids=[13]),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
             SamplingParams(temperature=0, max_tokens=30, logprobs=3)]
    for sp in cases:
        ref = plain.generate(PROMPTS, sp, use_tqdm=False)
        with LLM(stories, speculative_config=spec(6, 1, 3)) as llm:
            got = llm.generate(PROMPTS, sp, use_tqdm=False)
            check_all_free(llm)
        for a, b in zip(got, ref):
            ca, cb = a.outputs[0], b.outputs[0]
            assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
                   (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason), sp
            if sp.logprobs:
                assert len(ca.logprobs) == len(cb.logprobs) == len(ca.token_ids)
                for la, lb in zip(ca.logprobs, cb.logprobs):
                    assert la.keys() == lb.keys()
                    for t in la:
                        assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                        assert la[t].rank == lb[t].rank


def test_seeded_sampling_is_the_same_draw_for_draw(stories, plain):
    """Each kept token takes the same single draw from the completion's stream as a
    plain decode would (row j draws, a proposal is kept only when the draw equals
    it), so seeded outputs do not depend on speculation either."""
    sp = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=60, n=2) for s in range(6)]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in range(6)]
    ref = token_ids(plain.generate(prompts, sp, use_tqdm=False))
    with LLM(stories, max_num_seqs=16, speculative_config=spec(4, 1, 3)) as llm:
        assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
        assert llm.stats()["spec_accepted"] > 0


# ---------------------------------------------------------------- the sampled distribution


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): 1 - the regularized lower incomplete gamma
    P(df/2, x/2), by its series (enough for the p-values compared here)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > total * 1e-15 and n < 10000:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


def two_sample_chi2(ca: np.ndarray, cb: np.ndarray) -> tuple[float, int]:
    """Chi-square homogeneity test of two count vectors over the same categories;
    returns (p-value, degrees of freedom)."""
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    df = len(tot) - 1
    return chi2_sf(stat, df), df


def categories(samples_a, samples_b, min_expected=5):
    """Counts of each outcome in both arms; outcomes seen fewer than min_expected
    times in all are pooled into one category."""
    from collections import Counter

    ca, cb = Counter(samples_a), Counter(samples_b)
    common = [o for o in set(ca) | set(cb) if ca[o] + cb[o] >= 2 * min_expected]
    rest_a = len(samples_a) - sum(ca[o] for o in common)
    rest_b = len(samples_b) - sum(cb[o] for o in common)
    a = np.array([ca[o] for o in common] + [rest_a], dtype=float)
    b = np.array([cb[o] for o in common] + [rest_b], dtype=float)
    return a, b


def test_chi2_sf_matches_known_quantiles():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(23.209, 10) == pytest.approx(0.01, abs=1e-3)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_distribution_matches_without_speculation(stories, plain, temperature, top_p):
    """The first three tokens after STORY over N seeds with speculation against N
    other seeds without: a chi-square homogeneity test on their joint outcome. Each
    completion makes 5 tokens; the lookup proposes " girl named Lily" after the first,
    so tokens 2 and 3 come from verification rows (kept or redrawn at random).

    Power: with N = 2000 per arm, the same test at alpha = 0.001 detects a shift of
    0.1 in total variation (mass moved from the likeliest outcome to the second) in
    at least 90% of runs, which the simulation below checks. A wrong rule moves
    more: always keeping the proposal, or drawing the rejected token again, moves
    p(d)(1 - p(d)) = 0.23 at the acceptance rate measured here (p(d) about 0.65)."""
    n, alpha = 2000, 1e-3
    sp = lambda s: SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_tokens=5, ignore_eos=True)
    ref = plain.generate([STORY] * n, [sp(s) for s in range(n, 2 * n)], use_tqdm=False)
    with LLM(stories, max_num_seqs=256, speculative_config=spec(3, 1, 3)) as llm:
        got = llm.generate([STORY] * n, [sp(s) for s in range(n)], use_tqdm=False)
        st = llm.stats()
    rejected = st["spec_proposed_at"][0] - st["spec_accepted_at"][0]
    assert st["spec_accepted_at"][0] > 200 and rejected > 200, st  # both paths taken many times
    first3 = lambda outs: [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    a, b = categories(first3(got), first3(ref))
    p, df = two_sample_chi2(a, b)
    assert df >= 1 and p > alpha, (p, df, a, b)

    # the power statement, by simulation on the plain arm's own distribution
    rng = np.random.default_rng(0)
    base = b / b.sum()
    order = np.argsort(-base)
    shifted = base.copy()
    eps = min(0.1, base[order[0]])
    shifted[order[0]] -= eps
    shifted[order[1]] += eps
    trials = 300
    detected = sum(two_sample_chi2(rng.multinomial(n, shifted).astype(float),
                                   rng.multinomial(n, base).astype(float))[0] <= alpha for _ in range(trials))
    assert detected / trials >= 0.9, detected / trials


# ---------------------------------------------------------------- frontends, load switch, config errors


def async_outputs(model, speculative_config, prompts, sp):
    """The final outputs of prompts run at once through an AsyncLLM, and its stats."""
    import asyncio

    async def run():
        with AsyncLLM(model, speculative_config=speculative_config) as llm:
            async def one(i, p):
                final = None
                async for out in llm.generate(p, sp, request_id=f"r{i}"):
                    final = out
                return final
            outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return outs, llm.stats()

    return asyncio.run(run())


def test_async_llm_matches(stories, plain):
    sp = SamplingParams(temperature=0, max_tokens=64)
    ref = token_ids(plain.generate(PROMPTS, sp, use_tqdm=False))
    outs, st = async_outputs(stories, json.dumps(spec(4)), PROMPTS, sp)
    assert token_ids(outs) == ref
    assert st["spec_accepted"] > 0 and st["blocks_used"] == 0


def test_disable_by_batch_size(stories, plain):
    """Above disable_by_batch_size running sequences a step proposes nothing; the
    output is the same either way."""
    prompts = PROMPTS * 3
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = token_ids(plain.generate(prompts, sp, use_tqdm=False))
    with LLM(stories, max_num_seqs=16, speculative_config=spec(4, disable_by_batch_size=4)) as llm:
        assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
        st = llm.stats()
        assert st["spec_steps_disabled"] > 0
    with LLM(stories, max_num_seqs=16, speculative_config=spec(4, disable_by_batch_size=100)) as llm:
        llm.generate(prompts, sp, use_tqdm=False)
        assert llm.stats()["spec_steps_disabled"] == 0 and llm.stats()["spec_proposed"] > 0


@pytest.mark.parametrize("cfg,field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 65}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"model": "some/draft", "num_speculative_tokens": 2}, "model"),
])
def test_bad_configs_name_the_field(stories, cfg, field):
    with pytest.raises(ValueError, match=field) as ei:
        LLM(stories, speculative_config=cfg)
    assert getattr(ei.value, "field", None) == field


@pytest.mark.parametrize("cfg,exc", [("not json", ValueError), ([1, 2], TypeError),
                                     ({"num_speculative_tokens": "3"}, TypeError),
                                     ({"num_speculative_tokens": True}, TypeError)])
def test_bad_config_types(stories, cfg, exc):
    with pytest.raises(exc, match="speculative_config"):
        LLM(stories, speculative_config=cfg)


def test_server_flag_and_metrics():
    from conveyor.server.app import engine_kwargs, make_parser
    from conveyor.server.metrics import ServerMetrics

    args = make_parser().parse_args(["model", "--speculative-config", '{"num_speculative_tokens": 3}'])
    assert engine_kwargs(args)["speculative_config"] == '{"num_speculative_tokens": 3}'
    text = ServerMetrics("m").render({"spec_proposed": 10, "spec_accepted": 4, "spec_acceptance_rate": 0.4,
                                      "spec_proposed_at": [6, 4], "spec_accepted_at": [3, 1]}, 0)
    assert "conveyor_spec_decode_num_draft_tokens_total{" in text and "} 10" in text
    assert 'conveyor_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1' in text


def test_context_end_prompt_logprobs_and_best_of(stories):
    """Up to max_model_len (proposals never pass a sequence's last position), prompt
    logprobs computed in the same steps as verification rows, best_of candidates."""
    sp_end = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    sp_plp = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=2)
    sp_best = SamplingParams(temperature=0.9, seed=5, max_tokens=30, n=2, best_of=3)
    prompts = [STORY, PROMPTS[1], PROMPTS[2]]
    params = [sp_end, sp_plp, sp_best]

    def run(**kw):
        with LLM(stories, max_model_len=96, max_num_seqs=8, **kw) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            st = llm.stats()
            check_all_free(llm)
        return outs, st

    ref, _ = run()
    got, st = run(speculative_config=spec(6, 1, 3))
    assert token_ids(got) == token_ids(ref)
    assert len(got[0].prompt_token_ids) + len(got[0].outputs[0].token_ids) == 96
    assert got[0].outputs[0].finish_reason == "length"
    plp_a, plp_b = got[1].prompt_logprobs, ref[1].prompt_logprobs
    assert len(plp_a) == len(plp_b) == len(got[1].prompt_token_ids)
    for a, b in zip(plp_a[1:], plp_b[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    assert st["spec_accepted"] > 0


def test_guided_requests_beside_speculating_ones(stories, plain):
    """A structured-output request does not speculate (its masks come one position at
    a time) and keeps its schema; the speculating requests beside it keep their
    tokens, and so does the guided one (same seed)."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from conveyor.guided import GuidedDecodingParams

    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["pet", "age"], "additionalProperties": False}
    guided = SamplingParams(temperature=1.0, seed=3, max_tokens=60, guided_decoding=GuidedDecodingParams(json=schema))
    greedy = SamplingParams(temperature=0, max_tokens=60)
    prompts = [STORY, "Hello", PROMPTS[1]]
    params = [greedy, guided, greedy]
    ref = plain.generate(prompts, params, use_tqdm=False)
    with LLM(stories, speculative_config=spec(4, 1, 3)) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["spec_accepted"] > 0
        check_all_free(llm)
    assert token_ids(got) == token_ids(ref)
    jsonschema.validate(json.loads(got[1].outputs[0].text), schema)
