"""Batch invariance, bit for bit, at every SIMD level this CPU has.

The rule (kernels/cpu/gemm_ukr.h, kernels/cpu/attention.c): a row's GEMM result and a query
vector's attention result depend only on that row's own inputs, never on the tile it falls in,
its place in the batch, the other sequences of the step or the thread that computes it. So a
request gives the same bits alone, with others, in another order, after preemption (its
generated tokens recomputed as a prompt chunk) and with its prompt cut into other chunks.

Every check is exact (np.array_equal, logprobs compared as floats), so any reduction-order
change that depends on the batch fails it: the kernel tests compare a row computed alone with
the same row at every tile height (1..6 rows) and batch size, and the engine tests compare the
logprob of every generated token, which moves with the last bit of the logits.

Levels: "plain" (scalar C) and every level in kernel_info()["levels"]; on a CPU without
AVX-512 those levels are skipped here and run under tools/avx512_emulated.sh.
"""
from __future__ import annotations

import numpy as np
import pytest

from conveyor import LLM, SamplingParams, _core, _testing
from conveyor.testing import write_hf_checkpoint

INFO = _core.kernel_info()
ALL_LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
WDTYPES = ["float32", "bfloat16", "float16"]


def level_or_skip(level: str) -> str:
    if level not in INFO["levels"]:
        pytest.skip(f"this CPU lacks the {level} level (run it under tools/avx512_emulated.sh)")
    return level


def impl_of(level: str) -> str:
    return "plain" if level == "scalar" else level


# ---------------------------------------------------------------------------- GEMM


@pytest.mark.parametrize("wdt", WDTYPES)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_gemm_row_alone_equals_row_in_any_batch(level, wdt):
    impl = impl_of(level_or_skip(level))
    rng = np.random.default_rng([7, len(wdt), ALL_LEVELS.index(level)])
    # rows: a partial panel (37), a partial panel group (100), whole groups (128); odd cols
    # (the bf16 pair layout pads k); 333 cols cross the GEMM's k chunks of about 288.
    for rows, cols in [(37, 75), (100, 333), (128, 64)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32)
        m = _testing.kernel_matrix(w, wdt, impl)
        x = rng.standard_normal((40, cols)).astype(np.float32)
        alone = np.stack([_testing.kernel_matmul(m, x[i:i + 1], bias=bias)[0] for i in range(len(x))])
        for n in list(range(2, 15)) + [23, 40]:  # every tile height 1..6, several blocks
            np.testing.assert_array_equal(_testing.kernel_matmul(m, x[:n], bias=bias), alone[:n],
                                          err_msg=f"{level} {wdt} {rows}x{cols} n={n}")
        perm = rng.permutation(len(x))[:17]
        np.testing.assert_array_equal(_testing.kernel_matmul(m, x[perm], bias=bias), alone[perm])
        # accumulate into existing outputs: the same start value gives the same bits
        acc0 = rng.standard_normal((40, rows)).astype(np.float32)
        one = np.stack([_testing.kernel_matmul(m, x[i:i + 1], accumulate=acc0[i:i + 1].copy())[0]
                        for i in range(len(x))])
        np.testing.assert_array_equal(_testing.kernel_matmul(m, x, accumulate=acc0.copy()), one)


@pytest.mark.parametrize("wdt", WDTYPES)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_gemm_rows_do_not_depend_on_threads(level, wdt):
    impl = impl_of(level_or_skip(level))
    rng = np.random.default_rng(11)
    w = rng.standard_normal((200, 576)).astype(np.float32)
    x = rng.standard_normal((70, 576)).astype(np.float32)
    ref = _testing.kernel_gemm(x, w, wdt, impl=impl, threads=1)
    for th in (2, 3):
        np.testing.assert_array_equal(_testing.kernel_gemm(x, w, wdt, impl=impl, threads=th), ref)


# ---------------------------------------------------------------------------- attention


def paged_case(rng, prefixes, news, *, nkv=2, G=4, hd=64, bs=16, cdt="float32"):
    """Random K/V in a paged cache with shuffled blocks: sequence s has prefixes[s] cached
    keys and news[s] new query tokens; a bfloat16 cache holds the top 16 bits of each value; an
    int8 cache is (values, scales) pairs, the scales [num_blocks][n_kv_heads][block_size]."""
    ctx = np.asarray(prefixes) + np.asarray(news)
    blocks = (ctx + bs - 1) // bs
    nb = int(blocks.sum()) + 2
    perm = rng.permutation(nb)
    tables = np.zeros((len(ctx), int(blocks.max())), np.int32)
    used = 0
    for s, nbk in enumerate(blocks):
        tables[s, :nbk] = perm[used:used + nbk]
        used += nbk
    kc = rng.standard_normal((nb, nkv, bs, hd)).astype(np.float32)
    vc = rng.standard_normal((nb, nkv, bs, hd)).astype(np.float32)
    if cdt == "bfloat16":
        kc, vc = ((a.view(np.uint32) >> 16).astype(np.uint16) for a in (kc, vc))
    if cdt == "int8":
        kc, vc = ((rng.integers(-127, 128, a.shape).astype(np.int8),
                   rng.uniform(0.001, 0.05, a.shape[:3]).astype(np.float32)) for a in (kc, vc))
    qs = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]), nkv * G, hd)).astype(np.float32)
    return q, kc, vc, tables, ctx.astype(np.int32), qs


def attention(impl, q, kc, vc, tables, ctx, qs, threads=0):
    if isinstance(kc, tuple):  # int8: (values, scales)
        return _testing.kernel_paged_attention(q, kc[0], vc[0], tables, ctx, qs, impl=impl, threads=threads,
                                            k_scale=kc[1], v_scale=vc[1])
    cdt = "bfloat16" if kc.dtype == np.uint16 else None
    return _testing.kernel_paged_attention(q, kc, vc, tables, ctx, qs, impl=impl, threads=threads,
                                        cache_dtype=cdt)


# cache dtype, query heads per KV head, head_dim: a bf16 cache runs the vdpbf16ps kernels at
# the avx512_bf16 level; G = 3 splits a tile's vectors into groups of 2 and 1, G = 4 into 4s;
# an int8 cache (kv_cache_dtype="int8") runs the fp32 kernels with per-row scales, or the VNNI
# integer dots at the avx512_bf16 level
ATT_SHAPES = [("float32", 4, 64), ("bfloat16", 4, 64), ("bfloat16", 3, 33), ("int8", 4, 64), ("int8", 3, 33)]


@pytest.mark.parametrize("cdt,G,hd", ATT_SHAPES)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_of_a_sequence_does_not_depend_on_the_others(level, cdt, G, hd):
    """Each sequence alone (where a long context is split over the threads by key segments)
    equals the same sequence among others (where it is not), in any order and thread count."""
    impl = impl_of(level_or_skip(level))
    rng = np.random.default_rng(3)
    prefixes, news = [700, 3, 260, 40, 1500, 0], [1, 1, 5, 1, 1, 9]
    q, kc, vc, tables, ctx, qs = paged_case(rng, prefixes, news, G=G, hd=hd, cdt=cdt)
    together = attention(impl, q, kc, vc, tables, ctx, qs)
    for s in range(len(ctx)):
        rows = slice(qs[s], qs[s + 1])
        for th in (1, 2):
            alone = attention(impl, q[rows], kc, vc, tables[s:s + 1], ctx[s:s + 1],
                              np.array([0, news[s]], np.int32), threads=th)
            np.testing.assert_array_equal(alone, together[rows], err_msg=f"{level} seq {s} threads {th}")
    order = rng.permutation(len(ctx))
    qs2 = np.concatenate([[0], np.cumsum(np.asarray(news)[order])]).astype(np.int32)
    q2 = np.concatenate([q[qs[s]:qs[s + 1]] for s in order])
    rev = attention(impl, q2, kc, vc, tables[order], ctx[order], qs2)
    for i, s in enumerate(order):
        np.testing.assert_array_equal(rev[qs2[i]:qs2[i + 1]], together[qs[s]:qs[s + 1]])


@pytest.mark.parametrize("cdt,G,hd", ATT_SHAPES)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_of_a_token_does_not_depend_on_its_chunk(level, cdt, G, hd):
    """A token's output is the same whether it is decoded alone or computed inside a prompt
    chunk of any size (other tokens in its tile, tiles crossing key segments)."""
    impl = impl_of(level_or_skip(level))
    rng = np.random.default_rng(4)
    total = 530  # crosses two segment boundaries (256, 512)
    q, kc, vc, tables, ctx, qs = paged_case(rng, [0], [total], G=G, hd=hd, cdt=cdt)
    whole = attention(impl, q, kc, vc, tables, ctx, qs)
    for start, n in [(0, 1), (250, 13), (255, 2), (500, 30), (529, 1), (100, 300)]:
        got = attention(impl, q[start:start + n], kc, vc, tables, np.array([start + n], np.int32),
                        np.array([0, n], np.int32))
        np.testing.assert_array_equal(got, whole[start:start + n], err_msg=f"{level} chunk {start}+{n}")


@pytest.mark.parametrize("window", [1, 40, 300])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_sliding_window_attention_of_a_token_does_not_depend_on_its_chunk(level, window):
    """The same with a sliding window (Gemma 3's local layers): the chunks a vector walks stay on
    the fixed grid whatever the first token of its tile."""
    impl = impl_of(level_or_skip(level))
    rng = np.random.default_rng(5)
    total = 530
    q, kc, vc, tables, ctx, qs = paged_case(rng, [0], [total], G=3, hd=64, cdt="bfloat16")

    def run(qq, c, s):
        return _testing.kernel_paged_attention(qq, kc, vc, tables, c, s, impl=impl, window=window,
                                            cache_dtype="bfloat16")

    whole = run(q, ctx, qs)
    for start, n in [(0, 1), (250, 13), (255, 2), (500, 30), (529, 1), (100, 300), (47, 5)]:
        got = run(q[start:start + n], np.array([start + n], np.int32), np.array([0, n], np.int32))
        np.testing.assert_array_equal(got, whole[start:start + n], err_msg=f"{level} window {window} {start}+{n}")


# ---------------------------------------------------------------------------- the engine


PROMPT_LENS = [3, 40, 7, 300, 1, 18, 90, 5, 270, 12, 2, 60]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("invariance")
    shape = dict(dim=128, hidden_dim=256, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=512,
                 max_pos=1024, tie_embeddings=False, rope_theta=10000.0, rms_eps=1e-5)
    return {dt: write_hf_checkpoint(d / dt, shape=shape, dtype=dt, seed=3)
            for dt in ("float32", "bfloat16")}


def prompts():
    rng = np.random.default_rng(9)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in PROMPT_LENS]


def run(llm, ps, max_tokens=12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                     o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.parametrize("wdt", ["float32", "bfloat16"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_engine_alone_together_reversed_preempted(models, monkeypatch, level, wdt):
    """12 greedy requests of 1..300 prompt tokens (GQA 8/2, 3 layers): alone, together,
    together in reverse order, and together in a cache so small that sequences are preempted
    and recomputed give the same tokens and the same logprob bits."""
    level_or_skip(level)
    monkeypatch.setenv("CONVEYOR_SIMD", level)
    ps = prompts()
    with LLM(str(models[wdt]), num_threads=2, max_num_batched_tokens=128) as llm:
        assert _core.kernel_info()["simd"] == level  # the level this engine's backend runs
        alone = [run(llm, [p])[0] for p in ps]
        together = run(llm, ps)
        reverse = run(llm, ps[::-1])[::-1]
    assert together == alone, f"{level} {wdt}: together differs from alone"
    assert reverse == alone, f"{level} {wdt}: reversed order differs from alone"
    # 3 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 768 bytes a float32 token: 20 blocks
    # of 16 (40 with a 16-bit cache) hold the longest request (312 tokens) but not the 952
    # tokens all 12 need at once; with no admission margin (admission_reserve=0) they all
    # start and the cache runs out as they decode.
    with LLM(str(models[wdt]), num_threads=2, kv_cache_memory=768 * 16 * 20, block_size=16,
             max_num_batched_tokens=96, admission_reserve=0) as small:
        preempted = run(small, ps)
        assert small.stats()["num_preemptions"] > 0
        assert small.stats()["blocks_used"] == 0
    assert preempted == alone, f"{level} {wdt}: preemption changed the outputs"


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_int8_kv_engine_alone_together_reversed_preempted(models, monkeypatch, level):
    """The same with kv_cache_dtype="int8": each token's K and V rows are quantized on their
    own, so a request's cache (and its tokens and logprob bits) do not depend on the batch."""
    level_or_skip(level)
    monkeypatch.setenv("CONVEYOR_SIMD", level)
    ps = prompts()
    with LLM(str(models["bfloat16"]), num_threads=2, max_num_batched_tokens=128, kv_cache_dtype="int8") as llm:
        assert _core.kernel_info()["simd"] == level
        assert llm.model_config["kv_cache_dtype"] == "int8"
        alone = [run(llm, [p])[0] for p in ps]
        together = run(llm, ps)
        reverse = run(llm, ps[::-1])[::-1]
    assert together == alone, f"{level} int8 KV: together differs from alone"
    assert reverse == alone, f"{level} int8 KV: reversed order differs from alone"
    # an int8 token: 3 layers x 2 KV heads x (16 + 4) bytes x 2 = 240 bytes; 20 blocks of 16
    with LLM(str(models["bfloat16"]), num_threads=2, kv_cache_memory=240 * 16 * 20, block_size=16,
             max_num_batched_tokens=96, kv_cache_dtype="int8", admission_reserve=0) as small:
        preempted = run(small, ps)
        assert small.stats()["num_preemptions"] > 0
    assert preempted == alone, f"{level} int8 KV: preemption changed the outputs"


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_quantized_engine_alone_together_reversed(models, monkeypatch, level, quant):
    """The same with weights quantized at load: the quantized kernels of the level (at
    avx512 and above the AVX512-VNNI panel kernels where the CPU has them, whose tiles of 1..4
    tokens x 1..4 panels run one fixed sequence of operations per output) give a request the
    same tokens and logprob bits alone and in any batch."""
    level_or_skip(level)
    monkeypatch.setenv("CONVEYOR_SIMD", level)
    ps = prompts()
    with LLM(str(models["bfloat16"]), num_threads=2, max_num_batched_tokens=128, quantization=quant) as llm:
        assert _core.kernel_info()["simd"] == level
        alone = [run(llm, [p])[0] for p in ps]
        together = run(llm, ps)
        reverse = run(llm, ps[::-1])[::-1]
    assert together == alone, f"{level} {quant}: together differs from alone"
    assert reverse == alone, f"{level} {quant}: reversed order differs from alone"
