"""The CPU backend's fused kernels (rope_kv_write, rmsnorm_gemm, swiglu_gemm)
against the unfused sequences they replace, through the conveyor._core
kernel_* hooks.

They promise the same float operations in the same order, so each fused
result must equal the unfused one bit for bit: at every SIMD level this CPU
runs, with float32/bfloat16/float16 and quantized weights, float32/float16/
bfloat16 caches, odd sizes, one and two threads, and every GEMM loop order
(forced through the environment in a subprocess). Both are also held to a
float64 NumPy reference, so a bug shared by both paths cannot pass.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

core = pytest.importorskip("conveyor._testing")
from conveyor import _core  # noqa: E402

from conveyor.testing import bf16_bits_to_f32, f32_to_bf16_bits, round_to_dtype  # noqa: E402

INFO = _core.kernel_info()
LEVELS = ("avx2", "avx512", "avx512_bf16")
IMPLS = ["simd", "plain"] + [lv for lv in LEVELS if lv in INFO["levels"] and lv != INFO["simd"]]
NS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64]
WDTYPES = ["float32", "bfloat16", "float16"]
QTYPES = ["q8_0", "q4_0", "q4_1"]
# (rows, cols): few panels (rows read in place), and enough panels for one
# thread to pack x (>= 48 panels of 16 rows)
SHAPES = [(33, 67), (777, 45)]


def rmsnorm_ref(x, g, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * g


def swiglu_ref(gu):
    gu = gu.astype(np.float64)
    g, u = np.split(gu, 2, axis=1)
    return g / (1.0 + np.exp(-g)) * u


def check_gemms(impls, shapes, ns, wdtypes, threads=(1, 2), seed=0):
    """Every fused GEMM equals its unfused pair bit for bit, and both are
    near the float64 reference (quantized weights: near the unfused only, the
    activations being quantized too)."""
    r = np.random.default_rng(seed)
    eps = 1e-5
    for rows, cols in shapes:
        w = r.standard_normal((rows, cols), dtype=np.float32)
        g = (1.0 + 0.1 * r.standard_normal(cols)).astype(np.float32)
        bias = r.standard_normal(rows, dtype=np.float32)
        for wdt in wdtypes:
            quant = wdt.startswith("q")
            for impl in impls:
                for th in threads:
                    mat = core.kernel_matrix(w, wdt, impl=impl, threads=th)
                    for n in ns:
                        x = (3.0 * r.standard_normal((n, cols))).astype(np.float32)
                        gu = r.standard_normal((n, 2 * cols), dtype=np.float32)
                        acc = r.standard_normal((n, rows), dtype=np.float32)
                        what = (rows, cols, wdt, impl, th, n)
                        xn = core.kernel_rmsnorm(x, g, eps, impl=impl, threads=th)
                        h = core.kernel_swiglu(gu, impl=impl, threads=th)
                        for b, a in ((None, None), (bias, acc)):
                            fused = core.kernel_rmsnorm_matmul(mat, x, g, eps, bias=b, accumulate=a)
                            plain = core.kernel_matmul(mat, xn, bias=b, accumulate=a)
                            np.testing.assert_array_equal(fused, plain, err_msg=f"rmsnorm {what}")
                            fused_h = core.kernel_swiglu_matmul(mat, gu, bias=b, accumulate=a)
                            plain_h = core.kernel_matmul(mat, h, bias=b, accumulate=a)
                            np.testing.assert_array_equal(fused_h, plain_h, err_msg=f"swiglu {what}")
                        if quant:
                            continue
                        wr = round_to_dtype(w, wdt).astype(np.float64)
                        for got, act in ((fused, rmsnorm_ref(x, g, eps)), (fused_h, swiglu_ref(gu))):
                            ref = act @ wr.T + bias + acc
                            scale = np.abs(act) @ np.abs(wr).T + np.abs(bias) + np.abs(acc)
                            # the AVX512_BF16 kernels round the activations to bf16 too
                            level = INFO["simd"] if impl == "simd" else impl
                            pairs = wdt == "bfloat16" and level == "avx512_bf16"
                            tol = (1e-2 if pairs else 2e-5) * scale + 1e-5
                            assert (np.abs(got - ref) <= tol).all(), what


@pytest.mark.parametrize("wdt", WDTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_gemms_equal_unfused(impl, wdt):
    check_gemms([impl], SHAPES, NS, [wdt])


@pytest.mark.parametrize("qtype", QTYPES)
def test_fused_gemms_quantized_equal_unfused(qtype):
    # quantized matrices need cols a multiple of 32; the rows stay odd
    check_gemms(IMPLS, [(37, 96), (19, 160)], NS, [qtype])


@pytest.mark.parametrize("env", [
    {"CONVEYOR_GEMM_ORDER": "1", "CONVEYOR_GEMM_XBLOCK": "1024"},  # panels outermost: rows made up front
    {"CONVEYOR_GEMM_ORDER": "0", "CONVEYOR_GEMM_XBLOCK": "1024", "CONVEYOR_GEMM_KC": "16"},  # many blocks
    {"CONVEYOR_GEMM_PACK": "0"},  # x never packed: rows read from the thread's buffer
    {"CONVEYOR_SIMD": "scalar"},
])
def test_fused_gemms_every_loop_order(env):
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from test_fusion import check_gemms\n"
            "check_gemms(['simd', 'plain'], [(800, 70), (33, 100), (20, 300)], [1, 6, 7, 13, 40, 61],\n"
            "            ['float32', 'bfloat16'])\n"
            "check_gemms(['simd'], [(37, 96)], [1, 7, 40], ['q8_0'])\n"
            "print('ok')\n" % here)
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# --------------------------------------------------------------------------- rope + kv write

def to_cache(a, cdt):
    if cdt == "bfloat16":
        return f32_to_bf16_bits(a)
    return np.ascontiguousarray(a, dtype=np.float16 if cdt == "float16" else np.float32)


def rope_ref(x, pos, inv_freq, layout):
    x = x.astype(np.float64)
    ang = pos[:, None, None].astype(np.float64) * inv_freq.astype(np.float64)[None, None, :]
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    out = np.empty_like(x)
    if layout == "halves":
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out[..., :h], out[..., h:] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("cdt", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["halves", "pairs"])
@pytest.mark.parametrize("hd,nh,nkv", [(2, 1, 1), (6, 3, 1), (18, 5, 1), (64, 4, 2), (384, 2, 1)])
def test_rope_kv_write_equals_rope_then_kv_write(cdt, layout, hd, nh, nkv):
    r = np.random.default_rng([hd, nh, len(layout), len(cdt)])
    nb, bs = 9, 4
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))).astype(np.float32)
    width = (nh + 2 * nkv) * hd
    cache_dt = cdt if cdt == "bfloat16" else None
    for n in NS[:-1] + [nb * bs - 3]:
        pos = r.integers(0, 5000, n).astype(np.int32)
        slots = r.permutation(nb * bs)[:n].astype(np.int64)
        slots[1::4] = -1  # padding tokens: rotated, not written
        base = r.standard_normal((n, width), dtype=np.float32)
        cache0 = to_cache(np.full((nb, nkv, bs, hd), 7.0, np.float32), cdt)
        for impl in IMPLS:
            for th in (1, 2):
                runs = []
                for fused in (False, True):
                    buf = base.copy()  # q, k, v: strided views into one qkv row, as the model has them
                    q = buf[:, : nh * hd].reshape(n, nh, hd)
                    k = buf[:, nh * hd:(nh + nkv) * hd].reshape(n, nkv, hd)
                    v = buf[:, (nh + nkv) * hd:].reshape(n, nkv, hd)
                    kc, vc = cache0.copy(), cache0.copy()
                    if fused:
                        core.kernel_rope_kv_write(q, k, v, pos, inv_freq, kc, vc, slots, layout, cache_dt,
                                                  impl=impl, threads=th)
                    else:
                        core.kernel_rope(q, k, pos, inv_freq, layout, impl=impl, threads=th)
                        core.kernel_kv_write(kc, vc, k, v, slots, cache_dt, impl=impl, threads=th)
                    runs.append((buf, kc, vc))
                what = (impl, th, n)
                for a, b in zip(*runs):
                    np.testing.assert_array_equal(a, b, err_msg=str(what))
                buf, kc, vc = runs[1]
                q0 = base[:, : nh * hd].reshape(n, nh, hd)
                k0 = base[:, nh * hd:(nh + nkv) * hd].reshape(n, nkv, hd)
                np.testing.assert_allclose(buf[:, : nh * hd].reshape(n, nh, hd),
                                           rope_ref(q0, pos, inv_freq, layout), rtol=1e-5, atol=1e-5)
                kf = bf16_bits_to_f32(kc) if cdt == "bfloat16" else kc.astype(np.float32)
                rk = rope_ref(k0, pos, inv_freq, layout)
                for t in range(n):
                    s = slots[t]
                    if s >= 0:
                        np.testing.assert_allclose(kf[s // bs, :, s % bs], rk[t], rtol=1e-2, atol=1e-2)
                written = set(int(s) for s in slots if s >= 0)
                untouched = [s for s in range(nb * bs) if s not in written]
                assert all((kc[s // bs, :, s % bs] == cache0[s // bs, :, s % bs]).all() for s in untouched)


def test_fused_hooks_reject_bad_arguments():
    w = np.ones((5, 8), np.float32)
    mat = core.kernel_matrix(w)
    with pytest.raises(ValueError):
        core.kernel_rmsnorm_matmul(mat, np.ones((2, 8), np.float32), np.ones(7, np.float32))
    with pytest.raises(ValueError):
        core.kernel_swiglu_matmul(mat, np.ones((2, 8), np.float32))  # gu needs 16 columns
    with pytest.raises(TypeError):
        core.kernel_swiglu_matmul(np.ones(3), np.ones((2, 16), np.float32))
    with pytest.raises(ValueError):
        core.kernel_matrix(w, "q5_0")
    q = np.zeros((2, 1, 8), np.float32)
    kc = np.zeros((2, 1, 4, 8), np.float32)
    f = np.ones(4, np.float32)
    with pytest.raises(ValueError):
        core.kernel_rope_kv_write(q, None, q, np.zeros(2, np.int32), f, kc, kc.copy(), np.zeros(2, np.int64))
    with pytest.raises(ValueError):  # slot past the cache
        core.kernel_rope_kv_write(q, q.copy(), q.copy(), np.zeros(2, np.int32), f, kc, kc.copy(),
                                  np.full(2, 8, np.int64))
