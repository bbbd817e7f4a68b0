"""GGUF files in pure Python: a reader, a writer, and NumPy (de)quantizers.

Independent of the C reader (csrc/), so the NumPy reference and the tests check the C
loader against a second implementation written from the format description:

    header   magic b"GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata count
    metadata key (u64 length + UTF-8), u32 value type, value (arrays: u32 element type,
             u64 count, elements; strings: u64 length + UTF-8)
    tensors  name, u32 n_dims, u64 ne[n_dims] (ne[0] = the contiguous dimension),
             u32 ggml type, u64 offset from the data start (a multiple of the alignment)
    padding  to ``general.alignment`` (default 32); then the tensor data

NumPy shapes here are row-major, i.e. ``ne`` reversed: a [out][in] matrix has ne = [in, out].

Block formats (32 elements per block, little-endian, ``d``/``m`` are float16):
    Q8_0  d, int8 q[32]                     x = d * q
    Q4_0  d, u8 qs[16] (low nibbles are elements 0..15, high nibbles 16..31)   x = d * (q - 8)
    Q4_1  d, m, u8 qs[16] (same nibble order)                                  x = d * q + m
    Q5_0  d, u32 qh (bit j: element j's fifth bit), u8 qs[16] as Q4_0           x = d * (q - 16)
    Q5_1  d, m, u32 qh, u8 qs[16]                                               x = d * q + m
K-quant super-blocks of 256 elements (read only; no quantizer here):
    Q4_K  d, dmin, u8 scales[12], u8 qs[128]: 8 sub-blocks of 32, each with a 6-bit scale
          sc and min mn packed in ``scales``; sub-blocks 2c and 2c+1 are the low and high
          nibbles of qs[32c:32c+32]                     x = (d * sc) * q - (dmin * mn)
    Q5_K  d, dmin, scales[12], u8 qh[32] (bit s of qh[l]: sub-block s's element l's fifth
          bit), qs[128] as Q4_K                         x = (d * sc) * q - (dmin * mn)
    Q6_K  u8 ql[128], u8 qh[64], int8 scales[16], d: element 128h + 32k + l takes 4 bits
          of ql[64h + 32(k % 2) + l] (low nibble for k < 2) and bits 2k, 2k+1 of
          qh[32h + l]                                   x = (d * scales[8h + 2k + l // 16]) * (q - 32)
    Q3_K  u8 hmask[32], u8 qs[64], u8 scales[12], d: 16 sub-blocks of 16 with 6-bit scales sc
          (low 4 bits: scales[i] & 15 for i < 8, scales[i - 8] >> 4 else; top 2 bits: bits
          2(i // 4) of scales[8 + i % 4]); element 128h + 32k + l is bits 2k, 2k+1 of
          qs[32h + l], minus 4 unless bit 4h + k of hmask[l] is set
                                                        x = (d * (sc[8h + 2k + l // 16] - 32)) * q
    Q2_K  u8 scales[16], u8 qs[64], d, dmin: 16 sub-blocks of 16, sub-block i with scale
          sc = scales[i] & 15 and min mn = scales[i] >> 4; element 128h + 32k + l is bits 2k,
          2k+1 of qs[32h + l] (as Q3_K's), in sub-block 8h + 2k + l // 16
                                                        x = (d * sc) * q - (dmin * mn)
All products above are exact in float32 (at most 24 significant bits); only the final
``- dmin * mn`` / ``+ m`` rounds, once. The quantizers of these five types are plain
round-to-nearest ones (not ggml's search for the best scales): valid files for tests
(Q2_K's too).
The quantizers round like ggml's reference ones (scale from float32 arithmetic, then the
scale stored as float16): Q8_0 d = amax/127, q = round-half-away(x/d); Q4_0 d = -max/8
where max is the element of largest magnitude, q = min(15, trunc(x/d + 8.5)); Q4_1
d = (max-min)/15, m = min, q = min(15, trunc((x-min)/d + 0.5)).

    f = GGUFReader("model.gguf")
    f.metadata["general.architecture"]      # plain Python values; arrays are lists
    f.tensor("blk.0.attn_q.weight")         # float32, dequantized
    f.raw("blk.0.attn_q.weight")            # the stored bytes (a read-only memmap view)

    w = GGUFWriter("out.gguf")
    w.add("general.architecture", "llama")
    w.add("llama.context_length", 2048, GGUFValueType.UINT32)
    w.add_tensor("token_embd.weight", emb, GGMLType.Q8_0)
    w.write()
"""
from __future__ import annotations

import enum
import math
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ._core import ConveyorError

__all__ = [
    "GGUF_MAGIC",
    "GGUFValueType",
    "GGMLType",
    "GGUFError",
    "TensorInfo",
    "GGUFReader",
    "GGUFWriter",
    "read_gguf_metadata",
    "quantize",
    "dequantize",
    "type_nbytes",
    "BLOCK_SIZE",
    "QUANTIZABLE",
]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# The spec: general.alignment is a multiple of 8; ggml reads only powers of two. The C
# reader takes the same range (csrc/model/gguf.c).
MIN_ALIGNMENT, MAX_ALIGNMENT = 8, 1 << 20
BLOCK_SIZE = 32  # elements per block of Q8_0 / Q4_0 / Q4_1


def _valid_alignment(a) -> bool:
    return isinstance(a, int) and not isinstance(a, bool) and MIN_ALIGNMENT <= a <= MAX_ALIGNMENT \
        and a & (a - 1) == 0


class GGUFError(ConveyorError, ValueError):
    """A malformed or unsupported GGUF file (or a bad argument to the writer)."""


class GGUFValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# Scalar value types: struct code. Arrays of these are read with NumPy (dtype from the code).
_SCALAR = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_INT_RANGE = {
    GGUFValueType.UINT8: (0, 2**8), GGUFValueType.INT8: (-2**7, 2**7),
    GGUFValueType.UINT16: (0, 2**16), GGUFValueType.INT16: (-2**15, 2**15),
    GGUFValueType.UINT32: (0, 2**32), GGUFValueType.INT32: (-2**31, 2**31),
    GGUFValueType.UINT64: (0, 2**64), GGUFValueType.INT64: (-2**63, 2**63),
}

# (block elements, block bytes) per tensor type.
_TYPE_LAYOUT = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q8_0: (32, 34), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210),
}
QUANTIZABLE = tuple(t for t in GGMLType if _TYPE_LAYOUT[t][0] > 1)  # block types quantize() makes


def _ggml_type(t) -> GGMLType:
    if isinstance(t, str):
        try:
            return GGMLType[t.upper()]
        except KeyError:
            raise GGUFError(f"unknown tensor type {t!r}; supported: "
                            f"{', '.join(x.name for x in GGMLType)}") from None
    try:
        return GGMLType(int(t))
    except ValueError:
        raise GGUFError(f"tensor type {int(t)} is not supported; supported: "
                        f"{', '.join(f'{x.name} ({int(x)})' for x in GGMLType)}") from None


def type_nbytes(ggml_type, n_elements: int) -> int:
    """Bytes that ``n_elements`` take in ``ggml_type`` (a multiple of the block size)."""
    t = _ggml_type(ggml_type)
    blk, size = _TYPE_LAYOUT[t]
    if n_elements % blk:
        raise GGUFError(f"{t.name} needs a multiple of {blk} elements, got {n_elements}")
    return n_elements // blk * size


# ---------------------------------------------------------------------------- numbers


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN kept a NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if x.size % BLOCK_SIZE:
        raise GGUFError(f"quantized types need a multiple of {BLOCK_SIZE} elements, got {x.size}")
    return x.reshape(-1, BLOCK_SIZE)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q: [blocks][32] uint8 in 0..15 -> [blocks][16]: element j low, element j+16 high."""
    return (q[:, :16] | (q[:, 16:] << np.uint8(4))).astype(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def quantize(x, ggml_type) -> np.ndarray:
    """float array -> the stored bytes (uint8) of ``ggml_type``, in row-major element order."""
    t = _ggml_type(ggml_type)
    x = np.asarray(x, dtype=np.float32)
    if t == GGMLType.F32:
        return np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8)
    if t == GGMLType.F16:
        return np.ascontiguousarray(x).astype("<f2").reshape(-1).view(np.uint8)
    if t == GGMLType.BF16:
        return _bf16_bits(x.reshape(-1)).astype("<u2").view(np.uint8)
    if t in (GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
             GGMLType.Q6_K):
        return _quantize_simple(x, t)
    b = _blocks(x)
    n = b.shape[0]
    if not np.isfinite(b).all():
        raise GGUFError(f"cannot quantize non-finite values to {t.name}")
    if t == GGMLType.Q8_0:
        d = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float32)
        v = b * _inverse(d)[:, None]
        q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)  # roundf: half away
        out = np.empty((n, 34), np.uint8)
        out[:, :2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:] = q.view(np.uint8)
        return out.reshape(-1)
    if t == GGMLType.Q4_0:
        idx = np.abs(b).argmax(axis=1)
        mx = b[np.arange(n), idx]
        d = (mx / np.float32(-8)).astype(np.float32)
        v = b * _inverse(d)[:, None] + np.float32(8.5)
        q = np.minimum(np.trunc(v), 15).astype(np.uint8)
        out = np.empty((n, 18), np.uint8)
        out[:, :2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:] = _pack_nibbles(q)
        return out.reshape(-1)
    if t == GGMLType.Q4_1:
        lo, hi = b.min(axis=1), b.max(axis=1)
        d = ((hi - lo) / np.float32(15)).astype(np.float32)
        v = (b - lo[:, None]) * _inverse(d)[:, None] + np.float32(0.5)
        q = np.minimum(np.trunc(v), 15).astype(np.uint8)
        out = np.empty((n, 20), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:4] = lo.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 4:] = _pack_nibbles(q)
        return out.reshape(-1)
    raise GGUFError(f"no quantizer for {t.name} (quantizers: {', '.join(x.name for x in QUANTIZABLE)})")


def dequantize(data, ggml_type, shape=None) -> np.ndarray:
    """Stored bytes of ``ggml_type`` -> float32 (reshaped to ``shape`` when given)."""
    t = _ggml_type(ggml_type)
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    blk, size = _TYPE_LAYOUT[t]
    if raw.size % size:
        raise GGUFError(f"{raw.size} bytes are not a whole number of {t.name} blocks ({size} bytes)")
    if t == GGMLType.F32:
        out = raw.view("<f4").astype(np.float32)
    elif t == GGMLType.F16:
        out = raw.view("<f2").astype(np.float32)
    elif t == GGMLType.BF16:
        out = (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        with np.errstate(invalid="ignore", over="ignore"):  # blocks of any bits: inf * 0 is NaN, as in C
            out = _dequantize_blocks(raw.reshape(-1, size), t)
    if shape is not None:
        out = out.reshape(shape)
    return out


def _dequantize_blocks(b: np.ndarray, t: GGMLType) -> np.ndarray:
    """[n][block bytes] of a block type -> its n * block elements, float32."""
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)  # [n][1]
    if t == GGMLType.Q8_0:
        out = d * b[:, 2:].view(np.int8).astype(np.float32)
    elif t == GGMLType.Q4_0:
        out = d * (_unpack_nibbles(b[:, 2:]).astype(np.float32) - np.float32(8))
    elif t == GGMLType.Q4_1:
        m = b[:, 2:4].copy().view("<f2").astype(np.float32)
        out = d * _unpack_nibbles(b[:, 4:]).astype(np.float32) + m
    elif t == GGMLType.Q5_0:
        q = _unpack_nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << np.uint8(4))
        out = d * (q.astype(np.float32) - np.float32(16))
    elif t == GGMLType.Q5_1:
        m = b[:, 2:4].copy().view("<f2").astype(np.float32)
        q = _unpack_nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << np.uint8(4))
        out = d * q.astype(np.float32) + m
    elif t in (GGMLType.Q4_K, GGMLType.Q5_K):
        out = _dequantize_q45_k(b, t)
    elif t == GGMLType.Q3_K:
        out = _dequantize_q3_k(b)
    elif t == GGMLType.Q2_K:
        out = _dequantize_q2_k(b)
    else:
        out = _dequantize_q6_k(b)
    return out.reshape(-1)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K: [n][12] scale bytes -> the sixteen 6-bit scales, [n][16] (0..63)."""
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1).astype(np.int32)
    i = np.arange(16)
    high = (s[:, 8 + i % 4].astype(np.int32) >> (2 * (i // 4))) & 3
    return low | (high << 4)


def _dequantize_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, qs = b[:, 0:32], b[:, 32:96]
    sc = (_q3_k_scales(b[:, 96:108]) - 32).astype(np.float32)  # [n][16]
    d = b[:, 108:110].copy().view("<f2").astype(np.float32)  # [n][1]
    out = np.empty((n, 2, 4, 32), np.float32)                 # element 128h + 32k + l
    for h in range(2):
        for k in range(4):
            low = (qs[:, 32 * h:32 * h + 32] >> (2 * k)) & 3
            high = (hmask >> (4 * h + k)) & 1
            q = low.astype(np.float32) - np.where(high == 1, 0, 4).astype(np.float32)
            scale = d * sc[:, 8 * h + 2 * k:8 * h + 2 * k + 2]   # [n][2]: exact
            out[:, h, k] = np.repeat(scale, 16, axis=1) * q
    return out


def _dequantize_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc = (b[:, 0:16] & 0x0F).astype(np.float32)              # [n][16]
    mn = (b[:, 0:16] >> 4).astype(np.float32)
    qs = b[:, 16:80]
    d = b[:, 80:82].copy().view("<f2").astype(np.float32)    # [n][1]
    dmin = b[:, 82:84].copy().view("<f2").astype(np.float32)
    out = np.empty((n, 2, 4, 32), np.float32)                 # element 128h + 32k + l
    for h in range(2):
        for k in range(4):
            q = ((qs[:, 32 * h:32 * h + 32] >> (2 * k)) & 3).astype(np.float32)
            i = slice(8 * h + 2 * k, 8 * h + 2 * k + 2)       # the two 16-element halves
            scale, low = d * sc[:, i], dmin * mn[:, i]         # [n][2]: exact
            out[:, h, k] = np.repeat(scale, 16, axis=1) * q - np.repeat(low, 16, axis=1)
    return out


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").view(np.uint8).reshape(v.shape[0], 2)


def _round_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(v), lo, hi).astype(np.int32)


def _quantize_simple(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """Round-to-nearest quantizers of the Q5 and K formats (layouts in the module docstring)."""
    blk, size = _TYPE_LAYOUT[t]
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if flat.size % blk:
        raise GGUFError(f"{t.name} needs a multiple of {blk} elements, got {flat.size}")
    if not np.isfinite(flat).all():
        raise GGUFError(f"cannot quantize non-finite values to {t.name}")
    b = flat.reshape(-1, blk)
    n = b.shape[0]
    out = np.zeros((n, size), np.uint8)
    f16 = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731 (the stored scale)
    if t in (GGMLType.Q5_0, GGMLType.Q5_1):
        if t == GGMLType.Q5_0:
            idx = np.abs(b).argmax(axis=1)
            d = f16(b[np.arange(n), idx] / np.float32(-16))
            q = _round_clip(b * _inverse(d)[:, None] + 16, 0, 31)
            out[:, 0:2], qh_at, qs_at = _f16_bytes(d), 2, 6
        else:
            lo, hi = b.min(axis=1), b.max(axis=1)
            d, m = f16((hi - lo) / np.float32(31)), f16(lo)
            q = _round_clip((b - m[:, None]) * _inverse(d)[:, None], 0, 31)
            out[:, 0:2], out[:, 2:4], qh_at, qs_at = _f16_bytes(d), _f16_bytes(m), 4, 8
        h = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        out[:, qh_at:qh_at + 4] = h.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(n, 4)
        out[:, qs_at:qs_at + 16] = _pack_nibbles((q & 15).astype(np.uint8))
        return out.reshape(-1)
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        top = 15 if t == GGMLType.Q4_K else 31
        sub = b.reshape(n, 8, 32)
        lo = np.minimum(sub.min(axis=2), 0)                   # x = scale * q - min, min >= 0
        scale, mins = (sub.max(axis=2) - lo) / np.float32(top), -lo
        d, dmin = f16(scale.max(axis=1) / np.float32(63)), f16(mins.max(axis=1) / np.float32(63))
        sc = _round_clip(scale * _inverse(d)[:, None], 0, 63)
        mn = _round_clip(np.ceil(mins * _inverse(dmin)[:, None]), 0, 63)
        eff_d, eff_m = (d[:, None] * sc).astype(np.float32), (dmin[:, None] * mn).astype(np.float32)
        q = _round_clip((sub + eff_m[:, :, None]) * _inverse(eff_d.reshape(-1)).reshape(n, 8)[:, :, None], 0, top)
        out[:, 0:2], out[:, 2:4] = _f16_bytes(d), _f16_bytes(dmin)
        s12 = np.zeros((n, 12), np.int32)
        s12[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        s12[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
        s12[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
        out[:, 4:16] = s12.astype(np.uint8)
        pairs = q.reshape(n, 4, 2, 32)                         # sub-blocks 2c (low) and 2c+1 (high)
        out[:, -128:] = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(n, 128).astype(np.uint8)
        if t == GGMLType.Q5_K:
            hb = ((q >> 4) & 1) << np.arange(8)[None, :, None]  # [n][8][32]: bit s of qh[l]
            out[:, 16:48] = hb.sum(axis=1).astype(np.uint8)
        return out.reshape(-1)
    if t == GGMLType.Q2_K:  # 16 sub-blocks of 16: x = (d * sc) * q - (dmin * mn), q in 0..3, sc and mn 0..15
        sub = b.reshape(n, 16, 16)
        lo = np.minimum(sub.min(axis=2), 0)
        scale, mins = (sub.max(axis=2) - lo) / np.float32(3), -lo
        d, dmin = f16(scale.max(axis=1) / np.float32(15)), f16(mins.max(axis=1) / np.float32(15))
        sc = _round_clip(scale * _inverse(d)[:, None], 0, 15)
        mn = _round_clip(np.ceil(mins * _inverse(dmin)[:, None]), 0, 15)
        eff_d, eff_m = (d[:, None] * sc).astype(np.float32), (dmin[:, None] * mn).astype(np.float32)
        q = _round_clip((sub + eff_m[:, :, None]) * _inverse(eff_d.reshape(-1)).reshape(n, 16)[:, :, None], 0, 3)
        q = q.reshape(n, 2, 4, 32)                              # element 128h + 32k + l
        for h in range(2):
            for k in range(4):
                out[:, 16 + 32 * h:48 + 32 * h] |= (q[:, h, k] << (2 * k)).astype(np.uint8)
        out[:, 0:16] = (sc | (mn << 4)).astype(np.uint8)
        out[:, 80:82], out[:, 82:84] = _f16_bytes(d), _f16_bytes(dmin)
        return out.reshape(-1)
    if t == GGMLType.Q3_K:  # 16 sub-blocks of 16, q in -4..3, scales sc - 32 in -32..31
        sub = b.reshape(n, 16, 16)
        idx = np.abs(sub).argmax(axis=2)
        scale = np.take_along_axis(sub, idx[:, :, None], axis=2)[:, :, 0] / np.float32(-4)
        d = f16(np.abs(scale).max(axis=1) / np.float32(31))
        sc = _round_clip(scale * _inverse(d)[:, None], -32, 31)
        eff = (d[:, None] * sc).astype(np.float32)
        u = (_round_clip(sub * _inverse(eff.reshape(-1)).reshape(n, 16)[:, :, None], -4, 3) + 4).reshape(n, 2, 4, 32)
        for h in range(2):
            for k in range(4):
                out[:, 32 + 32 * h:64 + 32 * h] |= ((u[:, h, k] & 3) << (2 * k)).astype(np.uint8)
                out[:, 0:32] |= ((u[:, h, k] >> 2) << (4 * h + k)).astype(np.uint8)
        sc6 = sc + 32
        s12 = np.zeros((n, 12), np.int32)
        s12[:, 0:8] = (sc6[:, 0:8] & 15) | ((sc6[:, 8:16] & 15) << 4)
        for i in range(16):
            s12[:, 8 + i % 4] |= (sc6[:, i] >> 4) << (2 * (i // 4))
        out[:, 96:108] = s12.astype(np.uint8)
        out[:, 108:110] = _f16_bytes(d)
        return out.reshape(-1)
    # Q6_K: 16 sub-blocks of 16, signed scales
    sub = b.reshape(n, 16, 16)
    idx = np.abs(sub).argmax(axis=2)
    scale = np.take_along_axis(sub, idx[:, :, None], axis=2)[:, :, 0] / np.float32(-32)
    d = f16(np.abs(scale).max(axis=1) / np.float32(127))
    sc = _round_clip(scale * _inverse(d)[:, None], -128, 127)
    eff = (d[:, None] * sc).astype(np.float32)
    q = _round_clip(sub * _inverse(eff.reshape(-1)).reshape(n, 16)[:, :, None], -32, 31) + 32  # [n][16][16]
    q = q.reshape(n, 2, 4, 32)                                 # element 128h + 32k + l
    for h in range(2):
        for k in range(4):
            lo = q[:, h, k] & 15
            col = 64 * h + 32 * (k % 2)
            out[:, col:col + 32] |= (lo if k < 2 else lo << 4).astype(np.uint8)
            out[:, 128 + 32 * h:128 + 32 * h + 32] |= (((q[:, h, k] >> 4) & 3) << (2 * k)).astype(np.uint8)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _f16_bytes(d)
    return out.reshape(-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[n][4] bytes (a little-endian u32) -> [n][32] bits, bit j at column j."""
    h = qh.copy().view("<u4").astype(np.uint32)  # [n][1]
    return ((h >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def _k_scales(s: np.ndarray):
    """Q4_K/Q5_K: [n][12] scale bytes -> the eight 6-bit scales and mins, [n][8] each."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _dequantize_q45_k(b: np.ndarray, t: GGMLType) -> np.ndarray:
    n = b.shape[0]
    d = b[:, 0:2].copy().view("<f2").astype(np.float32)      # [n][1]
    dmin = b[:, 2:4].copy().view("<f2").astype(np.float32)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, -128:].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)  # sub-block 2c low, 2c+1 high
    if t == GGMLType.Q5_K:
        qh = b[:, 16:48]
        q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4).astype(np.uint8)
    scale = (d * sc)[:, :, None]                              # exact float32 products
    low = (dmin * mn)[:, :, None]
    return scale * q.astype(np.float32) - low


def _dequantize_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)       # [n][16]
    d = b[:, 208:210].copy().view("<f2").astype(np.float32)  # [n][1]
    out = np.empty((n, 2, 4, 32), np.float32)                 # element 128h + 32k + l
    for h in range(2):
        for k in range(4):
            part = ql[:, 64 * h + 32 * (k % 2):64 * h + 32 * (k % 2) + 32]
            lo = part & 0x0F if k < 2 else part >> 4
            hi = (qh[:, 32 * h:32 * h + 32] >> (2 * k)) & 3
            q = (lo | (hi << 4)).astype(np.float32) - np.float32(32)
            scale = d * sc[:, 8 * h + 2 * k:8 * h + 2 * k + 2]   # [n][2]: the two 16-element halves
            out[:, h, k] = np.repeat(scale, 16, axis=1) * q
    return out


# ---------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple          # NumPy order (ne reversed)
    ggml_type: GGMLType
    offset: int           # absolute offset of the data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str):
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated file (reading {what} at byte {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, code: str, what: str):
        s = struct.calcsize("<" + code)
        return struct.unpack("<" + code, self.take(s, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q", what + " length")
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8") from None


_MAX_COUNT = 1 << 40  # any count beyond this is a corrupt file, not a real model


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0):
    try:
        vt = GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(f"{cur.path}: metadata {key!r} has unknown value type {vtype}") from None
    if vt == GGUFValueType.STRING:
        return cur.string(f"metadata {key!r}")
    if vt != GGUFValueType.ARRAY:
        return cur.unpack(_SCALAR[vt], f"metadata {key!r}")
    if depth > 8:
        raise GGUFError(f"{cur.path}: metadata {key!r}: arrays nested too deep")
    etype = cur.unpack("I", f"metadata {key!r} element type")
    count = cur.unpack("Q", f"metadata {key!r} count")
    if count > _MAX_COUNT:
        raise GGUFError(f"{cur.path}: metadata {key!r}: array count {count} is implausible")
    try:
        et = GGUFValueType(etype)
    except ValueError:
        raise GGUFError(f"{cur.path}: metadata {key!r} has unknown element type {etype}") from None
    if et in _SCALAR:
        dt = np.dtype("<" + _SCALAR[et]) if et != GGUFValueType.BOOL else np.dtype(np.uint8)
        raw = cur.take(count * dt.itemsize, f"metadata {key!r} array")
        arr = np.frombuffer(raw, dtype=dt)
        return [bool(v) for v in arr] if et == GGUFValueType.BOOL else arr.tolist()
    if et == GGUFValueType.STRING:
        return [cur.string(f"metadata {key!r}[{i}]") for i in range(count)]
    return [_read_value(cur, et, f"{key}[{i}]", depth + 1) for i in range(count)]


class GGUFReader:
    """A GGUF file, mapped read-only. ``metadata``: key -> Python value (arrays as lists);
    ``metadata_types``: key -> (GGUFValueType, element type or None); ``tensors``: name ->
    TensorInfo, in file order."""

    def __init__(self, path):
        self.path = Path(os.fspath(path))
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: too small to be a GGUF file ({size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map), str(self.path))
        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        self.version = cur.unpack("I", "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors = cur.unpack("Q", "tensor count")
        n_kv = cur.unpack("Q", "metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            raise GGUFError(f"{self.path}: implausible counts ({n_tensors} tensors, {n_kv} metadata)")
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.unpack("I", f"metadata {key!r} type")
            start = cur.pos
            self.metadata[key] = _read_value(cur, vtype, key)
            etype = None
            if vtype == GGUFValueType.ARRAY:
                etype = GGUFValueType(struct.unpack_from("<I", cur.buf, start)[0])
            self.metadata_types[key] = (GGUFValueType(vtype), etype)
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not _valid_alignment(align):
            raise GGUFError(f"{self.path}: general.alignment {align!r} is not a power of two in "
                            f"[{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
        self.alignment = align
        infos = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.unpack("I", f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1 to 4 are valid)")
            ne = [cur.unpack("Q", f"tensor {name!r} dims") for _ in range(n_dims)]
            numel = 1
            for d in ne:  # the C reader's rule: each dimension and the product within int64
                numel *= d
                if d == 0 or numel >= 1 << 63:
                    raise GGUFError(f"{self.path}: tensor {name!r} has a bad dimension {d}")
            ttype = cur.unpack("I", f"tensor {name!r} type")
            off = cur.unpack("Q", f"tensor {name!r} offset")
            try:
                t = _ggml_type(ttype)
            except GGUFError as e:
                raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from None
            infos.append((name, tuple(reversed(ne)), t, off))
        self.data_offset = cur.pos + (-cur.pos % align)
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, t, off in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice")
            if off % align:
                raise GGUFError(f"{self.path}: tensor {name!r} offset {off} is not aligned to {align}")
            n = math.prod(shape)
            try:
                nbytes = type_nbytes(t, n)
            except GGUFError as e:
                raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from None
            start = self.data_offset + off
            if start + nbytes > size:
                raise GGUFError(f"{self.path}: tensor {name!r} data ends past the end of the file")
            self.tensors[name] = TensorInfo(name, shape, t, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor (a read-only view into the mapped file)."""
        info = self._info(name)
        return self._map[info.offset:info.offset + info.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 in NumPy shape (dequantized)."""
        info = self._info(name)
        return dequantize(self.raw(name), info.ggml_type, info.shape)

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None


def read_gguf_metadata(path) -> dict:
    """The metadata of a GGUF file as a plain dict."""
    return GGUFReader(path).metadata


# ---------------------------------------------------------------------------- writer


def _infer_type(value) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if 0 <= v < 2**32:
            return GGUFValueType.UINT32
        if -2**31 <= v < 0:
            return GGUFValueType.INT32
        return GGUFValueType.UINT64 if v >= 0 else GGUFValueType.INT64
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return GGUFValueType.ARRAY
    raise GGUFError(f"cannot store a {type(value).__name__} in GGUF metadata")


def _infer_elem_type(values) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        for vt, code in _SCALAR.items():
            if vt != GGUFValueType.BOOL and np.dtype("<" + code) == values.dtype.newbyteorder("<"):
                return vt
        if values.dtype == np.bool_:
            return GGUFValueType.BOOL
    if len(values) == 0:
        return GGUFValueType.INT32
    first = values[0]
    if isinstance(first, str):
        return GGUFValueType.STRING
    if isinstance(first, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(first, (int, np.integer)):
        return GGUFValueType.INT32  # llama.cpp's choice for token_type and friends
    if isinstance(first, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(first, (list, tuple)):
        return GGUFValueType.ARRAY
    raise GGUFError(f"cannot store a list of {type(first).__name__} in GGUF metadata")


def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(key: str, value, vt: GGUFValueType, et: GGUFValueType | None = None) -> bytes:
    if vt == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise GGUFError(f"metadata {key!r}: expected a str, got {type(value).__name__}")
        return _pack_string(value)
    if vt == GGUFValueType.ARRAY:
        et = _infer_elem_type(value) if et is None else GGUFValueType(et)
        head = struct.pack("<IQ", et, len(value))
        if et in (GGUFValueType.STRING, GGUFValueType.ARRAY):  # nested arrays: (type, count, items) each
            return head + b"".join(_pack_value(f"{key}[{i}]", v, et) for i, v in enumerate(value))
        if et in _SCALAR:
            code = "B" if et == GGUFValueType.BOOL else _SCALAR[et]
            arr = np.asarray(value)
            if et in _INT_RANGE and arr.size:
                lo, hi = _INT_RANGE[et]
                if int(arr.min()) < lo or int(arr.max()) >= hi:
                    raise GGUFError(f"metadata {key!r}: values out of range for {et.name}")
            return head + arr.astype("<" + code).tobytes()
        raise GGUFError(f"metadata {key!r}: unsupported element type {et!r}")
    if vt in _INT_RANGE:
        lo, hi = _INT_RANGE[vt]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= int(value) < hi:
            raise GGUFError(f"metadata {key!r}: {value!r} is not a {vt.name}")
        return struct.pack("<" + _SCALAR[vt], int(value))
    if vt in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return struct.pack("<" + _SCALAR[vt], float(value))
    if vt == GGUFValueType.BOOL:
        return struct.pack("<?", bool(value))
    raise GGUFError(f"metadata {key!r}: unsupported value type {vt!r}")  # pragma: no cover


class GGUFWriter:
    """Collects metadata and tensors, then ``write()`` lays out the file (tensor data
    aligned to ``alignment``, written through a temp file and renamed into place).

    Tensors are added as float arrays (quantized here to ``ggml_type``) or as a producer:
    ``add_tensor_producer(name, shape, ggml_type, chunks)`` where ``chunks()`` yields the
    stored bytes in order (for models too large to hold in memory twice)."""

    def __init__(self, path, *, alignment: int = DEFAULT_ALIGNMENT, version: int = 3):
        if version not in (2, 3):
            raise GGUFError(f"GGUF version must be 2 or 3, got {version!r}")
        if not _valid_alignment(alignment):
            raise GGUFError(f"alignment must be a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}], "
                            f"got {alignment!r}")
        self.path = Path(os.fspath(path))
        self.alignment, self.version = alignment, version
        self._kv: dict[str, bytes] = {}
        self._tensors: list[tuple[str, tuple, GGMLType, int, Callable[[], Iterable[bytes]]]] = []
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", alignment, GGUFValueType.UINT32)

    def add(self, key: str, value, value_type=None, element_type=None) -> None:
        """One metadata entry; the type is inferred when not given (int -> UINT32 or INT32,
        float -> FLOAT32, list of int -> INT32 elements, list of float -> FLOAT32)."""
        if not isinstance(key, str) or not key:
            raise GGUFError(f"metadata key must be a non-empty str, got {key!r}")
        vt = _infer_type(value) if value_type is None else GGUFValueType(value_type)
        packed = _pack_value(key, value, vt, None if element_type is None else GGUFValueType(element_type))
        self._kv[key] = struct.pack("<I", vt) + packed

    def add_tensor(self, name: str, array, ggml_type=GGMLType.F32) -> None:
        t = _ggml_type(ggml_type)
        arr = np.asarray(array, dtype=np.float32)
        if arr.ndim < 1 or arr.ndim > 4:
            raise GGUFError(f"tensor {name!r}: 1 to 4 dimensions, got {arr.ndim}")
        if t in QUANTIZABLE and arr.shape[-1] % BLOCK_SIZE:
            raise GGUFError(f"tensor {name!r}: {t.name} needs rows of a multiple of {BLOCK_SIZE} "
                            f"elements, got shape {list(arr.shape)}")
        data = quantize(arr, t)
        self.add_tensor_producer(name, arr.shape, t, lambda: [data.tobytes()])

    def add_tensor_producer(self, name: str, shape, ggml_type, chunks: Callable[[], Iterable[bytes]]) -> None:
        t = _ggml_type(ggml_type)
        if any(n == name for n, *_ in self._tensors):
            raise GGUFError(f"tensor {name!r} added twice")
        shape = tuple(int(s) for s in shape)
        n = int(np.prod(shape, dtype=np.int64))
        if t in _TYPE_LAYOUT and _TYPE_LAYOUT[t][0] > 1 and shape[-1] % _TYPE_LAYOUT[t][0]:
            raise GGUFError(f"tensor {name!r}: {t.name} needs rows of a multiple of {_TYPE_LAYOUT[t][0]} elements")
        self._tensors.append((name, shape, t, type_nbytes(t, n), chunks))

    def write(self) -> Path:
        head = [GGUF_MAGIC, struct.pack("<IQQ", self.version, len(self._tensors), len(self._kv))]
        for key, packed in self._kv.items():
            head.append(_pack_string(key) + packed)
        offsets, off = [], 0
        for name, shape, t, nbytes, _ in self._tensors:
            off += -off % self.alignment
            offsets.append(off)
            head.append(_pack_string(name) + struct.pack("<I", len(shape))
                        + struct.pack(f"<{len(shape)}Q", *reversed(shape)) + struct.pack("<IQ", t, off))
            off += nbytes
        header = b"".join(head)
        header += b"\0" * (-len(header) % self.alignment)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                pos = 0
                for (name, _, t, nbytes, chunks), start in zip(self._tensors, offsets):
                    f.write(b"\0" * (start - pos))
                    written = 0
                    for piece in chunks():
                        f.write(piece)
                        written += len(piece)
                    if written != nbytes:
                        raise GGUFError(f"tensor {name!r}: producer gave {written} bytes, expected {nbytes}")
                    pos = start + nbytes
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return self.path
