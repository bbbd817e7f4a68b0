"""Checkpoint loaders: HF safetensors directories and llama2.c .bin files.

Small checkpoints are written by the tests themselves (a tiny safetensors
writer below), so every value read back can be compared with what was written.
"""
import json
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest

import conveyor
from conveyor._core import Checkpoint
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR

# ---------------------------------------------------------------- writers ---


def bf16_bits(rng, shape):
    """Random finite bf16 bit patterns (uint16) and their exact float32 values."""
    sign = rng.integers(0, 2, size=shape, dtype=np.uint32) << 15
    exp = rng.integers(100, 140, size=shape, dtype=np.uint32) << 7
    man = rng.integers(0, 128, size=shape, dtype=np.uint32)
    bits = (sign | exp | man).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def encode(values, dtype, rng):
    """Returns (raw bytes, float32 values the loader must give back)."""
    if dtype == "F32":
        a = values.astype("<f4")
        return a.tobytes(), a.astype(np.float32)
    if dtype == "F16":
        a = values.astype("<f2")
        return a.tobytes(), a.astype(np.float32)
    if dtype == "BF16":
        bits, f = bf16_bits(rng, values.shape)
        return bits.astype("<u2").tobytes(), f
    raise ValueError(dtype)


def st_bytes(entries, metadata=None, header_override=None):
    """A safetensors image. entries: name -> (dtype, shape, raw bytes)."""
    header, data = {}, bytearray()
    for name, (dt, shape, raw) in entries.items():
        data += b"\0" * (-len(data) % 8)  # keep every tensor aligned
        begin = len(data)
        data += raw
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [begin, len(data)]}
    if metadata is not None:
        header["__metadata__"] = metadata
    if header_override:
        header_override(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + bytes(data)


BASE_CFG = dict(
    architectures=["LlamaForCausalLM"], hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=32, max_position_embeddings=64,
    rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    torch_dtype="float32",
)


def hf_shapes(cfg):
    d, h, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or d // nh
    v = cfg["vocab_size"]
    qwen = "Qwen2ForCausalLM" in cfg.get("architectures", [])
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, nh * hd)
        if qwen:
            shapes[p + "self_attn.q_proj.bias"] = (nh * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (h, d)
        shapes[p + "mlp.up_proj.weight"] = (h, d)
        shapes[p + "mlp.down_proj.weight"] = (d, h)
    return shapes


def canonical(hf_name):
    if hf_name == "model.embed_tokens.weight":
        return "embed"
    if hf_name == "model.norm.weight":
        return "final_norm"
    if hf_name == "lm_head.weight":
        return "lm_head"
    parts = hf_name.split(".")
    i, rest = parts[2], ".".join(parts[3:])
    table = {
        "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
        "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
        "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
        "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "w_gate",
        "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    }
    return f"layers.{i}.{table[rest]}"


def make_hf(path, dtype="F32", seed=0, shards=None, extra=None, drop=(), edit=None, **cfg_over):
    """Writes a tiny HF checkpoint; returns {hf_name: expected float32 array}."""
    rng = np.random.default_rng(seed)
    cfg = dict(BASE_CFG, **cfg_over)
    cfg = {k: v for k, v in cfg.items() if v is not ...}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    try:  # configs made invalid on purpose get weights of the base shapes
        shapes = hf_shapes(cfg)
        assert all(isinstance(x, int) and x > 0 for s in shapes.values() for x in s)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AssertionError):
        shapes = hf_shapes(BASE_CFG)
    entries, expect = {}, {}
    for name, shape in shapes.items():
        raw, f = encode(rng.standard_normal(shape).astype(np.float32), dtype, rng)
        entries[name] = (dtype, shape, raw)
        expect[name] = f.reshape(shape)
    if extra:
        entries.update(extra)
    for name in drop:
        entries.pop(name)
    if edit:
        edit(entries)
    if shards:
        names = list(entries)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: entries[n] for n in names[s::shards]}
            (path / fname).write_bytes(st_bytes(part))
            weight_map.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    else:
        (path / "model.safetensors").write_bytes(st_bytes(entries, metadata={"format": "pt"}))
    return expect


def llama2c_bytes(dim=8, hidden=12, layers=2, heads=2, kv=1, vocab=10, seq=4, tied=True, seed=0):
    hd = dim // heads if heads else 0
    kvd = kv * hd
    header = struct.pack("<7i", dim, hidden, layers, heads, kv, vocab if tied else -vocab, seq)
    n = (vocab * dim + layers * dim + layers * dim * dim * 2 + layers * kvd * dim * 2 + layers * dim
         + layers * hidden * dim * 3 + dim + seq * hd + (0 if tied else vocab * dim))
    body = np.random.default_rng(seed).standard_normal(n).astype("<f4")
    return header + body.tobytes(), body


# ------------------------------------------------------------- stories260K ---


def test_stories260k_config_and_values():
    path = STORIES / "stories260K.bin"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    with Checkpoint(path) as ck:  # os.PathLike accepted
        assert ck.format == "llama2c"
        c = ck.config
        assert (c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"]) == (64, 172, 5, 8, 4)
        assert (c["vocab_size"], c["max_pos"], c["head_dim"]) == (512, 512, 8)
        assert c["arch"] == "llama" and c["rope_layout"] == "pairs" and c["dtype"] == "float32"
        assert c["tie_embeddings"] is True and c["qkv_bias"] is False and c["rope_scaling"] is None
        assert c["bos_id"] == 1 and c["eos_ids"] == [2]
        assert c["rms_eps"] == pytest.approx(1e-5) and c["rope_theta"] == 10000.0

        raw = np.fromfile(path, dtype="<f4", offset=28)
        D, H, L, V, KV = 64, 172, 5, 512, 32
        off = 0

        def take(n, shape):
            nonlocal off
            a = raw[off:off + n].reshape(shape)
            off += n
            return a

        emb = take(V * D, (V, D))
        rms_att = take(L * D, (L, D))
        wq = take(L * D * D, (L, D, D))
        wk = take(L * KV * D, (L, KV, D))
        wv = take(L * KV * D, (L, KV, D))
        wo = take(L * D * D, (L, D, D))
        rms_ffn = take(L * D, (L, D))
        w1 = take(L * H * D, (L, H, D))
        w2 = take(L * D * H, (L, D, H))
        w3 = take(L * H * D, (L, H, D))
        final = take(D, (D,))
        assert off + 512 * 8 == raw.size  # two RoPE tables remain

        np.testing.assert_array_equal(ck.tensor("embed"), emb)
        np.testing.assert_array_equal(ck.tensor("final_norm"), final)
        for i in range(L):
            for name, ref in [("attn_norm", rms_att), ("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo),
                              ("ffn_norm", rms_ffn), ("w_gate", w1), ("w_down", w2), ("w_up", w3)]:
                got = ck.tensor(f"layers.{i}.{name}")
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, ref[i], err_msg=f"layers.{i}.{name}")
        names = ck.tensors()
        assert "lm_head" not in names and "layers.0.bq" not in names
        assert names["layers.4.wk"] == ("float32", (32, 64))
        assert len(names) == 2 + 5 * 9
        with pytest.raises(KeyError):
            ck.tensor("lm_head")
        with pytest.raises(KeyError):
            ck.tensor("layers.5.wq")
    assert ck.closed
    with pytest.raises(conveyor.EngineClosedError):
        ck.config


def test_llama2c_untied_classifier(tmp_path):
    data, body = llama2c_bytes(tied=False)
    p = tmp_path / "m.bin"
    p.write_bytes(data)
    ck = Checkpoint(str(p))
    assert ck.config["tie_embeddings"] is False
    np.testing.assert_array_equal(ck.tensor("lm_head"), body[-80:].reshape(10, 8))
    np.testing.assert_array_equal(ck.tensor("embed"), body[:80].reshape(10, 8))
    ck.close()
    ck.close()  # idempotent


def test_llama2c_trailing_bytes_allowed(tmp_path):
    data, _ = llama2c_bytes()
    p = tmp_path / "m.bin"
    p.write_bytes(data + b"\0" * 12)
    assert Checkpoint(p).config["dim"] == 8


# --------------------------------------------------------------------- HF ---


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_hf_round_trip(tmp_path, dtype):
    tdt = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]
    expect = make_hf(tmp_path, dtype, torch_dtype=tdt)
    with Checkpoint(tmp_path) as ck:
        assert ck.format == "hf"
        c = ck.config
        assert c["arch"] == "llama" and c["dtype"] == tdt and c["rope_layout"] == "halves"
        assert (c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"], c["head_dim"]) == \
            (16, 24, 2, 4, 2, 4)
        assert (c["vocab_size"], c["max_pos"], c["bos_id"], c["eos_ids"]) == (32, 64, 1, [2])
        assert c["rms_eps"] == pytest.approx(1e-5) and c["tie_embeddings"] is False
        names = ck.tensors()
        assert set(names) == {canonical(n) for n in expect}
        for hf_name, ref in expect.items():
            name = canonical(hf_name)
            assert names[name] == (tdt, ref.shape)
            got = ck.tensor(name)
            assert got.dtype == np.float32 and got.shape == ref.shape
            np.testing.assert_array_equal(got, ref, err_msg=name)


def test_hf_sharded_index(tmp_path):
    expect = make_hf(tmp_path, "BF16", shards=3, torch_dtype="bfloat16")
    assert not (tmp_path / "model.safetensors").exists()
    ck = Checkpoint(str(tmp_path))
    for hf_name, ref in expect.items():
        np.testing.assert_array_equal(ck.tensor(canonical(hf_name)), ref)
    ck.close()


def test_qwen2_biases_and_eos_list(tmp_path):
    expect = make_hf(tmp_path, "F32", architectures=["Qwen2ForCausalLM"], eos_token_id=[5, 7],
                     bos_token_id=None)
    ck = Checkpoint(tmp_path)
    c = ck.config
    assert c["arch"] == "qwen2" and c["qkv_bias"] is True
    assert c["eos_ids"] == [5, 7] and c["bos_id"] == -1
    names = ck.tensors()
    assert names["layers.1.bk"] == ("float32", (8,))
    np.testing.assert_array_equal(ck.tensor("layers.1.bq"), expect["model.layers.1.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(ck.tensor("layers.0.bv"), expect["model.layers.0.self_attn.v_proj.bias"])


def test_qwen2_missing_bias(tmp_path):
    make_hf(tmp_path, architectures=["Qwen2ForCausalLM"], drop=["model.layers.1.self_attn.k_proj.bias"])
    with pytest.raises(conveyor.ModelFormatError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        Checkpoint(tmp_path)


def test_llama_has_no_biases(tmp_path):
    make_hf(tmp_path)
    ck = Checkpoint(tmp_path)
    assert ck.config["qkv_bias"] is False
    assert "layers.0.bq" not in ck.tensors()
    with pytest.raises(KeyError):
        ck.tensor("layers.0.bq")


def test_tied_embeddings_ignore_lm_head(tmp_path):
    rng = np.random.default_rng(1)
    extra = {"lm_head.weight": ("F32", (32, 16), rng.standard_normal((32, 16)).astype("<f4").tobytes())}
    make_hf(tmp_path, tie_word_embeddings=True, extra=extra)
    ck = Checkpoint(tmp_path)
    assert ck.config["tie_embeddings"] is True
    assert "lm_head" not in ck.tensors()


def test_untied_needs_lm_head(tmp_path):
    make_hf(tmp_path, drop=["lm_head.weight"])
    with pytest.raises(conveyor.ModelFormatError, match=r"lm_head\.weight.*missing"):
        Checkpoint(tmp_path)


def test_defaults_and_model_type(tmp_path):
    make_hf(tmp_path, architectures=..., model_type="mistral", num_key_value_heads=...,
            torch_dtype=..., rope_theta=..., max_position_embeddings=...,
            num_attention_heads=2, dtype="F16")
    c = Checkpoint(tmp_path).config
    assert c["arch"] == "mistral" and c["n_kv_heads"] == 2 and c["head_dim"] == 8
    assert c["dtype"] == "float16"  # from the weights when config.json does not say
    assert c["rope_theta"] == 10000.0 and c["max_pos"] > 0


def test_explicit_head_dim(tmp_path):
    expect = make_hf(tmp_path, head_dim=6)  # 4 heads * 6 != hidden 16
    ck = Checkpoint(tmp_path)
    assert ck.config["head_dim"] == 6
    assert ck.tensors()["layers.0.wq"] == ("float32", (24, 16))
    np.testing.assert_array_equal(ck.tensor("layers.0.wo"), expect["model.layers.0.self_attn.o_proj.weight"])


def test_llama3_rope_scaling(tmp_path):
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    make_hf(tmp_path, rope_scaling=rs, rope_theta=500000.0)
    c = Checkpoint(tmp_path).config
    assert c["rope_theta"] == 500000.0
    assert c["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}


def test_rope_scaling_default_and_old_key(tmp_path):
    make_hf(tmp_path / "a", rope_scaling={"rope_type": "default"})
    assert Checkpoint(tmp_path / "a").config["rope_scaling"] is None
    make_hf(tmp_path / "b", rope_scaling={"type": "llama3", "factor": 2, "low_freq_factor": 1,
                                          "high_freq_factor": 2, "original_max_position_embeddings": 16})
    assert Checkpoint(tmp_path / "b").config["rope_scaling"]["factor"] == 2.0


def test_rope_scaling_unsupported(tmp_path):
    make_hf(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(conveyor.UnsupportedError, match="linear"):
        Checkpoint(tmp_path)


def test_json_escapes_in_config(tmp_path):
    make_hf(tmp_path)
    text = (tmp_path / "config.json").read_text()
    text = text.replace('"LlamaForCausalLM"', '"Llama\\u0046or\\u0043ausalLM", "\\ud83d\\ude00 \\"q\\" \\\\ \\/"')
    (tmp_path / "config.json").write_text(text)
    assert Checkpoint(tmp_path).config["arch"] == "llama"


@pytest.mark.parametrize("text, msg", [
    ('{"a": "\\ud83d"}', "surrogate"),
    ('{"a": "\\ude00"}', "surrogate"),
    ('{"a": "\\x"}', "escape"),
    ('{"a": 1,}', "expected a string key"),
    ('{"a": NaN}', "unexpected character"),
    ('{"a": 01}', "leading zero"),
    ('{"a": 1} x', "after the JSON value"),
    ('{"a": 1, "a": 2}', "duplicate key"),
    ('{"a": "tab\there"}', "control character"),
    ('{"a": ' + "[" * 100 + "]" * 100 + "}", "nesting"),
    ('{"a": "unterminated}', "unterminated"),
    ('{"a": 1e999}', "out of range"),
    ('{"a": tru}', "literal"),
])
def test_config_json_strictness(tmp_path, text, msg):
    make_hf(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(conveyor.ModelFormatError, match=msg) as ei:
        Checkpoint(tmp_path)
    assert "config.json" in str(ei.value) and "byte" in str(ei.value)


def test_config_invalid_utf8(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"a": "\xc0\xaf"}')
    with pytest.raises(conveyor.ModelFormatError, match="UTF-8"):
        Checkpoint(tmp_path)


# ------------------------------------------------------------ bad HF dirs ---


def test_missing_config(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        Checkpoint(tmp_path)


def test_empty_config(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "config.json").write_text("")
    with pytest.raises(conveyor.ModelFormatError, match="config.json.*empty"):
        Checkpoint(tmp_path)


def test_config_not_json(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "config.json").write_text("hidden_size = 16\n")
    with pytest.raises(conveyor.ModelFormatError, match="config.json: invalid JSON at byte 0"):
        Checkpoint(tmp_path)


def test_config_not_object(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(conveyor.ModelFormatError, match="object"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "vocab_size"])
def test_missing_required_key(tmp_path, key):
    make_hf(tmp_path, **{key: ...})
    with pytest.raises(conveyor.ModelFormatError, match=f'config.json: missing required key "{key}"'):
        Checkpoint(tmp_path)


def test_missing_architecture(tmp_path):
    make_hf(tmp_path, architectures=...)
    with pytest.raises(conveyor.ModelFormatError, match="architectures"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("over, field", [
    ({"hidden_size": "16"}, "hidden_size"),
    ({"hidden_size": 16.5}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"intermediate_size": -3}, "intermediate_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_bad_config_values(tmp_path, over, field):
    make_hf(tmp_path, **over)
    with pytest.raises(conveyor.ModelFormatError, match=field) as ei:
        Checkpoint(tmp_path)
    assert "config.json" in str(ei.value)


def test_unknown_architecture(tmp_path):
    make_hf(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(conveyor.UnsupportedError, match="GPT2LMHeadModel"):
        Checkpoint(tmp_path)
    make_hf(tmp_path, architectures=..., model_type="gpt2")
    with pytest.raises(conveyor.UnsupportedError, match="gpt2"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("over, word", [
    ({"hidden_act": "gelu"}, "gelu"),
    ({"torch_dtype": "float8"}, "float8"),
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_config_features(tmp_path, over, word):
    make_hf(tmp_path, **over)
    with pytest.raises(conveyor.UnsupportedError, match=word):
        Checkpoint(tmp_path)


def test_no_weights(tmp_path):
    make_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Checkpoint(tmp_path)


def _replace_weights(tmp_path, data):
    (tmp_path / "model.safetensors").write_bytes(data)
    return tmp_path


def test_truncated_safetensors(tmp_path):
    make_hf(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    _replace_weights(tmp_path, data[:-100])
    with pytest.raises(conveyor.ModelFormatError, match="model.safetensors: tensor '.*'.*past the data section"):
        Checkpoint(tmp_path)
    _replace_weights(tmp_path, data[:5])
    with pytest.raises(conveyor.ModelFormatError, match="5 bytes, too short"):
        Checkpoint(tmp_path)
    _replace_weights(tmp_path, b"")
    with pytest.raises(conveyor.ModelFormatError, match="0 bytes"):
        Checkpoint(tmp_path)


def test_header_length_beyond_file(tmp_path):
    make_hf(tmp_path)
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", len(data))
    _replace_weights(tmp_path, bytes(data))
    with pytest.raises(conveyor.ModelFormatError, match="header length .* past the end"):
        Checkpoint(tmp_path)
    data[:8] = struct.pack("<Q", 2**64 - 1)
    _replace_weights(tmp_path, bytes(data))
    with pytest.raises(conveyor.ModelFormatError, match="header length"):
        Checkpoint(tmp_path)


def test_header_not_json(tmp_path):
    make_hf(tmp_path)
    hb = b"{not json at all}"
    _replace_weights(tmp_path, struct.pack("<Q", len(hb)) + hb)
    with pytest.raises(conveyor.ModelFormatError, match="model.safetensors: invalid JSON at byte 1"):
        Checkpoint(tmp_path)
    hb = b"[1, 2, 3]"
    _replace_weights(tmp_path, struct.pack("<Q", len(hb)) + hb)
    with pytest.raises(conveyor.ModelFormatError, match="expected an object"):
        Checkpoint(tmp_path)


def _edit_entry(name, **fields):
    def edit(header):
        header[name].update(fields)
    return edit


def _write_with_header_edit(tmp_path, edit, **kw):
    """A valid checkpoint whose safetensors header is then edited."""
    make_hf(tmp_path, **kw)
    rng = np.random.default_rng(0)
    cfg = dict(BASE_CFG, **kw)
    entries = {n: ("F32", s, rng.standard_normal(s).astype("<f4").tobytes()) for n, s in hf_shapes(cfg).items()}
    (tmp_path / "model.safetensors").write_bytes(st_bytes(entries, header_override=edit))


def test_offsets_out_of_range(tmp_path):
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", data_offsets=[0, 10**12]))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight.*past the data section"):
        Checkpoint(tmp_path)
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", data_offsets=[64, 0]))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight.*begin > end"):
        Checkpoint(tmp_path)
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", data_offsets=[-64, 0]))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight.*non-negative"):
        Checkpoint(tmp_path)
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", data_offsets=[0]))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight.*data_offsets"):
        Checkpoint(tmp_path)


def test_overlapping_offsets(tmp_path):
    def edit(header):
        header["model.norm.weight"]["data_offsets"] = list(header["lm_head.weight"]["data_offsets"])
        header["model.norm.weight"]["data_offsets"][1] = header["model.norm.weight"]["data_offsets"][0] + 64
    _write_with_header_edit(tmp_path, edit)
    with pytest.raises(conveyor.ModelFormatError, match="overlap") as ei:
        Checkpoint(tmp_path)
    assert "model.norm.weight" in str(ei.value) and "lm_head.weight" in str(ei.value)


def test_wrong_shape(tmp_path):
    def edit(entries):
        dt, shape, raw = entries["model.layers.1.self_attn.k_proj.weight"]
        entries["model.layers.1.self_attn.k_proj.weight"] = (dt, (16, 8), raw)
    make_hf(tmp_path, edit=edit)
    with pytest.raises(conveyor.ModelFormatError,
                       match=r"model.layers.1.self_attn.k_proj.weight' has shape \[16, 8\].*\[8, 16\]"):
        Checkpoint(tmp_path)


def test_missing_tensor(tmp_path):
    make_hf(tmp_path, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(conveyor.ModelFormatError,
                       match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        Checkpoint(tmp_path)


def test_unsupported_dtype(tmp_path):
    def edit(entries):
        entries["model.layers.0.mlp.down_proj.weight"] = ("I8", (16, 24), b"\1" * (16 * 24))
    make_hf(tmp_path, edit=edit)
    with pytest.raises(conveyor.UnsupportedError, match="model.layers.0.mlp.down_proj.weight.*I8"):
        Checkpoint(tmp_path)


def test_extra_tensors_of_other_dtypes_are_fine(tmp_path):
    extra = {"model.rotary.inv_freq": ("F8_E4M3", (4,), b"\0" * 4), "step": ("I64", (), b"\0" * 8)}
    make_hf(tmp_path, extra=extra)
    assert Checkpoint(tmp_path).config["dim"] == 16


def test_shape_length_mismatch(tmp_path):
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", shape=[17]))
    with pytest.raises(conveyor.ModelFormatError, match=r"model.norm.weight.*\[17\].*needs 68 bytes"):
        Checkpoint(tmp_path)
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", shape=[2**40, 2**40, 2**40]))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight"):
        Checkpoint(tmp_path)


def test_bad_entry_fields(tmp_path):
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", dtype=5))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight.*dtype"):
        Checkpoint(tmp_path)
    _write_with_header_edit(tmp_path, _edit_entry("model.norm.weight", shape=[16.0]))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight.*shape"):
        Checkpoint(tmp_path)

    def meta(header):
        header["__metadata__"] = [1]
    _write_with_header_edit(tmp_path, meta)
    with pytest.raises(conveyor.ModelFormatError, match="__metadata__"):
        Checkpoint(tmp_path)


def test_index_names_missing_shard(tmp_path):
    make_hf(tmp_path, shards=2)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FileNotFoundError, match="model-00009-of-00009.safetensors"):
        Checkpoint(tmp_path)


def test_index_problems(tmp_path):
    make_hf(tmp_path, shards=2)
    ip = tmp_path / "model.safetensors.index.json"
    idx = json.loads(ip.read_text())
    good = dict(idx["weight_map"])
    # a tensor the index does not list
    del idx["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    ip.write_text(json.dumps(idx))
    with pytest.raises(conveyor.ModelFormatError, match="weight_map has no entry.*model.layers.0.mlp.up_proj"):
        Checkpoint(tmp_path)
    # the index points at the wrong shard
    idx["weight_map"] = dict(good)
    wrong = {"model-00001-of-00002.safetensors": "model-00002-of-00002.safetensors",
             "model-00002-of-00002.safetensors": "model-00001-of-00002.safetensors"}
    idx["weight_map"]["model.norm.weight"] = wrong[good["model.norm.weight"]]
    ip.write_text(json.dumps(idx))
    with pytest.raises(conveyor.ModelFormatError, match="model.norm.weight"):
        Checkpoint(tmp_path)
    # path escapes and missing weight_map
    idx["weight_map"] = dict(good, **{"model.norm.weight": "../x.safetensors"})
    ip.write_text(json.dumps(idx))
    with pytest.raises(conveyor.ModelFormatError, match="plain file name"):
        Checkpoint(tmp_path)
    ip.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(conveyor.ModelFormatError, match="weight_map"):
        Checkpoint(tmp_path)


def test_misaligned_tensor(tmp_path):
    def edit(header):
        b, e = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [b + 2, e + 2]
    # norm weight moved 2 bytes into a U8 neighbour that shrinks to make room
    make_hf(tmp_path)
    rng = np.random.default_rng(0)
    entries = {n: ("F32", s, rng.standard_normal(s).astype("<f4").tobytes())
               for n, s in hf_shapes(BASE_CFG).items()}
    entries["zz_pad"] = ("U8", (8,), b"\0" * 8)
    data = st_bytes({"model.norm.weight": entries.pop("model.norm.weight"), "zz_pad": entries.pop("zz_pad"),
                     **entries}, header_override=lambda h: (h["zz_pad"].update(data_offsets=[66, 72], shape=[6]),
                                                            edit(h)))
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(conveyor.UnsupportedError, match="model.norm.weight.*aligned"):
        Checkpoint(tmp_path)


# ------------------------------------------------------- bad llama2.c files ---


def test_empty_llama2c(tmp_path):
    p = tmp_path / "m.bin"
    p.write_bytes(b"")
    with pytest.raises(conveyor.ModelFormatError, match="empty"):
        Checkpoint(p)
    p.write_bytes(b"\1\0\0\0" * 3)
    with pytest.raises(conveyor.ModelFormatError, match="12 bytes"):
        Checkpoint(p)


def test_truncated_llama2c(tmp_path):
    data, _ = llama2c_bytes()
    p = tmp_path / "m.bin"
    p.write_bytes(data[:-4])
    with pytest.raises(conveyor.ModelFormatError,
                       match=f"truncated.*needs {len(data)} bytes, the file has {len(data) - 4}"):
        Checkpoint(p)
    # an untied header over a tied-size file is short by the classifier
    data, _ = llama2c_bytes(tied=True)
    p.write_bytes(data[:16] + struct.pack("<i", -10) + data[20:])
    with pytest.raises(conveyor.ModelFormatError, match="truncated"):
        Checkpoint(p)


@pytest.mark.parametrize("kw, word", [
    (dict(dim=0), "dim"),
    (dict(hidden=-4), "hidden_dim"),
    (dict(layers=0), "n_layers"),
    (dict(heads=0), "n_heads"),
    (dict(kv=0), "n_kv_heads"),
    (dict(vocab=0), "vocab_size"),
    (dict(seq=-1), "seq_len"),
    (dict(heads=2, kv=3), "n_kv_heads"),
    (dict(heads=4, kv=3), "n_kv_heads"),
    (dict(dim=10, heads=4, kv=2), "dim=10"),
    (dict(dim=6, heads=2, kv=1), "even"),
])
def test_bad_llama2c_header(tmp_path, kw, word):
    args = dict(dim=8, hidden=12, layers=2, heads=2, kv=1, vocab=10, seq=4)
    args.update(kw)
    header = struct.pack("<7i", args["dim"], args["hidden"], args["layers"], args["heads"], args["kv"],
                         args["vocab"], args["seq"])
    p = tmp_path / "m.bin"
    p.write_bytes(header + b"\0" * 4096)
    with pytest.raises(conveyor.ModelFormatError, match=word):
        Checkpoint(p)


def test_huge_llama2c_header_no_overflow(tmp_path):
    p = tmp_path / "m.bin"
    p.write_bytes(struct.pack("<7i", 2**30, 2**30, 2**30, 2**14, 2**14, -(2**31 - 1), 2**30) + b"\0" * 64)
    with pytest.raises(conveyor.ModelFormatError):
        Checkpoint(p)
    p.write_bytes(struct.pack("<7i", 8, 12, 2, 2, 1, -(2**31), 4) + b"\0" * 64)
    with pytest.raises(conveyor.ModelFormatError, match="vocab_size"):
        Checkpoint(p)


# ------------------------------------------------------------------ paths ---


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "model.bin"
    with pytest.raises(FileNotFoundError, match="nope"):
        Checkpoint(missing)


@pytest.mark.parametrize("bad", [123, None, 4.5, ["x"]])
def test_non_str_path(bad):
    with pytest.raises(TypeError):
        Checkpoint(bad)


def test_part_of_hf_dir_passed(tmp_path):
    make_hf(tmp_path)
    with pytest.raises(conveyor.ModelFormatError, match="directory"):
        Checkpoint(tmp_path / "model.safetensors")


def test_errors_are_value_errors():
    assert issubclass(conveyor.ModelFormatError, ValueError)
    assert issubclass(conveyor.UnsupportedError, ValueError)


# ------------------------------------------------------------- corruption ---


def _mutate(rng, data):
    data = bytearray(data)
    op = rng.randrange(5)
    if op == 0 and data:  # flip a few bytes
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif op == 1:  # truncate
        del data[rng.randrange(len(data) + 1):]
    elif op == 2 and data:  # corrupt inside the header, where structure lives
        hl = min(len(data), 8 + struct.unpack_from("<Q", data)[0] if len(data) >= 8 else len(data))
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(max(1, hl))] = rng.choice(b'{}[]",:0123456789-.eE \\u')
    elif op == 3:  # insert bytes
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    else:  # change the header length
        if len(data) >= 8:
            n = struct.unpack_from("<Q", data)[0]
            struct.pack_into("<Q", data, 0, max(0, n + rng.randrange(-16, 17)))
    return bytes(data)


def test_random_corruption_never_crashes(tmp_path):
    good = tmp_path / "good"
    make_hf(good, architectures=["Qwen2ForCausalLM"], num_hidden_layers=1)
    st = (good / "model.safetensors").read_bytes()
    cfg = (good / "config.json").read_bytes()
    l2c, _ = llama2c_bytes()
    rng = random.Random(1234)
    bad = tmp_path / "bad"
    bad.mkdir()
    opened = 0
    for i in range(300):
        kind = i % 3
        if kind == 0:
            (bad / "config.json").write_bytes(cfg)
            (bad / "model.safetensors").write_bytes(_mutate(rng, st))
            target = bad
        elif kind == 1:
            (bad / "config.json").write_bytes(_mutate(rng, cfg))
            (bad / "model.safetensors").write_bytes(st)
            target = bad
        else:
            target = tmp_path / "m.bin"
            target.write_bytes(_mutate(rng, l2c))
        try:
            with Checkpoint(target) as ck:
                for name in ck.tensors():
                    ck.tensor(name)
                opened += 1
        except (conveyor.ModelFormatError, conveyor.UnsupportedError):
            pass
    assert opened < 300  # the corruptions were noticed at least sometimes


def test_repr_and_path(tmp_path):
    data, _ = llama2c_bytes()
    p = tmp_path / "m.bin"
    p.write_bytes(data)
    ck = Checkpoint(p)
    assert ck.path == str(p) and "llama2c" in repr(ck) and ck.closed is False
    ck.close()
    assert "closed" in repr(ck)
    with pytest.raises(conveyor.EngineClosedError):
        ck.tensors()
    with pytest.raises(conveyor.EngineClosedError):
        ck.tensor("embed")
