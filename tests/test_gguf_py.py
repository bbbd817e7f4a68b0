"""The pure-Python GGUF reader/writer and NumPy (de)quantizers (conveyor.gguf), the GGUF
random checkpoints of conveyor.testing, and the NumPy reference on GGUF models."""
import struct

import numpy as np
import pytest

from conveyor.gguf import (BLOCK_SIZE, GGMLType, GGUFError, GGUFReader, GGUFValueType, GGUFWriter,
                           dequantize, quantize, type_nbytes)
from conveyor.reference import ReferenceModel
from conveyor.testing import llama_qk_permute, write_gguf_checkpoint, write_hf_checkpoint

VT = GGUFValueType


# ---------------------------------------------------------------------------- metadata


def _all_types_metadata():
    """key -> (value, value type, element type) covering every GGUF value type."""
    return {
        "u8": (255, VT.UINT8, None), "i8": (-128, VT.INT8, None),
        "u16": (65535, VT.UINT16, None), "i16": (-32768, VT.INT16, None),
        "u32": (2**32 - 1, VT.UINT32, None), "i32": (-2**31, VT.INT32, None),
        "u64": (2**64 - 1, VT.UINT64, None), "i64": (-2**63, VT.INT64, None),
        "f32": (1.5, VT.FLOAT32, None), "f64": (1 / 3, VT.FLOAT64, None),
        "t": (True, VT.BOOL, None), "f": (False, VT.BOOL, None),
        "s": ("héllo wörld 日本 🙂\n\t", VT.STRING, None), "empty_s": ("", VT.STRING, None),
        "a_u8": ([0, 7, 255], VT.ARRAY, VT.UINT8), "a_i16": ([-5, 5], VT.ARRAY, VT.INT16),
        "a_u32": ([1, 2, 3], VT.ARRAY, VT.UINT32), "a_i32": ([-1, 0, 1], VT.ARRAY, VT.INT32),
        "a_u64": ([2**63], VT.ARRAY, VT.UINT64), "a_i64": ([-2**40], VT.ARRAY, VT.INT64),
        "a_f32": ([0.5, -2.0], VT.ARRAY, VT.FLOAT32), "a_f64": ([0.1, 1e300], VT.ARRAY, VT.FLOAT64),
        "a_bool": ([True, False, True], VT.ARRAY, VT.BOOL),
        "a_str": (["<s>", "Ġthe", "", "▁x", "日本"], VT.ARRAY, VT.STRING),
        "a_empty": ([], VT.ARRAY, VT.INT32),
        "a_nested": ([[1, 2], [3]], VT.ARRAY, VT.ARRAY),
    }


@pytest.mark.parametrize("version,alignment", [(3, 32), (2, 32), (3, 64), (3, 8)])
def test_metadata_round_trip_all_types(tmp_path, version, alignment):
    md = _all_types_metadata()
    w = GGUFWriter(tmp_path / "m.gguf", version=version, alignment=alignment)
    for k, (v, vt, et) in md.items():
        w.add(k, v, vt, et)
    w.write()
    r = GGUFReader(tmp_path / "m.gguf")
    assert r.version == version and r.alignment == alignment
    for k, (v, vt, et) in md.items():
        assert r.metadata[k] == v, k
        assert r.metadata_types[k][0] == vt, k
        if et is not None:
            assert r.metadata_types[k][1] == et, k
    assert isinstance(r.metadata["f32"], float) and isinstance(r.metadata["t"], bool)
    assert isinstance(r.metadata["a_str"], list)


def test_inferred_types(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf")
    w.add("n", 7)
    w.add("neg", -7)
    w.add("x", 0.25)
    w.add("ids", [1, 2])
    w.add("names", ["a"])
    w.write()
    t = GGUFReader(tmp_path / "m.gguf").metadata_types
    assert t["n"] == (VT.UINT32, None) and t["neg"] == (VT.INT32, None) and t["x"] == (VT.FLOAT32, None)
    assert t["ids"] == (VT.ARRAY, VT.INT32) and t["names"] == (VT.ARRAY, VT.STRING)


def test_header_layout_by_hand(tmp_path):
    """The bytes the writer lays down, checked field by field against the format."""
    w = GGUFWriter(tmp_path / "m.gguf")
    w.add("general.architecture", "llama")
    w.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32), "F32")
    w.write()
    b = (tmp_path / "m.gguf").read_bytes()
    assert b[:4] == b"GGUF"
    assert struct.unpack_from("<IQQ", b, 4) == (3, 1, 1)
    off = 24
    (n,) = struct.unpack_from("<Q", b, off)
    assert b[off + 8:off + 8 + n] == b"general.architecture"
    off += 8 + n
    assert struct.unpack_from("<IQ", b, off) == (VT.STRING, 5) and b[off + 12:off + 17] == b"llama"
    off += 17
    assert struct.unpack_from("<Q", b, off) == (1,) and b[off + 8:off + 9] == b"w"
    off += 9
    assert struct.unpack_from("<I2QIQ", b, off) == (2, 32, 2, GGMLType.F32, 0)  # ne[0] = row length
    off += 4 + 16 + 4 + 8
    data = off + (-off % 32)
    assert np.array_equal(np.frombuffer(b[data:data + 256], "<f4"), np.arange(64))
    assert len(b) == data + 256


@pytest.mark.parametrize("alignment", [32, 64, 256])
def test_tensors_round_trip_every_type(tmp_path, alignment):
    rng = np.random.default_rng(1)
    arrays = {}
    w = GGUFWriter(tmp_path / "t.gguf", alignment=alignment)
    for t in GGMLType:
        k = 8 if t.name.endswith("_K") else 1  # K-quants: rows of 256-element super-blocks
        for shape in [(64 * k,), (3, 96 * k), (2, 2, 32 * k)]:
            x = rng.standard_normal(shape).astype(np.float32)
            name = f"{t.name}.{len(shape)}d"
            arrays[name] = (x, t)
            w.add_tensor(name, x, t)
    w.add_tensor("odd", rng.standard_normal(7).astype(np.float32), "F16")  # forces padding
    w.write()
    r = GGUFReader(tmp_path / "t.gguf")
    assert list(r.tensors)[:len(arrays)] == list(arrays)
    assert r.data_offset % alignment == 0
    for name, (x, t) in arrays.items():
        info = r.tensors[name]
        assert info.shape == x.shape and info.ggml_type == t
        assert (info.offset - r.data_offset) % alignment == 0
        assert info.nbytes == type_nbytes(t, x.size)
        assert np.array_equal(r.raw(name), quantize(x, t))
        assert np.array_equal(r.tensor(name), dequantize(quantize(x, t), t, x.shape))
    assert r.tensor("F32.2d").tolist() == arrays["F32.2d"][0].tolist()


def test_reader_rejects_bad_files(tmp_path):
    good = tmp_path / "g.gguf"
    w = GGUFWriter(good)
    w.add("k", [1, 2, 3])
    w.add_tensor("w", np.ones((2, 32), np.float32), "Q8_0")
    w.write()
    raw = good.read_bytes()

    def bad(data, match):
        p = tmp_path / "bad.gguf"
        p.write_bytes(data)
        with pytest.raises(GGUFError, match=match):
            GGUFReader(p)

    bad(b"GGML" + raw[4:], "not a GGUF file")
    bad(raw[:4] + struct.pack("<I", 1) + raw[8:], "version 1")
    bad(raw[:40], "truncated")
    bad(raw[:-10], "past the end")
    i = raw.index(struct.pack("<Q", 1) + b"k") + 9  # key "k": its value type
    bad(raw[:i] + struct.pack("<I", 99) + raw[i + 4:], "unknown value type 99")
    j = raw.index(struct.pack("<Q", 1) + b"w") + 9 + 4 + 16  # tensor "w": its ggml type
    bad(raw[:j] + struct.pack("<I", 16) + raw[j + 4:], "type 16 is not supported")
    bad(raw[:j + 4] + struct.pack("<Q", 3) + raw[j + 12:], "not aligned")
    with pytest.raises(FileNotFoundError):
        GGUFReader(tmp_path / "missing.gguf")


def test_writer_rejects_bad_input(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match="multiple of 32"):
        w.add_tensor("q", np.ones((2, 33), np.float32), "Q4_0")
    with pytest.raises(GGUFError, match="not a UINT8"):
        w.add("k", 256, VT.UINT8)
    with pytest.raises(GGUFError, match="out of range"):
        w.add("k", [1, -1], VT.ARRAY, VT.UINT32)
    with pytest.raises(GGUFError, match="unknown tensor type"):
        w.add_tensor("q", np.ones(32, np.float32), "IQ2_XXS")
    with pytest.raises(GGUFError, match="non-finite"):
        w.add_tensor("q", np.full(32, np.inf, np.float32), "Q8_0")
    with pytest.raises(GGUFError, match="power of two"):
        GGUFWriter(tmp_path / "y.gguf", alignment=48)
    w.add_tensor("a", np.ones(32, np.float32))
    with pytest.raises(GGUFError, match="added twice"):
        w.add_tensor("a", np.ones(32, np.float32))
    w.add_tensor_producer("p", (32,), "F32", lambda: [b"\0" * 8])  # too short
    with pytest.raises(GGUFError, match="expected 128"):
        w.write()
    assert list(tmp_path.iterdir()) == []  # no partial file left


# ---------------------------------------------------------------------------- quantization


def _blocks(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((n, BLOCK_SIZE)) * scale).astype(np.float32)


def test_q8_0_layout_and_rounding():
    # amax 127 -> d = 1: q = round-half-away-from-zero(x)
    x = np.zeros(32, np.float32)
    x[:7] = [127, 2.5, -2.5, 0.5, -0.5, 1.49, -126.6]
    raw = quantize(x, "Q8_0")
    assert raw.size == 34
    assert np.frombuffer(raw[:2].tobytes(), "<f2")[0] == 1.0
    assert raw[2:9].view(np.int8).tolist() == [127, 3, -3, 1, -1, 1, -127]
    by_hand = struct.pack("<e", 0.5) + bytes(np.arange(-16, 16, dtype=np.int8).view(np.uint8))
    assert dequantize(by_hand, "Q8_0").tolist() == [0.5 * q for q in range(-16, 16)]


def test_q4_0_layout_and_rounding():
    # the element of largest magnitude is -16 -> d = -16 / -8 = 2; q = trunc(x/d + 8.5)
    x = np.array([-16.0] + [2.0 * (i % 8) for i in range(1, 32)], np.float32)
    raw = quantize(x, "Q4_0")
    assert raw.size == 18 and np.frombuffer(raw[:2].tobytes(), "<f2")[0] == 2.0
    q = [min(15, int(v / 2 + 8.5)) for v in x]
    assert raw[2:].tolist() == [q[j] | (q[j + 16] << 4) for j in range(16)]  # low = 0..15, high = 16..31
    by_hand = struct.pack("<e", -0.25) + bytes((j & 15) | ((15 - j) << 4) for j in range(16))
    want = [-0.25 * (j - 8) for j in range(16)] + [-0.25 * ((15 - j) - 8) for j in range(16)]
    assert dequantize(by_hand, "Q4_0").tolist() == want


def test_q4_1_layout_and_rounding():
    x = np.linspace(-1.0, 2.0, 32, dtype=np.float32)
    raw = quantize(x, "Q4_1")
    d, m = np.frombuffer(raw[:4].tobytes(), "<f2")
    assert raw.size == 20 and d == np.float16(3.0 / 15) and m == np.float16(-1.0)
    q = [min(15, int((float(v) + 1.0) / np.float32(3.0 / 15) + 0.5)) for v in x]
    assert raw[4:].tolist() == [q[j] | (q[j + 16] << 4) for j in range(16)]
    by_hand = struct.pack("<ee", 0.5, -3.0) + bytes((j & 15) | (j << 4) for j in range(16))
    assert dequantize(by_hand, "Q4_1").tolist() == [0.5 * (j % 16) - 3.0 for j in range(32)]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_quantize_error_bounds(scale):
    x = _blocks(512, seed=3, scale=scale)
    x[0] = 0.0  # an all-zero block: d = 0, exact
    x[1, :] = 5.0 * scale  # a constant block
    amax = np.abs(x).max(axis=1, keepdims=True)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    # float16 rounding of the stored d and m: relative 2^-11 (2^-10 with a margin), absolute
    # 2^-25 (2^-24) below 2^-14 where float16 is subnormal
    rel, ab = 2.0 ** -10, 2.0 ** -24
    err = {t: np.abs(dequantize(quantize(x, t), t, x.shape) - x) for t in ("Q8_0", "Q4_0", "Q4_1")}
    assert np.all(err["Q8_0"] <= amax / 127 * (0.5 + 127 * rel) + 127 * ab)
    assert np.all(err["Q4_0"] <= amax / 8 * (1.0 + 8 * rel) + 8 * ab)  # 1 step at the clipped top
    assert np.all(err["Q4_1"] <= (hi - lo) / 15 * (0.5 + 15 * rel) + np.abs(lo) * rel + 16 * ab)
    assert err["Q8_0"][0].max() == 0 and err["Q4_0"][0].max() == 0 and err["Q4_1"][0].max() == 0
    # typical error: a quarter of a step for rounding to nearest
    assert err["Q8_0"].mean() < 0.3 * (amax / 127).mean()
    assert err["Q4_1"].mean() < 0.3 * ((hi - lo) / 15).mean()


def test_float_types():
    x = np.array([1.0, -2.5, 3.14159, 1e-8, 65504.0, 1e38], np.float32)
    assert np.array_equal(dequantize(quantize(x, "F32"), "F32"), x)
    f16 = dequantize(quantize(x[:5], "F16"), "F16")
    assert np.array_equal(f16, x[:5].astype(np.float16).astype(np.float32))
    bf = dequantize(quantize(x, "BF16"), "BF16")
    assert np.all(np.abs(bf - x) <= np.abs(x) * 2.0 ** -8)
    assert bf[0] == 1.0 and bf[1] == -2.5
    assert quantize(np.float32([1.0 + 2.0 ** -8]), "BF16").view("<u2")[0] == 0x3F80  # tie -> even


# ---------------------------------------------------------------------------- checkpoints + reference


def test_llama_qk_permute_matches_definition():
    n_heads, hd, d = 3, 8, 5
    w = np.arange(n_heads * hd * d).reshape(n_heads * hd, d)
    p = llama_qk_permute(w, n_heads)
    for h in range(n_heads):
        for i in range(hd // 2):
            assert np.array_equal(p[h * hd + 2 * i], w[h * hd + i])
            assert np.array_equal(p[h * hd + 2 * i + 1], w[h * hd + hd // 2 + i])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_gguf_f32_model_equals_hf_model(tmp_path, arch, tie):
    """Same weights written as HF safetensors and as GGUF (llama.cpp names; permuted q/k and
    pairs RoPE for llama): the NumPy reference gives the same logits for both."""
    hf = write_hf_checkpoint(tmp_path / "hf", arch=arch, tie_embeddings=tie, seed=5)
    gg = write_gguf_checkpoint(tmp_path / "m.gguf", arch=arch, tie_embeddings=tie, seed=5)
    r = GGUFReader(gg)
    names = set(r.tensors)
    assert {"token_embd.weight", "output_norm.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight"} <= names
    assert ("output.weight" in names) == (not tie)
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2")
    assert r.metadata["general.architecture"] == arch and r.metadata[f"{arch}.block_count"] == 2
    toks = [0, 5, 9, 300, 77, 12]
    a, b = ReferenceModel.load(hf), ReferenceModel.load(gg)
    assert b.config["rope_layout"] == ("pairs" if arch == "llama" else "halves")
    np.testing.assert_allclose(b.logits(toks), a.logits(toks), rtol=0, atol=1e-8)


def test_quantized_gguf_models_near_float(tmp_path):
    """Each tensor type stays close to the float32 model, closer the more bits it keeps."""
    shape = dict(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_pos=256,
                 rope_theta=10000.0, rms_eps=1e-5)
    toks = list(range(1, 40, 3))
    lf = ReferenceModel.load(write_gguf_checkpoint(tmp_path / "f.gguf", shape=shape, seed=2)).logits(toks)
    err, corr = {}, {}
    for gtype in ("F16", "BF16", "Q8_0", "Q4_1", "Q4_0"):
        emb = "Q8_0" if gtype.startswith("Q") else None  # as llama.cpp's Q4 files do
        g = write_gguf_checkpoint(tmp_path / f"{gtype}.gguf", shape=shape, seed=2, ggml_type=gtype, embed_type=emb)
        r = GGUFReader(g)
        assert r.tensors["blk.0.ffn_down.weight"].ggml_type == GGMLType[gtype]  # 192 % 32 == 0
        assert r.tensors["token_embd.weight"].ggml_type == GGMLType[emb or gtype]
        assert r.tensors["blk.0.attn_norm.weight"].ggml_type == GGMLType.F32
        lq = ReferenceModel.load(g).logits(toks)
        err[gtype] = np.abs(lq - lf).max()
        corr[gtype] = np.corrcoef(lq.ravel(), lf.ravel())[0, 1]
    assert err["F16"] < 0.05 and corr["F16"] > 0.99999
    assert err["BF16"] < 0.3 and corr["BF16"] > 0.9999
    assert err["Q8_0"] < 1.0 and corr["Q8_0"] > 0.999
    assert corr["Q4_1"] > 0.85 and corr["Q4_0"] > 0.85
    assert err["F16"] < err["BF16"] < err["Q8_0"] < min(err["Q4_1"], err["Q4_0"])


def test_unquantizable_rows_fall_back_to_f32(tmp_path):
    g = GGUFReader(write_gguf_checkpoint(tmp_path / "q.gguf", shape="tiny", ggml_type="Q4_0"))
    assert g.tensors["blk.0.ffn_down.weight"].ggml_type == GGMLType.F32  # rows of 176
    assert g.tensors["blk.0.ffn_up.weight"].ggml_type == GGMLType.Q4_0


# ---------------------------------------------------------------------------- the real model


def test_real_smollm2_file(smollm2_gguf):
    r = GGUFReader(smollm2_gguf)
    md = r.metadata
    assert r.version == 3 and md["general.architecture"] == "llama"
    assert md["llama.block_count"] == 30 and md["llama.embedding_length"] == 576
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "smollm"
    assert len(md["tokenizer.ggml.tokens"]) == md["llama.vocab_size"] == 49152
    kinds = {t.ggml_type for t in r.tensors.values()}
    assert kinds == {GGMLType.F32, GGMLType.Q4_1, GGMLType.Q8_0}
    assert "output.weight" not in r.tensors  # tied embeddings
    emb = r.tensor("token_embd.weight")
    assert emb.shape == (49152, 576) and np.isfinite(emb).all() and 0.01 < emb.std() < 1
