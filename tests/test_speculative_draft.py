"""Speculative decoding with a draft model.

What a user checks: greedy and seeded outputs are the same token for token with
and without a draft, whatever shares the batch, under preemption and prefix
caching, on stories260K, a random-weight HF model and the real SmolLM2 file;
the draft's proposals were verified (all accepted for a draft equal to the
target, some for a truncated copy); every KV block of both caches returns to its
pool; a draft with another vocabulary or a missing file is refused naming the
field; the sampled distribution is the target's for a draft deliberately
different from it (a chi-square test with its power stated, as in
test_speculative.py).
"""
import json

import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.testing import truncate_checkpoint, write_llama2c_checkpoint
from test_speculative import PROMPTS, STORY, async_outputs, categories, token_ids, two_sample_chi2


def draft(model, k, **kw):
    return {"model": str(model), "num_speculative_tokens": k, "disable_by_batch_size": 0, **kw}


@pytest.fixture(scope="module")
def stories(stories_dir):
    return str(stories_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def plain(stories):
    with LLM(stories, max_num_seqs=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def drafts(stories, tmp_path_factory):
    """same: the target's own file; short: its first 4 of 5 layers (accepts some,
    rejects more); noise: random weights over the same 512-token vocabulary."""
    d = tmp_path_factory.mktemp("drafts")
    noise = write_llama2c_checkpoint(d / "noise.bin", seed=7, tokenizer=False,
                                     shape={"dim": 32, "hidden_dim": 64, "n_layers": 1, "n_heads": 2,
                                            "vocab_size": 512, "max_pos": 512})
    return {"same": stories, "short": str(truncate_checkpoint(stories, d / "short.bin", 4)), "noise": str(noise)}


def check_all_free(llm):
    llm._core._engine.check_invariants()  # the target's scheduler and pool, and the draft's pool
    st = llm.stats()
    assert st["blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
    assert st["spec_draft_blocks_used"] == 0


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("which", ["same", "short", "noise"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identical_stories(stories, plain, drafts, which, k):
    sp = SamplingParams(temperature=0, max_tokens=80)
    ref = token_ids(plain.generate(PROMPTS, sp, use_tqdm=False))
    with LLM(stories, max_num_seqs=16, speculative_config=draft(drafts[which], k)) as llm:
        assert token_ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == ref
        st = llm.stats()
        assert st["spec_proposed"] > 0 and st["spec_draft_tokens"] > 0
        assert sum(st["spec_accepted_at"]) == st["spec_accepted"]
        if which == "same":  # a draft equal to the target proposes exactly the target's greedy tokens
            assert st["spec_accepted"] == st["spec_proposed"]
        elif which == "short":
            assert 0 < st["spec_accepted"] < st["spec_proposed"]
        check_all_free(llm)


def test_a_draft_equal_to_the_target_takes_k_plus_one_tokens_a_step(stories, plain, drafts):
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    s0 = plain.stats()["steps"]
    ref = token_ids(plain.generate([STORY], sp, use_tqdm=False))
    plain_steps = plain.stats()["steps"] - s0
    with LLM(stories, speculative_config=draft(drafts["same"], 5)) as llm:
        assert token_ids(llm.generate([STORY], sp, use_tqdm=False)) == ref
        # one prefill step, then 6 tokens a step
        assert llm.stats()["steps"] <= 1 + -(-96 // 6) < plain_steps / 4


def test_mixed_batch_with_non_speculating_sequences(stories, plain, drafts):
    """More sequences than the draft serves (disable_by_batch_size 3 of 16 seats:
    the first 3 decoding get proposals), a long prompt prefilled in chunks while
    others verify, n > 1, a guided request (never speculates), varied max_tokens."""
    rng = np.random.default_rng(3)
    distinct = [list(map(int, rng.permutation(np.arange(3, 500))[:n])) for n in (12, 40)]
    long_prompt = list(map(int, rng.integers(3, 500, size=300)))
    prompts = PROMPTS + distinct + [long_prompt, "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (80, 17, 64, 33, 50, 71, 40, 8)]
    params[1] = SamplingParams(temperature=0, max_tokens=30, n=2)
    params[7] = SamplingParams(temperature=0, max_tokens=8, guided_decoding={"choice": ["yes", "no"]})
    ref = token_ids(plain.generate(prompts, params, use_tqdm=False))
    for disable in (0, 3):
        with LLM(stories, max_num_seqs=16, max_num_batched_tokens=64,
                 speculative_config=draft(drafts["short"], 4, disable_by_batch_size=disable)) as llm:
            assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == ref
            st = llm.stats()
            assert st["spec_accepted"] > 0
            assert (st["spec_steps_disabled"] > 0) == (disable == 3)
            check_all_free(llm)


def test_greedy_identical_random_hf_model(tiny_hf_dir, tmp_path):
    """A random-weight HF checkpoint as its own draft (the mechanics on another
    loader and shape), and a draft of another vocabulary refused."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, size=n))) for n in (5, 23, 60)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(tiny_hf_dir, max_num_seqs=8) as llm:
        ref = token_ids(llm.generate(prompts, sp, use_tqdm=False))
    with LLM(tiny_hf_dir, max_num_seqs=8, speculative_config=draft(tiny_hf_dir, 3)) as llm:
        assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
        st = llm.stats()
        assert st["spec_accepted"] == st["spec_proposed"] > 0
        check_all_free(llm)


def test_greedy_identical_smollm2(smollm2_gguf, tmp_path):
    """The real default model with a 24-of-30-layer copy of itself as the draft."""
    short = truncate_checkpoint(smollm2_gguf, tmp_path / "smol24.gguf", 24)
    with LLM(smollm2_gguf, max_num_seqs=4, kv_cache_memory="64MiB") as llm:
        prompts = [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": q}],
                                                            add_generation_prompt=True)
                   for q in ("What is the capital of France?", "Write a haiku about rain.",
                             "Repeat after me: the quick brown fox jumps over the lazy dog.")]
        sp = SamplingParams(temperature=0, max_tokens=40)
        ref = token_ids(llm.generate(prompts, sp, use_tqdm=False))
    with LLM(smollm2_gguf, max_num_seqs=4, kv_cache_memory="64MiB",
             speculative_config=draft(short, 3)) as llm:
        assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
        st = llm.stats()
        assert 0 < st["spec_accepted"] < st["spec_proposed"]
        check_all_free(llm)


# ---------------------------------------------------------------- KV: preemption, prefix cache, rejections


def test_preemption_with_a_tiny_kv_cache(stories, plain, drafts):
    prompts = PROMPTS * 2
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ref = token_ids(plain.generate(prompts, sp, use_tqdm=False))
    for prefix in (True, False):
        # no admission margin: every request starts when its prompt fits, so the pool runs out
        with LLM(stories, max_num_seqs=8, block_size=4, kv_cache_memory=40 * 4 * 1280, admission_reserve=0,
                 enable_prefix_caching=prefix, speculative_config=draft(drafts["short"], 5)) as llm:
            assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
            st = llm.stats()
            assert st["num_preemptions"] > 0 and st["spec_accepted"] > 0
            check_all_free(llm)


def test_prefix_cache_holds_only_verified_tokens(stories, drafts):
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(stories, block_size=4, speculative_config=draft(drafts["short"], 6)) as llm:
        first = llm.generate([STORY], sp, use_tqdm=False)[0]
        follow = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)[:50]
        got = token_ids(llm.generate([follow], sp, use_tqdm=False))
        assert llm.stats()["spec_proposed"] > llm.stats()["spec_accepted"] > 0
        check_all_free(llm)
    with LLM(stories, block_size=4, enable_prefix_caching=False) as llm:
        assert got == token_ids(llm.generate([follow], sp, use_tqdm=False))


def test_every_step_keeps_the_invariants_under_many_rejections(stories, drafts):
    """Stepping by hand with the noise draft (nearly every proposal rejected): both
    pools' checkers after every step, every block free at the end, and the draft's
    blocks given back when the engine goes idle."""
    with LLM(stories, max_num_seqs=8, block_size=4, speculative_config=draft(drafts["noise"], 8)) as llm:
        core = llm._core
        reqs = [core.add_request(None, p, core.tokenize_prompt(p)[1],
                                 SamplingParams(temperature=t, seed=i, max_tokens=70, ignore_eos=True))
                for i, (p, t) in enumerate(zip(PROMPTS * 2, [0, 0.8] * 4))]
        busy = 0
        while core.has_unfinished():
            core.step()
            core._engine.check_invariants()
            busy = max(busy, llm.stats()["spec_draft_blocks_used"])
        assert all(r.finished for r in reqs) and busy > 0
        st = llm.stats()
        assert st["spec_proposed"] - st["spec_accepted"] > 500
        check_all_free(llm)


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_the_same_draw_for_draw(stories, plain, drafts):
    sp = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=60, n=2) for s in range(6)]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in range(6)]
    ref = token_ids(plain.generate(prompts, sp, use_tqdm=False))
    with LLM(stories, max_num_seqs=16, speculative_config=draft(drafts["short"], 4)) as llm:
        assert token_ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
        assert llm.stats()["spec_accepted"] > 0


def test_stops_max_tokens_and_logprobs_keep_their_meaning(stories, plain, drafts):
    cases = [SamplingParams(temperature=0, max_tokens=7),
             SamplingParams(temperature=0, max_tokens=90, stop=["park"], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=90, stop_token_ids=[13]),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
             SamplingParams(temperature=0, max_tokens=30, logprobs=3)]
    with LLM(stories, speculative_config=draft(drafts["short"], 5)) as llm:
        for sp in cases:
            ref = plain.generate(PROMPTS, sp, use_tqdm=False)
            got = llm.generate(PROMPTS, sp, use_tqdm=False)
            for a, b in zip(got, ref):
                ca, cb = a.outputs[0], b.outputs[0]
                assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
                       (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason), sp
                if sp.logprobs:
                    assert [la.keys() for la in ca.logprobs] == [lb.keys() for lb in cb.logprobs]
                    for la, lb in zip(ca.logprobs, cb.logprobs):
                        for t in la:
                            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
        assert llm.stats()["spec_accepted"] > 0
        check_all_free(llm)


def test_sampled_distribution_matches_without_speculation(stories, plain, drafts):
    """The first three tokens after STORY over N seeds with the truncated draft
    against N other seeds without: a chi-square homogeneity test on their joint
    outcome, at alpha = 0.001 with N = 2000 per arm. The draft differs from the
    target (it lacks the last layer), so its greedy proposal is kept at some
    positions and redrawn at others; both paths must be taken many times.
    Power, as in test_speculative.py: a shift of 0.1 in total variation is
    detected in >= 90% of runs (checked there by simulation for this test)."""
    n, alpha = 2000, 1e-3
    sp = lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True)
    ref = plain.generate([STORY] * n, [sp(s) for s in range(n, 2 * n)], use_tqdm=False)
    with LLM(stories, max_num_seqs=256, speculative_config=draft(drafts["short"], 3)) as llm:
        got = llm.generate([STORY] * n, [sp(s) for s in range(n)], use_tqdm=False)
        st = llm.stats()
        check_all_free(llm)
    rejected = st["spec_proposed_at"][0] - st["spec_accepted_at"][0]
    assert st["spec_accepted_at"][0] > 200 and rejected > 200, st
    first3 = lambda outs: [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    a, b = categories(first3(got), first3(ref))
    p, df = two_sample_chi2(a, b)
    assert df >= 1 and p > alpha, (p, df, a, b)


# ---------------------------------------------------------------- frontends and bad configurations


def test_async_llm_matches(stories, plain, drafts):
    sp = SamplingParams(temperature=0, max_tokens=64)
    ref = token_ids(plain.generate(PROMPTS, sp, use_tqdm=False))
    outs, st = async_outputs(stories, json.dumps(draft(drafts["short"], 4)), PROMPTS, sp)
    assert token_ids(outs) == ref
    assert st["spec_accepted"] > 0 and st["blocks_used"] == 0


def test_cli_generate_with_a_draft(stories, drafts):
    import subprocess
    import sys

    from conveyor.testing import subprocess_env

    cfg = json.dumps(draft(drafts["same"], 4))
    r = subprocess.run([sys.executable, "-m", "conveyor", "generate", "--model", stories, "--prompt",
                        "Once upon a time", "--max-tokens", "24", "--temperature", "0", "--speculative-config", cfg],
                       capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "speculative:" in r.stdout + r.stderr and "(100.0%)" in r.stdout + r.stderr


@pytest.mark.parametrize("make,field", [
    (lambda d: {"model": d["short"], "num_speculative_tokens": 0}, "num_speculative_tokens"),
    (lambda d: {"model": d["short"], "num_speculative_tokens": 17}, "num_speculative_tokens"),
    (lambda d: {"model": d["short"]}, "num_speculative_tokens"),
    (lambda d: {"model": d["short"], "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    (lambda d: {"model": d["short"], "num_speculative_tokens": 2, "method": "ngram"}, "model"),
    (lambda d: {"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    (lambda d: {"model": "/no/such/draft.gguf", "num_speculative_tokens": 2}, "model"),
    (lambda d: {"model": d["other_vocab"], "num_speculative_tokens": 2}, "model"),
    (lambda d: {"model": d["not_a_model"], "num_speculative_tokens": 2}, "model"),
])
def test_bad_configs_name_the_field(stories, drafts, tmp_path, make, field):
    d = dict(drafts)
    d["other_vocab"] = str(write_llama2c_checkpoint(tmp_path / "v600.bin", tokenizer=False,
                                                    shape={"dim": 32, "hidden_dim": 64, "n_layers": 1, "n_heads": 2,
                                                           "vocab_size": 600, "max_pos": 512}))
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 100)
    d["not_a_model"] = str(tmp_path / "junk.bin")
    with pytest.raises(ValueError, match=field) as ei:
        LLM(stories, speculative_config=make(d))
    assert getattr(ei.value, "field", None) == field


def test_server_with_a_draft_answers_the_openai_client_and_reports_metrics(stories, plain, drafts):
    """`conveyor serve --speculative-config '{"model": ...}'` as a process: the OpenAI
    client's greedy completion equals LLM.generate's, and /metrics counts the
    proposals the draft made."""
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from conveyor.bench.serve import OwnServer

    want = plain.generate([STORY], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    s = OwnServer(stories, ("--speculative-config", json.dumps(draft(drafts["same"], 4))), timeout=60.0)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(trust_env=False, timeout=60.0))
        r = client.completions.create(model="stories260K", prompt=STORY, max_tokens=32, temperature=0)
        assert r.choices[0].text == want
        metrics = httpx.get(s.url + "/metrics", trust_env=False, timeout=30.0).text
        drafted = [line for line in metrics.splitlines()
                   if line.startswith("conveyor_spec_decode_num_draft_tokens_total{")]
        assert drafted and float(drafted[0].rsplit(" ", 1)[1]) > 0
    finally:
        s.stop()
