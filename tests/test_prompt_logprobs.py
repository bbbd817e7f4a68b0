"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against the NumPy
reference's log-softmax over the prompt: whole prefill, chunked prefill, and a
shared prefix with prefix caching on (such requests compute every row)."""
import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.reference import ReferenceModel

PROMPTS = ["Once upon a time, there was a little girl named Lily. She liked to play",
           "Once upon a time, there was a little girl named Lily. She saw a big dog",
           "The sun was hot"]


def log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def check_against_reference(out, ref, k, atol=2e-4):
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    lp = log_softmax(ref.logits(ids))  # row t predicts ids[t + 1]
    for t in range(1, len(ids)):
        entry = out.prompt_logprobs[t]
        want = lp[t - 1]
        assert ids[t] in entry
        assert entry[ids[t]].logprob == pytest.approx(want[ids[t]], abs=atol)
        # the prompt token has its rank under the reference, among the top k or not
        rank = entry[ids[t]].rank
        above_surely = np.count_nonzero(want > want[ids[t]] + 1e-4)
        above_maybe = np.count_nonzero(want > want[ids[t]] - 1e-4) - 1  # less the token itself
        assert above_surely + 1 <= rank <= above_maybe + 1
        ranked = sorted((v.rank, tid) for tid, v in entry.items() if v.rank <= k)
        assert [r for r, _ in ranked] == list(range(1, k + 1))  # exactly the top k, ranked
        got_top = np.array([tid for _, tid in ranked], dtype=np.int64)
        for tid in got_top:
            assert entry[tid].logprob == pytest.approx(want[tid], abs=atol)
        if k:
            # the reference's k best, up to near-ties at the k-th value
            kth = np.sort(want)[::-1][k - 1]
            assert want[got_top].min() >= kth - 1e-4
            assert set(np.flatnonzero(want > kth + 1e-4)) <= set(got_top.tolist())
        # ids not in the entry are not rated above the prompt token's rank cut
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("engine_kwargs", [
    {},                                                           # the whole prompt in one step
    {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},  # chunks of at most 8 rows
    {"max_num_seqs": 2, "max_num_batched_tokens": 16},            # LM-head groups of 2 rows
])
def test_stories_prompt_logprobs_match_reference(stories_dir, engine_kwargs):
    path = str(stories_dir / "stories260K.bin")
    ref = ReferenceModel.load(path)
    with LLM(path, num_threads=1, **engine_kwargs) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
                            use_tqdm=False)
        for o in outs:
            check_against_reference(o, ref, 3)
            assert len(o.outputs[0].token_ids) == 4
        # requests without prompt_logprobs sample the same tokens and carry none
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert [p.outputs[0].token_ids for p in plain] == [o.outputs[0].token_ids for o in outs]
        assert all(p.prompt_logprobs is None for p in plain)


def test_prefix_caching_shared_prefix(stories_dir):
    path = str(stories_dir / "stories260K.bin")
    ref = ReferenceModel.load(path)
    with LLM(path, num_threads=1, enable_prefix_caching=True, block_size=4) as llm:
        # warm the cache with the shared prefix, then ask for prompt logprobs
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                           use_tqdm=False)[0]
        check_against_reference(out, ref, 0)
        assert out.metrics.num_cached_tokens == 0  # no cached block was reused
        # without prompt logprobs the same prompt does hit the cache
        again = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert again.metrics.num_cached_tokens > 0


def test_hf_model_prompt_logprobs(tiny_hf_dir):
    ref = ReferenceModel.load(str(tiny_hf_dir))
    with LLM(str(tiny_hf_dir), num_threads=1, max_num_batched_tokens=8) as llm:
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(3, ref.vocab_size, size=n))) for n in (5, 13, 21)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5),
                            use_tqdm=False)
        for o in outs:
            check_against_reference(o, ref, 5)


def test_n_and_best_of_with_prompt_logprobs(stories_dir):
    path = str(stories_dir / "stories260K.bin")
    with LLM(path, num_threads=1) as llm:
        out = llm.generate([PROMPTS[2]], SamplingParams(n=2, best_of=3, seed=3, max_tokens=3,
                                                        prompt_logprobs=1), use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert len(out.outputs) == 2


@pytest.mark.parametrize("bad", [-1, 21, 10**12])
def test_prompt_logprobs_range(bad):
    with pytest.raises(ValueError) as ei:
        SamplingParams(prompt_logprobs=bad)
    assert ei.value.field == "prompt_logprobs"


def test_async_streams_prompt_logprobs_and_best_of(stories_dir):
    import asyncio

    from conveyor import AsyncLLM

    path = str(stories_dir / "stories260K.bin")

    async def run():
        engine = AsyncLLM(path, num_threads=1, max_num_batched_tokens=8)
        try:
            got = []
            sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, output_kind="delta")
            async for out in engine.generate(PROMPTS[0], sp):
                got += out.prompt_logprobs
            outs = []
            async for out in engine.generate(PROMPTS[2], SamplingParams(n=1, best_of=3, seed=2, max_tokens=4)):
                outs.append(out)
            return got, outs, engine.tokenizer.encode(PROMPTS[0])
        finally:
            engine.close()

    got, outs, ids = asyncio.run(run())
    assert len(got) == len(ids) and got[0] is None  # every position once, across the deltas
    assert [next(iter(e)) if e else None for e in got][1:] == ids[1:]
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs) == 1
