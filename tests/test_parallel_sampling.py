"""A step's rows are sampled in parallel on the CPU backend's threads when the
vocabulary makes it worth it (csrc/core/engine_sample.c): every request must
get exactly the tokens and logprobs it gets alone, where its one row is
sampled on the stepping thread."""
import pytest

from conveyor import LLM, SamplingParams
from conveyor.testing import write_hf_checkpoint

VOCAB = 32768  # x 8 rows is past the engine's threshold for parallel sampling


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    shape = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_pos=256,
                 tie_embeddings=False, rope_theta=10000.0, rms_eps=1e-5)
    path = write_hf_checkpoint(tmp_path_factory.mktemp("bigvocab") / "m", shape=shape, seed=3)
    with LLM(str(path), num_threads=2, max_num_seqs=32) as m:
        yield m


def params(i: int) -> SamplingParams:
    """Every sampler path: dense weights, top-p, top-k, min-p, penalties, banned EOS, logprobs, n."""
    return SamplingParams(temperature=[1.0, 0.7, 1.3][i % 3], top_p=[1.0, 0.9][i % 2],
                          top_k=[0, 40, 0, 2000][i % 4], min_p=0.05 if i % 5 == 0 else 0.0,
                          repetition_penalty=1.2 if i % 3 == 1 else 1.0,
                          presence_penalty=0.5 if i % 4 == 2 else 0.0,
                          min_tokens=6 if i % 2 else 0, logprobs=3, seed=100 + i, max_tokens=10,
                          n=3 if i == 7 else 1)


def prompts(n: int):
    return [{"prompt_token_ids": [(37 * i + 11 * j) % (VOCAB - 3) + 3 for j in range(5 + i % 7)]}
            for i in range(n)]


def record(out):
    """Tokens, top-logprob ids and the logprobs themselves, per completion."""
    return [(c.token_ids, [sorted(lp) for lp in c.logprobs],
             [[lp[t].logprob for t in sorted(lp)] for lp in c.logprobs]) for c in out.outputs]


def same(a, b):
    """Equal tokens and top ids; logprobs within 1e-5: a request's logits alone and in
    a batch differ in the last bit (the single-row and batched GEMM paths sum in
    different orders), measured 1e-6 in the logprobs, with parallel sampling and
    without it (one thread)."""
    assert len(a) == len(b)
    for (ta, ia, la), (tb, ib, lb) in zip(a, b):
        assert (ta, ia) == (tb, ib)
        for x, y in zip(la, lb):
            assert x == pytest.approx(y, abs=1e-5)


def test_parallel_rows_equal_each_request_alone(llm):
    ps = prompts(16)
    sps = [params(i) for i in range(16)]
    together = llm.generate(ps, sps, use_tqdm=False)
    for p, sp, out in zip(ps, sps, together):
        alone = llm.generate([p], sp, use_tqdm=False)[0]
        same(record(out), record(alone))
    # the draws are random, not one token repeated: the rows did not share a stream
    firsts = {o.outputs[0].token_ids[0] for o in together}
    assert len(firsts) > 8


def test_parallel_rows_repeat_with_the_same_seeds(llm):
    ps = prompts(12)
    sps = [params(i) for i in range(12)]
    a = [record(o) for o in llm.generate(ps, sps, use_tqdm=False)]
    b = [record(o) for o in llm.generate(ps[::-1], sps[::-1], use_tqdm=False)][::-1]
    assert a == b
