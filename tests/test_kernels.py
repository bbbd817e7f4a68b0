"""CPU kernels (kernels/cpu) through the conveyor._testing.kernel_* hooks.

Every kernel runs in every implementation this CPU has: "simd" (the level
chosen at run time), "plain" (plain C) and each other SIMD level the CPU
supports (avx2, avx512, avx512_bf16); each is held to a NumPy float64
computation on the same (dtype-rounded) inputs, and the SIMD ones to the plain
one. Sizes include odd ones that do not fill a SIMD register. Levels this CPU
lacks are listed by test_levels_this_cpu_lacks, skipped naming the feature.
"""
import math

import numpy as np
import pytest

core = pytest.importorskip("conveyor._testing")
from conveyor import _core  # noqa: E402

from conveyor.testing import random_block_tables  # noqa: E402

INFO = _core.kernel_info()
LEVEL_FEATURES = {"avx2": "AVX2/FMA/F16C", "avx512": "AVX-512 F/BW/VL/DQ",
                  "avx512_bf16": "AVX512_BF16"}
IMPLS = ["simd", "plain"] + [lv for lv in LEVEL_FEATURES if lv in INFO["levels"] and lv != INFO["simd"]]


def bf16_pairs(impl, wdt):
    """True when impl runs bf16 weights on vdpbf16ps, which rounds the
    activations to bfloat16 too (once per row)."""
    level = INFO["simd"] if impl == "simd" else impl
    return wdt == "bfloat16" and level == "avx512_bf16"


@pytest.mark.parametrize("level", list(LEVEL_FEATURES))
def test_levels_this_cpu_lacks(level):
    if level in INFO["levels"]:
        assert level in IMPLS or INFO["simd"] == level
    else:
        pytest.skip(f"CPU lacks {LEVEL_FEATURES[level]}: the {level} kernels are compiled in but not run")
RNG_SEED = 1234


def rng(*salt):
    return np.random.default_rng([RNG_SEED, *salt])


# --------------------------------------------------------------------------- dtype helpers

def bf16_bits(a):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to(a, dtype):
    if dtype == "float32":
        return np.asarray(a, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)
    return bf16_to_f32(bf16_bits(a))


def to_cache_array(a, dtype):
    """The NumPy array holding a cache of dtype (bf16 as uint16 bits)."""
    if dtype == "float32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(a, dtype=np.float16)
    return bf16_bits(a)


def from_cache_array(c, dtype):
    if dtype == "bfloat16":
        return bf16_to_f32(c).astype(np.float64)
    return c.astype(np.float64)


def assert_close_dot(got, ref, scale, rel=2e-6, abs_=1e-6):
    """|got - ref| <= rel * scale + abs_ elementwise, where scale bounds the
    magnitude of the summed products (sum |x||w|)."""
    err = np.abs(got.astype(np.float64) - ref)
    bound = rel * scale + abs_
    bad = err > bound
    assert not bad.any(), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


# --------------------------------------------------------------------------- GEMM

GEMM_SHAPES = [  # (tokens, rows, cols)
    (1, 1, 1), (1, 5, 3), (2, 16, 8), (3, 17, 9), (6, 32, 16), (7, 33, 65), (13, 100, 77),
    (1, 200, 300), (8, 48, 600), (37, 40, 301), (200, 20, 13), (5, 576, 576),
]


@pytest.mark.parametrize("wdt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n,rows,cols", GEMM_SHAPES)
def test_gemm_matches_float64_and_plain(wdt, n, rows, cols):
    r = rng(n, rows, cols)
    x = r.standard_normal((n, cols), dtype=np.float32)
    w = r.standard_normal((rows, cols), dtype=np.float32)
    bias = r.standard_normal(rows, dtype=np.float32)
    wr = round_to(w, wdt).astype(np.float64)
    ref = x.astype(np.float64) @ wr.T + bias
    scale = np.abs(x).astype(np.float64) @ np.abs(wr).T + np.abs(bias)
    # vdpbf16ps rounds x to bf16: the exact products of the rounded values
    xb = round_to(x, "bfloat16").astype(np.float64)
    ref_pairs = xb @ wr.T + bias
    got = {}
    for impl in IMPLS:
        got[impl] = core.kernel_gemm(x, w, wdt, bias=bias, impl=impl)
        assert got[impl].shape == (n, rows) and got[impl].dtype == np.float32
        assert_close_dot(got[impl], ref_pairs if bf16_pairs(impl, wdt) else ref, scale)
    for impl in IMPLS:
        # against plain C: rounding x to bf16 (8 significant bits) moves each
        # product by at most 2^-8 |x w|, so the sum by at most 2^-8 sum |x||w|
        # (plus the fp32 sums)
        rel = 2.0 ** -8 + 2e-6 if bf16_pairs(impl, wdt) else 2e-6
        assert_close_dot(got[impl], got["plain"].astype(np.float64), scale, rel=rel)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_gemm_accumulate_and_threads(impl, threads):
    # rows=20 is two panels: with more threads than panels the tokens are split too
    # (sizes large enough for the GEMM to use several threads)
    r = rng(threads)
    for n, rows, cols in [(300, 20, 600), (9, 130, 400), (1, 700, 800)]:
        x = r.standard_normal((n, cols), dtype=np.float32)
        w = r.standard_normal((rows, cols), dtype=np.float32)
        acc = r.standard_normal((n, rows), dtype=np.float32)
        got = core.kernel_gemm(x, w, accumulate=acc, impl=impl, threads=threads)
        ref = acc.astype(np.float64) + x.astype(np.float64) @ w.astype(np.float64).T
        scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + np.abs(acc)
        assert_close_dot(got, ref, scale)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wdt", ["float32", "float16"])
def test_gemm_large_packed_blocks(impl, wdt):
    # one thread with 49 panels packs x; 2100 cols give several cols blocks and
    # token blocks of 30, so 37 tokens take two token blocks
    r = rng(37, len(wdt))
    n, rows, cols = 37, 770, 2100
    x = r.standard_normal((n, cols), dtype=np.float32)
    w = r.standard_normal((rows, cols), dtype=np.float32)
    bias = r.standard_normal(rows, dtype=np.float32)
    acc = r.standard_normal((n, rows), dtype=np.float32)
    wr = round_to(w, wdt).astype(np.float64)
    got = core.kernel_gemm(x, w, wdt, bias=bias, accumulate=acc, impl=impl, threads=1)
    ref = x.astype(np.float64) @ wr.T + bias + acc
    scale = np.abs(x).astype(np.float64) @ np.abs(wr).T + np.abs(bias) + np.abs(acc)
    assert_close_dot(got, ref, scale)


@pytest.mark.parametrize("impl", IMPLS)
def test_gemm_and_embedding_from_16_bit_sources(impl):
    # checkpoints hold bf16 / fp16: preparing from them keeps the values exactly
    r = rng(11)
    w = r.standard_normal((35, 19), dtype=np.float32)
    x = r.standard_normal((8, 19), dtype=np.float32)
    wb = bf16_bits(w)
    wh = w.astype(np.float16)
    for src, wdt, wref in [(wb, "bfloat16", bf16_to_f32(wb)), (wb, "float32", bf16_to_f32(wb)),
                           (wh, "float16", wh.astype(np.float32)),
                           (wh, "bfloat16", round_to(wh.astype(np.float32), "bfloat16")),
                           (w.astype(np.float64), "float16", round_to(w, "float16"))]:
        wref = wref.astype(np.float64)
        got = core.kernel_gemm(x, src, wdt, impl=impl)
        xr = round_to(x, "bfloat16") if bf16_pairs(impl, wdt) else x
        assert_close_dot(got, xr.astype(np.float64) @ wref.T, np.abs(x) @ np.abs(wref).T)
        tokens = np.array([3, 0, 34], np.int32)
        np.testing.assert_array_equal(core.kernel_embedding(src, tokens, wdt, impl=impl),
                                      wref[tokens].astype(np.float32))
    with pytest.raises(TypeError):
        core.kernel_gemm(x, w.astype(np.int32))


def test_thread_pool_many_regions_with_pauses():
    # back-to-back regions (workers spinning) and regions after pauses (workers
    # asleep) on an over-subscribed pool all give the exact same result
    import time

    r = rng(3)
    x = r.standard_normal((13, 256), dtype=np.float32)
    w = r.standard_normal((400, 256), dtype=np.float32)
    m = core.kernel_matrix(w, "float32", "simd", 5)
    first = core.kernel_matmul(m, x)
    for i in range(300):
        if i % 50 == 0:
            time.sleep(0.002)
        np.testing.assert_array_equal(core.kernel_matmul(m, x), first)


def test_gemm_prepared_matrix_reuse_and_timing():
    r = rng(7)
    w = r.standard_normal((70, 45), dtype=np.float32)
    m = core.kernel_matrix(w, "bfloat16")
    wr = round_to(w, "bfloat16").astype(np.float64)
    for n in (1, 4, 19):
        x = r.standard_normal((n, 45), dtype=np.float32)
        got = core.kernel_matmul(m, x)
        scale = np.abs(x).astype(np.float64) @ np.abs(wr).T
        xr = round_to(x, "bfloat16") if bf16_pairs("simd", "bfloat16") else x
        assert_close_dot(got, xr.astype(np.float64) @ wr.T, scale)
    t = core.kernel_matmul_time(m, x, 3)
    assert 0 < t < 10


def test_gemm_rejects_bad_input():
    x = np.zeros((3, 4), np.float32)
    w = np.zeros((5, 4), np.float32)
    with pytest.raises(TypeError):
        core.kernel_gemm(x.astype(np.float64), w)
    with pytest.raises(TypeError):
        core.kernel_gemm([[1.0]], w)
    with pytest.raises(ValueError):
        core.kernel_gemm(np.zeros((3, 5), np.float32), w)
    with pytest.raises(ValueError):
        core.kernel_gemm(np.zeros((4, 3), np.float32).T, w)  # not C-contiguous
    with pytest.raises(ValueError):
        core.kernel_gemm(x, w, "int8")
    with pytest.raises(ValueError):
        core.kernel_gemm(x, w, impl="fast")
    with pytest.raises(ValueError):
        core.kernel_gemm(x, w, bias=np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        core.kernel_matmul(object(), x)


# --------------------------------------------------------------------------- norms

NORM_DIMS = [1, 7, 8, 9, 33, 576]


@pytest.mark.parametrize("dim", NORM_DIMS)
def test_rmsnorm(dim):
    r = rng(dim)
    x = r.standard_normal((5, dim), dtype=np.float32) * 3
    w = r.standard_normal(dim, dtype=np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    outs = [core.kernel_rmsnorm(x, w, 1e-6, impl=i) for i in IMPLS]
    for o in outs:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- RoPE

def rope_ref(x, pos, inv_freq, layout):
    x = x.astype(np.float64)
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)  # [n][hd/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if layout == "halves":
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out[..., :h] = a * c - b * s
        out[..., h:] = b * c + a * s
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
    return out


@pytest.mark.parametrize("layout", ["halves", "pairs"])
@pytest.mark.parametrize("hd,nh,nkv", [(2, 1, 1), (6, 3, 1), (8, 2, 2), (18, 5, 1), (64, 9, 3),
                                       (128, 4, 2), (384, 2, 1)])
def test_rope_in_strided_rows(layout, hd, nh, nkv):
    r = rng(hd, nh)
    n = 11
    # q and k are views into one fused [n][q | k | v] buffer, as the model has them
    width = (nh + 2 * nkv) * hd
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))).astype(np.float32)
    pos = r.integers(0, 4000, n).astype(np.int32)
    base = r.standard_normal((n, width), dtype=np.float32)
    results = {}
    for impl in IMPLS:
        buf = base.copy()
        q = buf[:, : nh * hd].reshape(n, nh, hd)
        k = buf[:, nh * hd:(nh + nkv) * hd].reshape(n, nkv, hd)
        assert not q.flags.c_contiguous
        core.kernel_rope(q, k, pos, inv_freq, layout, impl=impl)
        q0 = base[:, : nh * hd].reshape(n, nh, hd)
        k0 = base[:, nh * hd:(nh + nkv) * hd].reshape(n, nkv, hd)
        np.testing.assert_allclose(q, rope_ref(q0, pos, inv_freq, layout), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(k, rope_ref(k0, pos, inv_freq, layout), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(buf[:, (nh + nkv) * hd:], base[:, (nh + nkv) * hd:])  # v untouched
        results[impl] = buf
    np.testing.assert_allclose(results["simd"], results["plain"], rtol=1e-6, atol=1e-6)


def test_rope_angles_kept_between_calls_follow_the_inputs():
    """The CPU backend keeps a call's cos/sin for the next calls with the same positions and
    frequencies (a step's layers). Kept angles must give the bits of computed ones, and any
    change of the inputs, even in place in the same arrays, must be seen: positions, frequencies
    (Gemma's local and global sets alternating), the number of tokens."""
    r = rng(7, 7)
    hd, nh = 16, 2
    freqs = [(1.0 / (b ** (np.arange(0, hd, 2) / hd))).astype(np.float32) for b in (10000.0, 1e6)]
    pos = r.integers(0, 3000, 9).astype(np.int32)
    base = r.standard_normal((9, nh, hd), dtype=np.float32)

    def rope(impl, p, f):
        q = base[: len(p)].copy()
        core.kernel_rope(q, None, p, f, "halves", impl=impl)
        return q

    for impl in IMPLS:
        first = [rope(impl, pos, f) for f in freqs]  # each computed once
        for _ in range(2):  # alternating sets, each now from its kept angles
            for f, want in zip(freqs, first):
                np.testing.assert_array_equal(rope(impl, pos, f), want)
        pos[3] += 1  # the same array, one position changed
        np.testing.assert_allclose(rope(impl, pos, freqs[0]), rope_ref(base, pos, freqs[0], "halves"),
                                   rtol=1e-5, atol=1e-5)
        freqs[1][2] *= 0.5  # a frequency changed in place
        np.testing.assert_allclose(rope(impl, pos, freqs[1]), rope_ref(base, pos, freqs[1], "halves"),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rope(impl, pos[:5], freqs[1]), rope_ref(base[:5], pos[:5], freqs[1], "halves"),
                                   rtol=1e-5, atol=1e-5)


def test_rope_rejects_bad_input():
    q = np.zeros((2, 1, 8), np.float32)
    f = np.ones(4, np.float32)
    with pytest.raises(TypeError):
        core.kernel_rope(q, None, np.zeros(2, np.int64), f)
    with pytest.raises(ValueError):
        core.kernel_rope(q, None, np.zeros(3, np.int32), f)
    with pytest.raises(ValueError):
        core.kernel_rope(np.zeros((2, 1, 7), np.float32), None, np.zeros(2, np.int32), f)
    with pytest.raises(ValueError):
        core.kernel_rope(q, None, np.zeros(2, np.int32), f, "spiral")
    ro = q.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        core.kernel_rope(ro, None, np.zeros(2, np.int32), f)


# --------------------------------------------------------------------------- SwiGLU, embedding

@pytest.mark.parametrize("dim", [1, 7, 8, 9, 100, 1536])
def test_swiglu(dim):
    r = rng(dim)
    gu = r.standard_normal((6, 2 * dim), dtype=np.float32) * 4
    gu[0, :dim] = np.linspace(-100, 100, dim)  # saturating gates
    g, u = gu[:, :dim].astype(np.float64), gu[:, dim:].astype(np.float64)
    ref = g / (1 + np.exp(-g)) * u
    outs = [core.kernel_swiglu(gu, impl=i) for i in IMPLS]
    for o in outs:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tdt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 576])
def test_embedding(tdt, cols):
    r = rng(cols)
    table = r.standard_normal((50, cols), dtype=np.float32)
    tokens = r.integers(0, 50, 23).astype(np.int32)
    ref = round_to(table, tdt)[tokens]
    for impl in IMPLS:
        np.testing.assert_array_equal(core.kernel_embedding(table, tokens, tdt, impl=impl), ref)
    with pytest.raises(ValueError):
        core.kernel_embedding(table, np.array([0, 50], np.int32))
    with pytest.raises(ValueError):
        core.kernel_embedding(table, np.array([-1], np.int32))


# --------------------------------------------------------------------------- KV cache

CACHE_DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("cdt", CACHE_DTYPES)
@pytest.mark.parametrize("hd", [4, 9, 64])
def test_kv_write(cdt, hd):
    r = rng(hd, len(cdt))
    nb, nkv, bs, n = 6, 3, 5, 13
    slots = r.permutation(nb * bs)[:n].astype(np.int64)
    slots[3] = -1  # padding token: skipped
    qkv = r.standard_normal((n, (4 + 2 * nkv) * hd), dtype=np.float32)
    k = qkv[:, 4 * hd:(4 + nkv) * hd].reshape(n, nkv, hd)
    v = qkv[:, (4 + nkv) * hd:].reshape(n, nkv, hd)
    caches = {}
    for impl in IMPLS:
        kc = to_cache_array(np.full((nb, nkv, bs, hd), 7.0, np.float32), cdt)
        vc = kc.copy()
        core.kernel_kv_write(kc, vc, k, v, slots, cdt if cdt == "bfloat16" else None, impl=impl)
        kf, vf = from_cache_array(kc, cdt), from_cache_array(vc, cdt)
        for t in range(n):
            if slots[t] < 0:
                continue
            b, o = divmod(int(slots[t]), bs)
            np.testing.assert_array_equal(kf[b, :, o, :], round_to(k[t], cdt))
            np.testing.assert_array_equal(vf[b, :, o, :], round_to(v[t], cdt))
        written = np.zeros(nb * bs, bool)
        written[slots[slots >= 0]] = True
        untouched = ~written.reshape(nb, bs)
        assert (kf.transpose(0, 2, 1, 3)[untouched] == 7.0).all()
        caches[impl] = (kc, vc)
    np.testing.assert_array_equal(caches["simd"][0], caches["plain"][0])
    with pytest.raises(ValueError):
        core.kernel_kv_write(kc, vc, k, v, np.full(n, nb * bs, np.int64),
                             cdt if cdt == "bfloat16" else None)


# --------------------------------------------------------------------------- paged attention

def make_attention_case(r, *, n_seqs, nkv, G, hd, bs, cdt, max_prefix=40, max_new=12,
                        prefixes=None, news=None):
    """Random paged cache with shuffled block tables and its dense float64 copy."""
    nh = nkv * G
    if prefixes is None:
        prefixes = r.integers(0, max_prefix + 1, n_seqs)
    if news is None:
        news = r.integers(1, max_new + 1, n_seqs)
    ctx = np.asarray(prefixes) + np.asarray(news)
    tables, nb = random_block_tables(r, ctx, bs)
    kc = to_cache_array(r.standard_normal((nb, nkv, bs, hd), dtype=np.float32), cdt)
    vc = to_cache_array(r.standard_normal((nb, nkv, bs, hd), dtype=np.float32), cdt)
    qs = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    q = r.standard_normal((int(qs[-1]), nh, hd), dtype=np.float32)
    return dict(q=q, kc=kc, vc=vc, tables=tables, ctx=ctx.astype(np.int32), qs=qs, news=news,
                nkv=nkv, G=G, hd=hd, bs=bs, cdt=cdt)


def bf16_dot_attention(impl, cdt):
    """True when impl runs attention over a bf16 cache on vdpbf16ps: the
    scaled queries and the probabilities are rounded to bfloat16."""
    level = INFO["simd"] if impl == "simd" else impl
    if impl == "simd":
        assert INFO["paths"]["attention_bf16"] == level  # what kernel_info reports is what runs
    return cdt == "bfloat16" and level == "avx512_bf16"


def attention_ref(c, scale, window=0, with_bf16_bound=False):
    """float64 attention (window > 0: a sliding window of that many positions); with with_bf16_bound, also the bound of the
    vdpbf16ps path per output element (kernels/cpu/x86/avx512_attention.h):
    rounding q to bf16 (unit roundoff u = 2^-9) moves score i by at most
    E = u sum_d |q_d k_id| (products and sums in fp32), so each weight by a
    factor within exp(+-2E); rounding p to bf16 moves each term by u more:
    |out - ref| <= (exp(2E) - 1 + u exp(2E)) sum_i w_i |v_i|."""
    kf, vf = from_cache_array(c["kc"], c["cdt"]), from_cache_array(c["vc"], c["cdt"])
    q, bs, G = c["q"].astype(np.float64), c["bs"], c["G"]
    out = np.zeros((q.shape[0], q.shape[1] * q.shape[2]))
    bound = np.zeros_like(out)
    u = 2.0 ** -9
    for s in range(len(c["ctx"])):
        L, nq, q0 = int(c["ctx"][s]), int(c["news"][s]), int(c["qs"][s])
        idx = np.arange(L)
        blocks = c["tables"][s, idx // bs]
        K = kf[blocks, :, idx % bs, :]  # [L][nkv][hd]
        V = vf[blocks, :, idx % bs, :]
        for j in range(nq):
            p = L - nq + j
            lo = max(0, p - window + 1) if window else 0  # a sliding window: the last `window` positions
            for h in range(q.shape[1]):
                sc = K[lo: p + 1, h // G, :] @ q[q0 + j, h] * scale
                w = np.exp(sc - sc.max())
                w /= w.sum()
                cols = slice(h * c["hd"], (h + 1) * c["hd"])
                out[q0 + j, cols] = w @ V[lo: p + 1, h // G, :]
                if with_bf16_bound:
                    E = 1.01 * u * (np.abs(K[lo: p + 1, h // G, :]) @ np.abs(q[q0 + j, h] * scale)).max()
                    bound[q0 + j, cols] = (np.expm1(2 * E) + u * np.exp(2 * E)) * (w @ np.abs(V[lo: p + 1, h // G, :]))
    return (out, bound) if with_bf16_bound else out


def assert_attention_close(got, ref, bound, impl, cdt, rtol=1e-4, atol=2e-5, msg=""):
    """got within the fp32 tolerance of ref, plus the bf16 bound when impl
    runs the vdpbf16ps path."""
    tol = rtol * np.abs(ref) + atol
    if bf16_dot_attention(impl, cdt):
        tol = tol + bound
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"{impl} {cdt} {msg}: worst excess {np.max(err - tol):.3g} at {np.argmax(err - tol)}"


def run_attention(c, impl, threads=0, scale=None, window=0):
    return core.kernel_paged_attention(
        c["q"], c["kc"], c["vc"], c["tables"], c["ctx"], c["qs"], scale=scale,
        cache_dtype=c["cdt"] if c["cdt"] == "bfloat16" else None, impl=impl, threads=threads, window=window)


ATT_CASES = [  # (n_seqs, nkv, G, hd, bs)
    (1, 1, 1, 8, 1),
    (3, 3, 3, 64, 16),
    (2, 2, 4, 20, 3),
    (4, 1, 2, 33, 32),
    (2, 2, 1, 128, 7),
    (1, 1, 32, 16, 4),   # many query heads per KV head: heads split across tiles
    (2, 1, 3, 256, 16),
    (1, 2, 2, 512, 8),   # head_dim past 256: smaller tiles
]


@pytest.mark.parametrize("cdt", CACHE_DTYPES)
@pytest.mark.parametrize("n_seqs,nkv,G,hd,bs", ATT_CASES)
def test_paged_attention_matches_dense(cdt, n_seqs, nkv, G, hd, bs):
    r = rng(n_seqs, nkv, G, hd, bs, len(cdt))
    c = make_attention_case(r, n_seqs=n_seqs, nkv=nkv, G=G, hd=hd, bs=bs, cdt=cdt)
    ref, bound = attention_ref(c, 1 / math.sqrt(hd), with_bf16_bound=True)
    outs = {impl: run_attention(c, impl) for impl in IMPLS}
    for impl, o in outs.items():
        assert o.shape == ref.shape
        assert_attention_close(o, ref, bound, impl, cdt)
        # against plain C: the bound plus the fp32 error of both
        assert_attention_close(o, outs["plain"], bound, impl, cdt, rtol=2e-4, atol=4e-5, msg="vs plain")


@pytest.mark.parametrize("window", [1, 3, 8, 33])
@pytest.mark.parametrize("n_seqs,nkv,G,hd,bs", ATT_CASES[:6])
def test_paged_attention_sliding_window(window, n_seqs, nkv, G, hd, bs):
    """Gemma 3's local layers: window w, each query sees positions p - w + 1 .. p. Windows
    shorter and longer than a block, a key chunk and the prompts (prefill rows whose windows
    start at different keys), at both levels; a long context split across threads too."""
    r = rng(window, n_seqs, nkv, G, hd, bs)
    c = make_attention_case(r, n_seqs=n_seqs, nkv=nkv, G=G, hd=hd, bs=bs, cdt="float32", max_prefix=70, max_new=20)
    ref = attention_ref(c, 1 / math.sqrt(hd), window)
    for impl in IMPLS:
        np.testing.assert_allclose(run_attention(c, impl, window=window), ref, rtol=1e-4, atol=2e-5, err_msg=impl)
    if window < c["ctx"].max():  # the window matters in this case
        assert np.abs(attention_ref(c, 1 / math.sqrt(hd)) - ref).max() > 1e-3
    long = make_attention_case(r, n_seqs=1, nkv=1, G=2, hd=48, bs=16, cdt="float32", prefixes=[2000], news=[2])
    for threads in (1, 3, 8):
        np.testing.assert_allclose(run_attention(long, "simd", threads, window=window * 17),
                                   attention_ref(long, 1 / math.sqrt(48), window * 17), rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="window"):
        run_attention(c, "simd", window=-1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_paged_attention_long_context_split(impl, threads):
    # one sequence and one KV head: fewer work items than threads, so a long
    # context is split across threads and the partial softmaxes merged
    r = rng(threads, len(impl))
    for cdt, news in [("float32", [1]), ("bfloat16", [3]), ("float16", [1, 2])]:
        c = make_attention_case(r, n_seqs=len(news), nkv=1, G=2, hd=48, bs=16, cdt=cdt,
                                prefixes=[3000] * len(news), news=news)
        ref, bound = attention_ref(c, 0.3, with_bf16_bound=True)
        assert_attention_close(run_attention(c, impl, threads, scale=0.3), ref, bound, impl, cdt)


# context lengths around the kernels' boundaries: 16-key score blocks, 32-key
# chunks, 256-key segments (the fixed merge order)
BOUNDARY_CONTEXTS = [1, 2, 15, 16, 17, 31, 32, 33, 63, 255, 256, 257, 288, 511, 512, 513]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hd", [8, 20, 33, 64, 128, 256])
@pytest.mark.parametrize("cdt,G", [("float32", 3), ("bfloat16", 3), ("bfloat16", 4)])
def test_paged_attention_at_chunk_and_segment_boundaries(impl, hd, cdt, G):
    # every context above as a decode token, and ending a 5-token prefill
    # chunk (vector groups of 4, or of 2 and 1 for G = 3, whose keys end at
    # different places), all in one step and with two threads
    r = rng(hd, G, len(cdt), len(impl))
    ctx = np.array(BOUNDARY_CONTEXTS * 2)
    news = np.array([1] * len(BOUNDARY_CONTEXTS) + [min(5, n) for n in BOUNDARY_CONTEXTS])
    c = make_attention_case(r, n_seqs=len(ctx), nkv=2, G=G, hd=hd, bs=16, cdt=cdt,
                            prefixes=ctx - news, news=news)
    ref, bound = attention_ref(c, 1 / math.sqrt(hd), with_bf16_bound=True)
    assert_attention_close(run_attention(c, impl, threads=2), ref, bound, impl, cdt, msg=f"hd {hd}")


def test_paged_attention_chunked_prefill_equals_whole():
    # a prompt computed in two chunks (second chunk attends to the cached first)
    # gives the same rows as computing it at once
    r = rng(99)
    c = make_attention_case(r, n_seqs=1, nkv=3, G=3, hd=64, bs=16, cdt="float32",
                            prefixes=[0], news=[45])
    whole = run_attention(c, "simd")
    c2 = dict(c)
    c2["q"] = c["q"][30:]
    c2["qs"] = np.array([0, 15], np.int32)
    np.testing.assert_allclose(run_attention(c2, "simd"), whole[30:], rtol=1e-5, atol=1e-6)


def test_paged_attention_rejects_bad_input():
    r = rng(5)
    c = make_attention_case(r, n_seqs=2, nkv=1, G=2, hd=8, bs=4, cdt="float32")
    bad = dict(c)
    bad["tables"] = c["tables"].copy()
    bad["tables"][0, 0] = c["kc"].shape[0]
    with pytest.raises(ValueError):
        run_attention(bad, "simd")
    bad = dict(c)
    bad["ctx"] = (c["news"] - 1).astype(np.int32)
    with pytest.raises(ValueError):
        run_attention(bad, "simd")
    bad = dict(c)
    bad["qs"] = c["qs"].astype(np.int64)
    with pytest.raises(TypeError):
        run_attention(bad, "simd")
    bad = dict(c)
    bad["q"] = np.zeros((c["q"].shape[0], 3, 8), np.float32)  # 3 heads over 1 KV head is fine...
    run_attention(bad, "plain")
    bad["q"] = np.zeros((c["q"].shape[0], 2, 6), np.float32)  # ...a different head_dim is not
    with pytest.raises(ValueError):
        run_attention(bad, "simd")
    with pytest.raises(TypeError):
        core.kernel_paged_attention(c["q"], c["kc"].astype(np.float64), c["vc"], c["tables"],
                                    c["ctx"], c["qs"])


# --------------------------------------------------------------------------- runtime switch

def test_force_scalar_env_selects_plain_kernels():
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, conveyor._core as core, conveyor._testing as c\n"
        "r = np.random.default_rng(0)\n"
        "x = r.standard_normal((9, 37), dtype=np.float32)\n"
        "w = r.standard_normal((21, 37), dtype=np.float32)\n"
        "g = r.standard_normal((3, 2 * 37), dtype=np.float32)\n"
        "assert core.kernel_info()['force_scalar']\n"
        "assert np.array_equal(c.kernel_gemm(x, w, 'bfloat16', impl='simd'),\n"
        "                      c.kernel_gemm(x, w, 'bfloat16', impl='plain'))\n"
        "assert np.array_equal(c.kernel_swiglu(g, impl='simd'), c.kernel_swiglu(g, impl='plain'))\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_SIMD"}  # (which would win)
    env["CONVEYOR_FORCE_SCALAR"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("env", [
    {"CONVEYOR_GEMM_ORDER": "1", "CONVEYOR_GEMM_XBLOCK": "1024"},   # panels outermost
    {"CONVEYOR_GEMM_ORDER": "0", "CONVEYOR_GEMM_XBLOCK": "1024", "CONVEYOR_GEMM_KC": "16"},
    {"CONVEYOR_GEMM_PACK": "0"},
])
def test_gemm_blocking_variants_agree(env):
    # the GEMM's loop orders and blockings, forced through the environment on
    # shapes where they make many blocks, all give the float64 result
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, conveyor._core as core, conveyor._testing as c\n"
        "r = np.random.default_rng(5)\n"
        "for n, rows, cols in [(61, 800, 70), (13, 33, 100), (40, 20, 300)]:\n"
        "    x = r.standard_normal((n, cols), dtype=np.float32)\n"
        "    w = r.standard_normal((rows, cols), dtype=np.float32)\n"
        "    b = r.standard_normal(rows, dtype=np.float32)\n"
        "    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b\n"
        "    scale = np.abs(x).astype(np.float64) @ np.abs(w).T + np.abs(b)\n"
        "    for impl in ('simd', 'plain'):\n"
        "        for th in (1, 2):\n"
        "            got = c.kernel_gemm(x, w, bias=b, impl=impl, threads=th)\n"
        "            assert (np.abs(got - ref) <= 2e-6 * scale + 1e-6).all(), (n, rows, cols, impl)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# --------------------------------------------------------------------------- bandwidth

def test_triad_and_read_bandwidth():
    assert core.kernel_triad(1 << 20, 2, 0) > 0.1
    assert core.kernel_read_bw(1 << 20, 2, 2) > 0.1
    with pytest.raises(ValueError):
        core.kernel_triad(0)
    with pytest.raises(ValueError):
        core.kernel_read_bw(1 << 20, 0)


def test_bench_module_runs_small():
    from conveyor.bench import kernels as bk

    res = bk.run_gemm_and_bandwidth(threads=1, tokens=(1, 7), shapes={"tiny": (33, 20)},
                                   triad_bytes=1 << 20)
    assert res["triad_gbs"] > 0
    assert [r["tokens"] for r in res["rows"]] == [1, 7]
    assert all(r["f32_gflops"] > 0 and r["bf16_gflops"] > 0 for r in res["rows"])
    assert "tiny" in bk.format_table(res)
