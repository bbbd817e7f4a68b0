"""The quantized CPU kernels (kernels/cpu/quant*.c) against NumPy.

* The C quantizer gives the same bytes as conveyor.gguf.quantize (ggml's reference rounding),
  so a checkpoint quantized at load equals the same model quantized by llama.cpp's tools.
* The quantized GEMM quantizes activations per block of 32 to int8 (scale amax/127, round half
  away from zero) and sums integer block products times the two scales. NumPy emulates exactly
  that (dequantized weights times dequantized activations, in float64): the kernel must agree to
  float32 summation noise, bounded by 1e-5 * sum|w||x| per output (K <= 512 float32 adds with
  per-block fp32 scaling: well under 1e-6 relative each, so 1e-5 has a 10x margin).
* Against plain dequantize-then-multiply (activations not quantized) the difference is the
  activation rounding only: each activation moves by at most half a step, amax_block/254, so
  |error| <= sum_blocks amax_block/254 * sum|w| over the block. That bound is checked exactly.
* Every SIMD level equals the plain-C level to the same 1e-5 bound, and one token alone gives
  the same bits as that token inside a batch (the batch-invariance the engine relies on).
* The SIMD levels run a micro-kernel on tiles of up to 4 rows x 4 tokens inside chunks of 16
  rows: row and token counts that are not multiples of the tile (and of the chunk), one block
  of K, and 1..9 tokens exercise every tile shape and the leftover rows and tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

import conveyor
from conveyor import _testing
from conveyor.gguf import dequantize, quantize

QTYPES = ["q8_0", "q4_0", "q4_1"]
LEVELS = ["scalar", "avx2", "avx512vnni", "avxvnni"]
# (tokens, rows, cols): odd row and token counts; 70 tokens cross the 64-token quantization block
SHAPES = [(1, 37, 64), (3, 19, 96), (70, 33, 160), (5, 129, 512)]


def level_or_skip(level: str) -> str:
    if _testing.kernel_qlevels()[level] is not True:
        pytest.skip(f"this CPU lacks the {level} instructions")
    return level


def random_weights(rng, rows, cols):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] = 0.0          # an all-zero block (scale 0)
    w[-1, 32:64] *= 100.0    # a block with a large range
    return w


def x_quant_dequant(x: np.ndarray) -> np.ndarray:
    """Activations as the kernel sees them: per block of 32, d = amax/127 (float32), q =
    round-half-away(x * (1/d)), x' = d * q (float64)."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(b).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (b * inv[:, :, None]).astype(np.float64)  # the float32 product, then exact rounding
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (d.astype(np.float64)[:, :, None] * q).reshape(x.shape)


@pytest.mark.parametrize("qtype", QTYPES)
def test_c_quantizer_matches_numpy_bytes(qtype):
    rng = np.random.default_rng(1)
    w = random_weights(rng, 13, 96)
    w[1, :] = np.linspace(-3, 3, 96, dtype=np.float32)  # ties and exact steps
    got = _testing.kernel_quantize(w, qtype)
    ref = quantize(w, qtype).reshape(got.shape)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qgemm_matches_numpy(qtype, shape):
    n, rows, cols = shape
    rng = np.random.default_rng(n * 1000 + rows)
    w = random_weights(rng, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    wb = quantize(w, qtype).reshape(rows, -1)
    wd = dequantize(wb, qtype, (rows, cols)).astype(np.float64)
    out = _testing.kernel_qgemm(x, wb, qtype, level="scalar", threads=2)
    assert out.dtype == np.float32 and out.shape == (n, rows)

    xd = x_quant_dequant(x)
    exact = xd @ wd.T
    noise = 1e-5 * (np.abs(xd) @ np.abs(wd).T) + 1e-30
    assert np.all(np.abs(out - exact) <= noise), np.abs(out - exact).max()

    # against unquantized activations: within the rounding bound of the activations
    plain = x.astype(np.float64) @ wd.T
    step = np.abs(x).reshape(n, -1, 32).max(axis=2) / 254.0  # [n][blocks]: half a step
    wsum = np.abs(wd).reshape(rows, -1, 32).sum(axis=2)       # [rows][blocks]
    bound = step @ wsum.T * (1 + 1e-4) + noise
    assert np.all(np.abs(out - plain) <= bound)
    # and the bound is not vacuous: the quantized result is close in relative terms
    assert np.abs(out - plain).max() <= 0.02 * np.abs(plain).max()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("level", LEVELS[1:])
def test_simd_levels_equal_plain_c(qtype, level):
    level_or_skip(level)
    rng = np.random.default_rng(7)
    for n, rows, cols in SHAPES:
        w = random_weights(rng, rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        wb = quantize(w, qtype).reshape(rows, -1)
        ref = _testing.kernel_qgemm(x, wb, qtype, level="scalar")
        got = _testing.kernel_qgemm(x, wb, qtype, level=level)
        xd = x_quant_dequant(x)
        wd = dequantize(wb, qtype, (rows, cols)).astype(np.float64)
        tol = 1e-5 * (np.abs(xd) @ np.abs(wd).T) + 1e-30
        assert np.all(np.abs(got - ref) <= tol)


@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_accumulate_threads_and_batch_invariance(qtype):
    rng = np.random.default_rng(3)
    n, rows, cols = 9, 45, 128
    w = random_weights(rng, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    acc = rng.standard_normal((n, rows)).astype(np.float32)
    wb = quantize(w, qtype).reshape(rows, -1)
    base = _testing.kernel_qgemm(x, wb, qtype)
    full = _testing.kernel_qgemm(x, wb, qtype, bias=bias, accumulate=acc)
    np.testing.assert_allclose(full, acc + (base + bias), rtol=1e-6, atol=1e-5)
    one = _testing.kernel_qgemm(x, wb, qtype, threads=1)
    np.testing.assert_array_equal(one, base)  # rows split over threads: same bits
    for i in range(n):  # one token alone == the same token in the batch, bit for bit
        np.testing.assert_array_equal(_testing.kernel_qgemm(x[i:i + 1], wb, qtype)[0], base[i])


def test_bad_arguments():
    x = np.zeros((2, 64), np.float32)
    wb = quantize(np.zeros((3, 64), np.float32), "q8_0").reshape(3, -1)
    with pytest.raises(ValueError, match="qtype must be"):
        _testing.kernel_qgemm(x, wb, "q8_1")
    with pytest.raises(ValueError, match="w_bytes must be"):
        _testing.kernel_qgemm(x, wb, "q4_0")  # q8_0 rows read as q4_0
    with pytest.raises(ValueError, match="level must be"):
        _testing.kernel_qgemm(x, wb, "q8_0", level="sse9")
    with pytest.raises(ValueError, match="multiple of 32"):
        _testing.kernel_quantize(np.zeros((2, 40), np.float32), "q8_0")
    with pytest.raises(ValueError, match="non-finite"):
        _testing.kernel_quantize(np.full((1, 32), np.inf, np.float32), "q4_1")
    levels = _testing.kernel_qlevels()
    assert levels.pop("best") in levels
    for level, ok in levels.items():
        if not ok:
            with pytest.raises(conveyor.UnsupportedError, match=level):
                _testing.kernel_qgemm(x, wb, "q8_0", level=level)


# rows: below, at and past the 2- and 4-row tiles and the 16-row chunk; cols: 1 block and 3
EDGE_ROWS = [1, 2, 3, 5, 7, 17, 35]
EDGE_COLS = [32, 96]


def qgemm_reference(x, wb, qtype, rows, cols):
    """The NumPy reference of the quantized GEMM and its float32 noise bound (see the docstring)."""
    xd = x_quant_dequant(x)
    wd = dequantize(wb, qtype, (rows, cols)).astype(np.float64)
    return xd @ wd.T, 1e-5 * (np.abs(xd) @ np.abs(wd).T) + 1e-30


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_tile_edges_match_numpy(qtype, level):
    level_or_skip(level)
    rng = np.random.default_rng(11)
    for cols in EDGE_COLS:
        for rows in EDGE_ROWS:
            w = random_weights(rng, rows, cols) if rows > 1 else rng.standard_normal((1, cols)).astype(np.float32)
            wb = quantize(w, qtype).reshape(rows, -1)
            x = rng.standard_normal((9, cols)).astype(np.float32)
            x[4, :32] = 0.0  # a token block of zeros (scale 0)
            exact, noise = qgemm_reference(x, wb, qtype, rows, cols)
            for n in range(1, 10):
                out = _testing.kernel_qgemm(x[:n], wb, qtype, level=level)
                assert out.shape == (n, rows)
                err = np.abs(out - exact[:n])
                assert np.all(err <= noise[:n]), (cols, rows, n, err.max())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_batch_invariance_every_level(qtype, level):
    """A token's outputs are the same bits alone, at any place in any batch (every tile shape,
    the 64-token quantization blocks, and the AVX512-VNNI panel path's 256-token ones) and with
    any number of threads."""
    level_or_skip(level)
    rng = np.random.default_rng(5)
    for rows, cols in [(35, 96), (16, 32), (7, 160)]:
        w = random_weights(rng, rows, cols)
        wb = quantize(w, qtype).reshape(rows, -1)
        x = rng.standard_normal((270, cols)).astype(np.float32)
        alone = np.stack([_testing.kernel_qgemm(x[i:i + 1], wb, qtype, level=level)[0] for i in range(len(x))])
        for n in list(range(1, 10)) + [70, 270]:
            np.testing.assert_array_equal(_testing.kernel_qgemm(x[:n], wb, qtype, level=level), alone[:n])
        for threads in (1, 2, 3):
            got = _testing.kernel_qgemm(x, wb, qtype, level=level, threads=threads)
            np.testing.assert_array_equal(got, alone)
        perm = rng.permutation(len(x))[:11]  # the same tokens in another order and batch size
        np.testing.assert_array_equal(_testing.kernel_qgemm(x[perm], wb, qtype, level=level), alone[perm])


@pytest.mark.parametrize("level", LEVELS)
def test_activation_rounding_ties(level):
    """Activations exactly halfway between two int8 steps round away from zero at every level
    (the SIMD quantizer gives the bytes of the C one): amax 127 makes the scale 1, so x = k + 0.5
    is a tie; a step off moves an output by d |w|, far past the noise bound."""
    level_or_skip(level)
    rng = np.random.default_rng(13)
    k = np.arange(-63, 63, dtype=np.float32)
    x = np.zeros((3, 128), np.float32)
    x[0, 0], x[0, 1:127] = 127.0, k + 0.5
    x[1, 0], x[1, 1:127] = -127.0, -(k + 0.5)
    x[2, 0], x[2, 1:127] = 63.5, (k + 0.5) / 2  # scale 0.5: x / d = k + 0.5 again
    for qtype in QTYPES:
        w = random_weights(rng, 11, 128)
        wb = quantize(w, qtype).reshape(11, -1)
        exact, noise = qgemm_reference(x, wb, qtype, 11, 128)
        out = _testing.kernel_qgemm(x, wb, qtype, level=level)
        assert np.all(np.abs(out - exact) <= noise), (qtype, np.abs(out - exact).max())


@pytest.mark.parametrize("level", LEVELS)
def test_activation_rounding_wide_rows(level):
    """Rows of 35 blocks: the AVX-512 quantizer takes 16 blocks at a time (their maxima, sums and
    scales reduced together) and the last 3 alone. Each block has its own range (one all zero,
    one with its maximum in the last lane, one negative), and blocks of ties (scale 1 or 0.5):
    one activation a step off moves an output by d |w|, far past the noise bound, so every
    level's bytes must be the C quantizer's in every position of the 16."""
    level_or_skip(level)
    rng = np.random.default_rng(17)
    nb = 35
    x = rng.standard_normal((4, nb * 32)).astype(np.float32)
    x *= np.repeat(rng.uniform(0.01, 50.0, (4, nb)).astype(np.float32), 32, axis=1)  # a range a block
    ties = np.arange(-15, 15, dtype=np.float32) + 0.5
    for b in range(nb):
        blk = slice(32 * b, 32 * b + 32)
        if b % 5 == 2:  # amax 127 at the block's lane b % 32: scale 1, the rest exact ties
            x[0, blk] = np.concatenate([ties, ties[:2]])
            x[0, 32 * b + b % 32] = 127.0 if b % 2 else -127.0
        if b % 7 == 3:  # scale 0.5
            x[1, blk] = np.concatenate([ties, ties[:2]]) / 2
            x[1, 32 * b + 31 - b % 32] = 63.5
    x[2, 32 * 9:32 * 10] = 0.0      # an all-zero block inside a group of 16
    x[2, 32 * 33:32 * 34] = 0.0     # and one among the last blocks
    x[3, 32 * 20:32 * 21] = -np.abs(x[3, 32 * 20:32 * 21])
    for qtype in QTYPES:
        w = random_weights(rng, 19, nb * 32)
        wb = quantize(w, qtype).reshape(19, -1)
        exact, noise = qgemm_reference(x, wb, qtype, 19, nb * 32)
        out = _testing.kernel_qgemm(x, wb, qtype, level=level)
        assert np.all(np.abs(out - exact) <= noise), (qtype, np.abs(out - exact).max())
        for i in range(len(x)):  # and alone, the same bits
            np.testing.assert_array_equal(_testing.kernel_qgemm(x[i:i + 1], wb, qtype, level=level)[0], out[i])
