"""GGUF's Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K: the C dequantizer, the exact repacking the
CPU kernels compute them in (base/quant_format.h: Q4_K as Q4_F, Q2_K as stored, the others as Q8_F), and the
quantized GEMM on them at every SIMD level, against the independent NumPy reader in
conveyor.gguf.

* Dequantization: the C reader and NumPy give the same bits on random bytes (every bit
  pattern of the scales: subnormal, huge, infinite and NaN halves) and on crafted extreme
  scales; the repacked blocks dequantize to the same values; llama.cpp's gguf-py (where
  installed) gives the same values too.
* GEMM: the NumPy emulation of the kernel (dequantized weights times the int8-rounded
  activations, float64) bounds the kernel's result by float32 noise, 1e-5 * sum|w||x| (see
  tests/test_quant_kernels.py), at odd row and token counts and at every level; one token
  alone gives the same bits as in any batch.
* A tensor cut short, or whose rows are not whole blocks, is a ModelFormatError naming it.
"""
from __future__ import annotations

import numpy as np
import pytest

import conveyor
from conveyor import _testing
from conveyor.gguf import _TYPE_LAYOUT, GGMLType, dequantize, quantize

from test_quant_kernels import LEVELS, level_or_skip, qgemm_reference

NEW_TYPES = ["q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def layout(qtype):
    return _TYPE_LAYOUT[GGMLType[qtype.upper()]]


def scale_offsets(qtype):
    """Byte offsets of the float16 scales in one block."""
    return {"q5_0": [0], "q5_1": [0, 2], "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}[qtype]


def sane_blocks(rng, qtype, rows, cols, scale=0.02):
    """Random quantized rows (every integer field random) with finite, modest scales."""
    blk, size = layout(qtype)
    raw = rng.integers(0, 256, (rows, cols // blk, size), dtype=np.uint8)
    for off in scale_offsets(qtype):
        d = rng.uniform(-scale if qtype in ("q5_0", "q5_1", "q3_k", "q6_k") else 0, scale, raw.shape[:2])
        raw[:, :, off:off + 2] = d.astype("<f2").view(np.uint8).reshape(raw.shape[:2] + (2,))
    return raw.reshape(rows, -1)


def assert_same_bits(got, ref):
    """The same float32 bits everywhere, except that a NaN's sign and payload are free."""
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_dequantize_equals_numpy_bit_for_bit_on_random_bytes(qtype):
    rng = np.random.default_rng(17)
    blk, size = layout(qtype)
    raw = rng.integers(0, 256, (9, 3 * size), dtype=np.uint8)  # any half: inf, NaN, subnormal
    ref = dequantize(raw, qtype, (9, 3 * blk))
    got = _testing.kernel_dequantize(raw, qtype)
    assert got.shape == ref.shape
    assert_same_bits(got, ref)
    # the blocks the kernels compute in hold the same values (a zero may lose its sign)
    np.testing.assert_array_equal(_testing.kernel_dequantize(raw, qtype, repacked=True), ref)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"] + NEW_TYPES)
def test_dequantize_equals_llama_cpp_gguf_py(qtype):
    """A third implementation: llama.cpp's own gguf-py (the `gguf` package, in the peers
    extra) dequantizes random blocks of every format to the same values."""
    gguf = pytest.importorskip("gguf", reason="the gguf package (llama.cpp's gguf-py) is not installed")
    from gguf import quants

    rng = np.random.default_rng(31)
    gt = getattr(gguf.GGMLQuantizationType, qtype.upper())
    blk, size = quants.GGML_QUANT_SIZES[gt]
    raw = rng.integers(0, 256, (7, 3 * size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = quants.dequantize(raw, gt).astype(np.float32).reshape(7, 3 * blk)
    got = _testing.kernel_dequantize(raw, qtype)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], ref[~nan])  # equal values (a zero's sign aside)


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_dequantize_extreme_scales(qtype):
    """The largest half (65504), the smallest subnormal, negative and zero scales, with the
    largest and smallest integers of the format: bit for bit, and exact where the format's
    value is representable."""
    rng = np.random.default_rng(3)
    blk, size = layout(qtype)
    scales = [o + i for o in scale_offsets(qtype) for i in (0, 1)]
    ints = [o for o in range(size) if o not in scales]
    for half in (0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000, 0x8000, 0x3C00, 0x0400):
        raw = sane_blocks(rng, qtype, 4, 2 * blk).reshape(4, 2, size)
        for off in scale_offsets(qtype):
            raw[:, :, off:off + 2] = np.array([half & 0xFF, half >> 8], np.uint8)
        raw[1][:, ints] = 0xFF  # every integer field at its largest (Q6_K: scales -1)
        raw[2][:, ints] = 0x00  # and at its smallest
        raw[3][:, ints] = 0x80  # and mid-range (Q6_K: scale -128)
        raw = raw.reshape(4, -1)
        ref = dequantize(raw, qtype, (4, 2 * blk))
        assert_same_bits(_testing.kernel_dequantize(raw, qtype), ref)
        np.testing.assert_array_equal(_testing.kernel_dequantize(raw, qtype, repacked=True), ref)
        assert np.isfinite(ref).all()  # 65504 * 31 * 63 and such stay finite in float32


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_numpy_quantizer_round_trips(qtype):
    """The writer's quantizers make valid blocks: the error is within the format's step."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0, :64] = 0.0
    x[1] *= 100.0
    q = quantize(x, qtype)
    back = dequantize(q, qtype, x.shape)
    bits = {"q5_0": 5, "q5_1": 5, "q2_k": 2, "q3_k": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}[qtype]
    spread = np.abs(x).reshape(6, -1, 16).max(axis=2).repeat(16, axis=1)  # per 16 elements
    assert np.all(np.abs(back - x) <= 4 * spread / 2 ** bits + 1e-6)
    np.testing.assert_array_equal(back[0, :64], 0.0)
    np.testing.assert_array_equal(_testing.kernel_dequantize(q.reshape(6, -1), qtype), back)


# (tokens, rows, cols): odd counts; 70 tokens cross the 64-token quantization block
SHAPES = [(1, 37, 256), (3, 19, 512), (70, 33, 256), (5, 7, 768), (9, 1, 256)]


@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_qgemm_every_level_matches_numpy(qtype, level):
    level_or_skip(level)
    rng = np.random.default_rng(23)
    for n, rows, cols in SHAPES:
        if layout(qtype)[0] > cols:
            continue
        wb = sane_blocks(rng, qtype, rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x[0, :32] = 0.0  # a token block of zeros (scale 0)
        exact, noise = qgemm_reference(x, wb, qtype, rows, cols)
        out = _testing.kernel_qgemm(x, wb, qtype, level=level)
        assert out.shape == (n, rows)
        err = np.abs(out - exact)
        assert np.all(err <= noise), (n, rows, cols, err.max())


@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_qgemm_batch_invariance(qtype, level):
    level_or_skip(level)
    rng = np.random.default_rng(29)
    rows, cols = 35, 512
    wb = sane_blocks(rng, qtype, rows, cols)
    x = rng.standard_normal((70, cols)).astype(np.float32)
    alone = np.stack([_testing.kernel_qgemm(x[i:i + 1], wb, qtype, level=level)[0] for i in range(len(x))])
    for n in (2, 3, 4, 5, 9, 70):
        np.testing.assert_array_equal(_testing.kernel_qgemm(x[:n], wb, qtype, level=level), alone[:n])
    np.testing.assert_array_equal(_testing.kernel_qgemm(x, wb, qtype, level=level, threads=3), alone)


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("level", LEVELS)
def test_k_quant_many_panels(qtype, level):
    """Q4_K, Q5_K and Q6_K over more rows than one thread's chunk of 4 panels of 16 (the
    AVX512-VNNI level keeps their bytes in panels; Q4_K/Q5_K expand a chunk's 6-bit scales once
    for all its token tiles, or in the kernel for a single tile; Q6_K's two scales a block are
    read in the kernel): 150 rows (10 panels, the last one 6 rows) x 4 super-blocks, 1..9
    tokens and 1..3 threads, against NumPy, and one token alone gives the same bits."""
    level_or_skip(level)
    rng = np.random.default_rng(31)
    rows, cols = 150, 1024
    wb = sane_blocks(rng, qtype, rows, cols)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    x[2, 256:288] = 0.0
    exact, noise = qgemm_reference(x, wb, qtype, rows, cols)
    alone = np.stack([_testing.kernel_qgemm(x[i:i + 1], wb, qtype, level=level)[0] for i in range(len(x))])
    assert np.all(np.abs(alone - exact) <= noise), np.abs(alone - exact).max()
    for n in range(2, 10):
        for threads in (1, 2, 3):
            got = _testing.kernel_qgemm(x[:n], wb, qtype, level=level, threads=threads)
            np.testing.assert_array_equal(got, alone[:n])


def q5_0_as_q8_0(wb, rows, cols):
    """Q5_0 rows as the Q8_0 rows the CPU kernels compute them as: the same float16 scale,
    q - 16 as int8 (NumPy, independent of the C repacking)."""
    blocks = wb.reshape(rows, cols // 32, 22)
    qh = blocks[:, :, 2:6].copy().view("<u4")[..., 0]
    qs = blocks[:, :, 6:]
    nib = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
    fifth = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    q = (nib | fifth << 4) - 16
    return np.concatenate([blocks[:, :, :2], q.astype(np.int8).view(np.uint8)], axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("level", LEVELS)
def test_q5_0_panels_are_the_q8_0_bits(level):
    """Q5_0 keeps its file's bytes in the AVX512-VNNI panels (22 bytes a block row, not Q8_0's
    34); its kernels, and the Q8_0 panels its batched tiles are expanded into, run Q8_0's
    operations on the same integers, so every output is the Q8_0 repacking's bits: odd and even
    block counts, rows that end inside a panel, 1..9 and 67 tokens (one-token tiles, tails,
    several tiles a panel), 1..3 threads, with bias and accumulation. Other levels read the
    panels back as those Q8_0 blocks."""
    level_or_skip(level)
    rng = np.random.default_rng(37)
    for rows, cols in ((150, 640), (37, 160), (16, 32)):
        wb = sane_blocks(rng, "q5_0", rows, cols)
        w8 = q5_0_as_q8_0(wb, rows, cols)
        np.testing.assert_array_equal(_testing.kernel_dequantize(wb, "q5_0"), _testing.kernel_dequantize(w8, "q8_0"))
        x = rng.standard_normal((67, cols)).astype(np.float32)
        x[1, :32] = 0.0
        bias = rng.standard_normal(rows).astype(np.float32)
        for n in (1, 2, 3, 4, 5, 9, 67):
            for threads in (1, 2, 3):
                got = _testing.kernel_qgemm(x[:n], wb, "q5_0", level=level, threads=threads)
                np.testing.assert_array_equal(got, _testing.kernel_qgemm(x[:n], w8, "q8_0", level=level, threads=threads))
        acc = rng.standard_normal((67, rows)).astype(np.float32)
        np.testing.assert_array_equal(_testing.kernel_qgemm(x, wb, "q5_0", level=level, bias=bias, accumulate=acc),
                                      _testing.kernel_qgemm(x, w8, "q8_0", level=level, bias=bias, accumulate=acc))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"] + NEW_TYPES)
def test_q8_m_holds_every_format(qtype):
    """Q8_M, the form of a stack mixing Q2_K with other formats (a float32 scale and min per
    16): every format's blocks repacked into it dequantize to the format's values, and the
    GEMM on it matches NumPy at odd sizes at every level, one token alone giving the same bits
    as in a batch."""
    rng = np.random.default_rng(41)
    blk, size = layout(qtype)
    raw = sane_blocks(rng, qtype, 5, 2 * max(blk, 256)) if qtype in NEW_TYPES else \
        quantize(rng.standard_normal((5, 512)).astype(np.float32), qtype).reshape(5, -1)
    cols = raw.shape[1] // size * blk
    np.testing.assert_array_equal(_testing.kernel_dequantize(raw, qtype, compute="q8_m32"),
                                  dequantize(raw, qtype, (5, cols)))
    for level in LEVELS:
        if not _testing.kernel_qlevels().get(level):
            continue
        for n, rows in [(1, 37), (3, 19), (70, 5), (9, 1)]:
            wb = sane_blocks(rng, qtype, rows, cols) if qtype in NEW_TYPES else \
                quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype).reshape(rows, -1)
            x = rng.standard_normal((n, cols)).astype(np.float32)
            exact, noise = qgemm_reference(x, wb, qtype, rows, cols)
            out = _testing.kernel_qgemm(x, wb, qtype, level=level, compute="q8_m32")
            assert np.all(np.abs(out - exact) <= noise), (level, n, rows)
            alone = np.stack([_testing.kernel_qgemm(x[i:i + 1], wb, qtype, level=level, compute="q8_m32")[0]
                              for i in range(min(n, 9))])
            np.testing.assert_array_equal(out[:len(alone)], alone)


def test_bad_arguments():
    x = np.zeros((2, 256), np.float32)
    wb = quantize(np.zeros((3, 256), np.float32), "q4_k").reshape(3, -1)
    with pytest.raises(ValueError, match="qtype must be"):
        _testing.kernel_qgemm(x, wb, "q8_1")
    with pytest.raises(ValueError, match="compute must be"):  # two mins a block do not fit Q8_F
        _testing.kernel_qgemm(x, quantize(np.zeros((3, 256), np.float32), "q2_k").reshape(3, -1), "q2_k",
                           compute="q8_f32")
    with pytest.raises(ValueError, match="w_bytes must be"):
        _testing.kernel_qgemm(x, wb, "q6_k")  # q4_k rows read as q6_k
    with pytest.raises(ValueError, match="w_bytes must be"):
        _testing.kernel_qgemm(np.zeros((2, 96), np.float32), wb[:, :54], "q4_k")  # not whole super-blocks
    with pytest.raises(ValueError, match="whole q6_k blocks"):
        _testing.kernel_dequantize(np.zeros((1, 200), np.uint8), "q6_k")


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_truncated_tensor_is_a_format_error_naming_it(tmp_path, qtype):
    from conveyor.testing import write_gguf_checkpoint

    shape = {"dim": 256, "hidden_dim": 512, "n_layers": 1, "n_heads": 2, "vocab_size": 64}
    path = write_gguf_checkpoint(tmp_path / "m.gguf", shape=shape, ggml_type=qtype.upper(), embed_type="F32",
                                 tokenizer=None)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor (a matrix of qtype, or a norm) loses its end
    with pytest.raises(conveyor.ModelFormatError, match=r"tensor '[^']+' data .* runs past the end"):
        conveyor.LLM(str(cut), tokenizer=None)


def test_rows_not_whole_super_blocks_is_a_format_error(tmp_path):
    """A K-quant tensor whose rows are not a multiple of 256 elements cannot be read."""
    from conveyor.gguf import GGUFWriter

    w = GGUFWriter(tmp_path / "bad.gguf")
    w.add("general.architecture", "llama")
    raw = quantize(np.zeros((1, 256), np.float32), "q4_k")
    w.add_tensor_producer("token_embd.weight", (2, 128), "F32", lambda: [np.zeros(256, np.float32).tobytes()])
    w._tensors.append(("blk.0.attn_q.weight", (1, 128), GGMLType.Q4_K, 72, lambda: [raw[:72].tobytes()]))
    w.write()
    with pytest.raises(conveyor.ModelFormatError, match="blk.0.attn_q.weight' of type Q4_K has rows of 128"):
        conveyor.LLM(str(tmp_path / "bad.gguf"), tokenizer=None)
