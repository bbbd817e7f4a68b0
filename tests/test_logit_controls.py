"""Logit controls applied in the C sampler (logit_bias, allowed_token_ids,
bad_words), best_of, and their validation: in Python (ValueError/TypeError
naming the field) and on the server (400 with `param`), through the official
openai client."""
from pathlib import Path

import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found")
PROMPT = "Once upon a time, there was a little girl named Lily. She"


@pytest.fixture(scope="module")
def llm():
    with LLM(str(MODEL), num_threads=1) as m:
        yield m


def gen(llm, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_logit_bias_bans_and_forces(llm):
    base = gen(llm, temperature=0, max_tokens=24, ignore_eos=True).outputs[0].token_ids
    banned = {t: -100 for t in set(base)}
    out = gen(llm, temperature=0, max_tokens=24, ignore_eos=True, logit_bias=banned).outputs[0].token_ids
    assert not set(out) & set(banned)
    # sampled at temperature 1: a -100 bias leaves a token with weight e^-100
    for seed in range(4):
        o = gen(llm, temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, logit_bias=banned)
        assert not set(o.outputs[0].token_ids) & set(banned)
    forced = 300  # an unlikely token, pushed up by +100
    assert forced not in base
    o = gen(llm, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logit_bias={forced: 100})
    assert o.outputs[0].token_ids == [forced] * 8


def test_logprobs_stay_raw_under_bias(llm):
    a = gen(llm, temperature=0, max_tokens=1, logprobs=2)
    t = a.outputs[0].token_ids[0]
    b = gen(llm, temperature=0, max_tokens=1, logprobs=2, logit_bias={t: 5.0})
    assert b.outputs[0].token_ids == [t]
    assert b.outputs[0].logprobs[0][t].logprob == pytest.approx(a.outputs[0].logprobs[0][t].logprob, abs=1e-6)


def test_allowed_token_ids_restrict_output(llm):
    allowed = [300, 301, 302, 400]
    for seed in range(3):
        o = gen(llm, temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
        assert set(o.outputs[0].token_ids) <= set(allowed)
        assert len(o.outputs[0].token_ids) == 16
    g = gen(llm, temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[77])
    assert g.outputs[0].token_ids == [77] * 6


def test_bad_words_never_appear(llm):
    base = gen(llm, temperature=0, max_tokens=40, ignore_eos=True).outputs[0]
    words = [w for w in base.text.split() if w.isalpha()][:3]
    assert words
    o = gen(llm, temperature=0, max_tokens=40, ignore_eos=True, bad_words=words).outputs[0]
    tok = llm.get_tokenizer()
    # vLLM's rule: no banned token sequence appears in the output
    seqs = []
    for w in words:
        for text in (w, " " + w):
            seqs.append(tok.encode(text, add_special_tokens=False))
    ids = o.token_ids
    for s in seqs:
        assert not any(ids[i:i + len(s)] == s for i in range(len(ids) - len(s) + 1)), (s, ids)
    assert o.text != base.text
    # sampled, several seeds
    for seed in range(3):
        ids = gen(llm, temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True,
                  bad_words=words).outputs[0].token_ids
        for s in seqs:
            assert not any(ids[i:i + len(s)] == s for i in range(len(ids) - len(s) + 1))


def test_best_of_returns_the_best_by_cumulative_logprob(llm):
    kw = dict(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    every = gen(llm, n=6, logprobs=0, **kw).outputs  # best_of's candidates are these n=6 runs
    cums = sorted((o.cumulative_logprob for o in every), reverse=True)
    best = gen(llm, n=2, best_of=6, **kw).outputs
    assert len(best) == 2 and [o.index for o in best] == [0, 1]
    assert [o.cumulative_logprob for o in best] == pytest.approx(cums[:2], abs=1e-5)
    # each returned cumulative logprob is the sum over its tokens (independent check)
    with_lp = gen(llm, n=2, best_of=6, logprobs=0, **kw).outputs
    for o in with_lp:
        assert o.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)), abs=1e-4)


@pytest.mark.parametrize("kw,field", [
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 5000}, "best_of"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises((ValueError, TypeError)) as ei:
        SamplingParams(**kw)
    assert ei.value.field == field


@pytest.mark.parametrize("kw,field", [
    ({"logit_bias": {10**6: 1}}, "logit_bias"),
    ({"allowed_token_ids": [512]}, "allowed_token_ids"),
])
def test_ids_outside_the_vocabulary(llm, kw, field):
    with pytest.raises(ValueError) as ei:
        llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)
    assert ei.value.field == field and "vocabulary" in str(ei.value)
