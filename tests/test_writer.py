"""conveyor.testing's checkpoint writers, the C loader reading what they wrote, and the CLI."""
import hashlib
import json
import struct

import numpy as np
import pytest

from conveyor import _core, cli
from conveyor.reference import ReferenceModel, read_hf_weights, read_safetensors_file
from conveyor.testing import (ARCHS, DTYPES, SHAPES, bf16_bits_to_f32, f32_to_bf16_bits, hf_tensor_layout,
                              random_shape, resolve_shape, round_to_dtype, write_hf_checkpoint,
                              write_llama2c_checkpoint)
from conveyor.tokenizer import load_tokenizer

has_checkpoint = pytest.mark.skipif(not hasattr(_core, "Checkpoint"), reason="conveyor._core.Checkpoint not built")

SMALL = dict(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_pos=64)
ST_NAME = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def ref_tensors(model: ReferenceModel) -> dict:
    """The reference's weights under the C loader's canonical names."""
    w = model.weights
    out = {"embed": w["embed"], "final_norm": w["final_norm"]}
    if w["lm_head"] is not None:
        out["lm_head"] = w["lm_head"]
    for i, L in enumerate(w["layers"]):
        for k, v in L.items():
            if v is not None:
                out[f"layers.{i}.{k}"] = v
    return out


# ---------------------------------------------------------------------------- numbers


def test_bf16_round_to_nearest_even():
    one = 1.0
    # bf16 keeps 7 mantissa bits: near 1 the spacing is 2**-7, halfway is 2**-8
    vals = np.array([one, one + 2**-8, one + 3 * 2**-8, one + 2**-8 + 2**-20, -(one + 3 * 2**-8), 0.0],
                    dtype=np.float32)
    expected = [1.0, 1.0, one + 2**-6, one + 2**-7, -(one + 2**-6), 0.0]
    np.testing.assert_array_equal(bf16_bits_to_f32(f32_to_bf16_bits(vals)), np.array(expected, np.float32))
    assert f32_to_bf16_bits(np.float32(1.0)) == 0x3F80 and f32_to_bf16_bits(np.float32(-2.0)) == 0xC000
    big, tiny = bf16_bits_to_f32(f32_to_bf16_bits(np.array([3.0e38, 1e-40], np.float32)))
    assert abs(big - 3.0e38) <= 2.0 ** (127 - 8)  # half a step at that exponent
    assert abs(tiny - 1e-40) <= 2.0 ** -134  # subnormal: half of the 2**-133 step


# ---------------------------------------------------------------------------- HF


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_checkpoint_loads_in_reference(tmp_path, arch, dtype):
    d = write_hf_checkpoint(tmp_path / "m", shape=SMALL, arch=arch, dtype=dtype, seed=3)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"][0].lower().startswith(arch)
    assert cfg["torch_dtype"] == dtype and cfg["hidden_size"] == 32 and cfg["num_key_value_heads"] == 2
    stored = read_safetensors_file(d / "model.safetensors")
    assert {dt for dt, _ in stored.values()} == {ST_NAME[dtype]}
    assert set(stored) == {name for name, *_ in hf_tensor_layout(SMALL, arch)}
    assert any(name.endswith("q_proj.bias") for name in stored) == (arch == "qwen2")
    m = ReferenceModel.load(d)
    assert m.config["arch"] == arch and m.config["qkv_bias"] == (arch == "qwen2")
    logits = m.logits([0, 5, 17, 200])
    assert np.isfinite(logits).all() and 0.5 < logits.std() < 10
    tok = load_tokenizer(d)
    assert tok.vocab_size == 300 and tok.decode(tok.encode("a red ball")) == "a red ball"


def test_hf_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = write_hf_checkpoint(tmp_path / "a", seed=7, dtype="bfloat16")
    b = write_hf_checkpoint(tmp_path / "b", seed=7, dtype="bfloat16")
    c = write_hf_checkpoint(tmp_path / "c", seed=8, dtype="bfloat16")
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert digest(a)["tokenizer.json"] == digest(c)["tokenizer.json"]


def test_hf_dtypes_hold_the_rounded_float32_values(tmp_path):
    f32 = read_hf_weights(write_hf_checkpoint(tmp_path / "f32", shape=SMALL, tokenizer=False))
    for dtype in ("float16", "bfloat16"):
        low = read_hf_weights(write_hf_checkpoint(tmp_path / dtype, shape=SMALL, dtype=dtype, tokenizer=False))
        for name, (_, values) in f32.items():
            np.testing.assert_array_equal(low[name][1], round_to_dtype(values, dtype), err_msg=name)
            assert not np.array_equal(low[name][1], values)


def test_hf_shards_hold_the_same_tensors(tmp_path):
    one = write_hf_checkpoint(tmp_path / "one", shape=SMALL, tokenizer=False)
    three = write_hf_checkpoint(tmp_path / "three", shape=SMALL, shards=3, tokenizer=False)
    index = json.loads((three / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (three / "model.safetensors").exists()
    a, b = read_hf_weights(one), read_hf_weights(three)
    assert set(a) == set(b) == set(index["weight_map"])
    for name in a:
        np.testing.assert_array_equal(a[name][1], b[name][1])
    assert index["metadata"]["total_size"] == sum(v.size * 4 for _, v in a.values())
    with pytest.raises(ValueError):
        write_hf_checkpoint(tmp_path / "bad", shape=SMALL, shards=0, tokenizer=False)


def test_hf_options(tmp_path):
    shape = dict(SMALL, head_dim=16)  # explicit head_dim != dim / n_heads
    d = write_hf_checkpoint(tmp_path / "m", shape=shape, tie_embeddings=True, rope_scaling="llama3",
                            max_position_embeddings=4096, tokenizer=False)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["head_dim"] == 16 and cfg["tie_word_embeddings"] and cfg["max_position_embeddings"] == 4096
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    stored = read_safetensors_file(d / "model.safetensors")
    assert "lm_head.weight" not in stored
    assert stored["model.layers.0.self_attn.q_proj.weight"][1].shape == (4 * 16, 32)
    assert stored["model.layers.0.self_attn.o_proj.weight"][1].shape == (32, 4 * 16)
    m = ReferenceModel.load(d)
    assert m.config["head_dim"] == 16 and m.config["tie_embeddings"]
    assert np.isfinite(m.logits([1, 2, 3])).all()
    norms = stored["model.norm.weight"][1]
    assert 0.5 < norms.mean() < 1.5 and norms.std() > 0.01


def test_named_shapes():
    assert set(SHAPES) >= {"tiny", "smollm-135m", "tinyllama-1.1b", "qwen2-0.5b"}
    s = resolve_shape("smollm-135m")
    assert (s["dim"], s["n_layers"], s["n_heads"], s["n_kv_heads"], s["hidden_dim"], s["vocab_size"]) == \
        (576, 30, 9, 3, 1536, 49152)
    assert s["head_dim"] == 64 and s["tie_embeddings"]
    t = resolve_shape("tinyllama-1.1b")
    assert (t["dim"], t["n_layers"], t["n_heads"], t["n_kv_heads"], t["hidden_dim"], t["vocab_size"]) == \
        (2048, 22, 32, 4, 5632, 32000) and not t["tie_embeddings"]
    q = resolve_shape("qwen2-0.5b")
    assert (q["dim"], q["n_layers"], q["n_heads"], q["n_kv_heads"], q["hidden_dim"], q["vocab_size"]) == \
        (896, 24, 14, 2, 4864, 151936) and q["qkv_bias"] and q["tie_embeddings"]
    n_params = sum(int(np.prod(shp)) for _, shp, *_ in hf_tensor_layout("smollm-135m", tie_embeddings=True))
    assert 130e6 < n_params < 140e6
    with pytest.raises(ValueError):
        resolve_shape("no-such-shape")
    with pytest.raises(ValueError):
        resolve_shape(dict(SMALL, n_kv_heads=3))


def test_random_shapes_run(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(4):
        shape = random_shape(rng)
        d = write_hf_checkpoint(tmp_path / f"h{i}", shape=shape, seed=i, tokenizer=False)
        assert np.isfinite(ReferenceModel.load(d).logits([1, 2, 3])).all()
        f = write_llama2c_checkpoint(tmp_path / f"l{i}.bin", shape=random_shape(rng, llama2c=True),
                                     seed=i, tokenizer=False)
        assert np.isfinite(ReferenceModel.load(f).logits([1, 2, 3])).all()


# ---------------------------------------------------------------------------- llama2.c


@pytest.mark.parametrize("tied", [True, False])
def test_llama2c_checkpoint(tmp_path, tied):
    f = write_llama2c_checkpoint(tmp_path / "m.bin", shape="tiny", seed=1, tied=tied)
    s = SHAPES["tiny"]
    head = struct.unpack("<7i", f.read_bytes()[:28])
    assert head == (64, 176, 2, 4, 2, 512 if tied else -512, 512)
    m = ReferenceModel.load(f)
    assert m.config["tie_embeddings"] == tied and m.config["rope_layout"] == "pairs"
    assert (m.weights["lm_head"] is None) == tied
    assert m.config["vocab_size"] == s["vocab_size"]
    assert np.isfinite(m.logits([1, 100, 200])).all()
    tok = load_tokenizer(f)
    assert tok.path == tmp_path / "tokenizer.bin" and tok.vocab_size == 512
    f2 = write_llama2c_checkpoint(tmp_path / "again" / "m.bin", shape="tiny", seed=1, tied=tied)
    assert f2.read_bytes() == f.read_bytes()
    assert (tmp_path / "again" / "tokenizer.bin").read_bytes() == (tmp_path / "tokenizer.bin").read_bytes()


def test_llama2c_rejects_explicit_head_dim(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        write_llama2c_checkpoint(tmp_path / "m.bin", shape=dict(SMALL, head_dim=16))


# ---------------------------------------------------------------------------- C loader


@has_checkpoint
@pytest.mark.parametrize("arch,dtype,tied", [("llama", "float32", False), ("mistral", "float16", True),
                                              ("qwen2", "bfloat16", False), ("llama", "bfloat16", True)])
def test_c_loader_reads_hf_tensors_as_written(tmp_path, arch, dtype, tied):
    d = write_hf_checkpoint(tmp_path / "m", shape=SMALL, arch=arch, dtype=dtype, tie_embeddings=tied,
                            shards=2, seed=11)
    ref = ReferenceModel.load(d)
    ck = _core.Checkpoint(str(d))
    assert ck.format == "hf"
    cfg = ck.config
    for key in ("arch", "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                "max_pos", "rope_layout", "tie_embeddings", "qkv_bias", "bos_id", "eos_ids", "dtype"):
        assert cfg[key] == ref.config[key], key
    assert cfg["rope_theta"] == pytest.approx(ref.config["rope_theta"])
    assert cfg["rms_eps"] == pytest.approx(ref.config["rms_eps"])
    expected = ref_tensors(ref)
    tensors = ck.tensors()
    assert set(tensors) == set(expected)
    for name, values in expected.items():
        got_dtype, got_shape = tensors[name]
        assert got_dtype == dtype and tuple(got_shape) == values.shape, name
        np.testing.assert_array_equal(ck.tensor(name), values.astype(np.float32), err_msg=name)


@has_checkpoint
def test_c_loader_reads_rope_scaling(tmp_path):
    d = write_hf_checkpoint(tmp_path / "m", shape=SMALL, rope_scaling="llama3", rope_theta=500000.0,
                            tokenizer=False)
    written = json.loads((d / "config.json").read_text())["rope_scaling"]
    cfg = _core.Checkpoint(str(d)).config
    assert cfg["rope_theta"] == 500000.0
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert cfg["rope_scaling"][key] == written[key], key


@has_checkpoint
def test_c_loader_reads_llama2c_tensors_as_written(tiny_llama2c_path):
    ref = ReferenceModel.load(tiny_llama2c_path)
    ck = _core.Checkpoint(str(tiny_llama2c_path))
    assert ck.format == "llama2c"
    assert ck.config["rope_layout"] == "pairs" and ck.config["tie_embeddings"]
    expected = ref_tensors(ref)
    assert set(ck.tensors()) == set(expected)
    for name, values in expected.items():
        np.testing.assert_array_equal(ck.tensor(name), values.astype(np.float32), err_msg=name)


# ---------------------------------------------------------------------------- CLI


def test_cli_usage_and_unknown_commands(capsys, monkeypatch):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("info", "generate", "serve", "bench"):
        assert name in out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == 2
    assert "kernels" in capsys.readouterr().err
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", ("conveyor.no_such_module:main", "missing"))
    assert cli.main(["ghost"]) == 1
    assert "conveyor.no_such_module" in capsys.readouterr().err
    monkeypatch.setitem(cli.SUBCOMMANDS, "echo", ("conveyor.cli:_echo_for_test", "test"))
    monkeypatch.setattr(cli, "_echo_for_test", lambda argv: len(argv), raising=False)
    assert cli.main(["echo", "a", "b", "c"]) == 3


@has_checkpoint
def test_cli_info(tiny_hf_dir, tiny_llama2c_path, capsys):
    assert cli.main(["info", str(tiny_hf_dir)]) == 0
    out = capsys.readouterr().out
    n_params = sum(int(np.prod(shp)) for _, shp, *_ in hf_tensor_layout("tiny"))
    assert "llama" in out and "hf" in out and f"{n_params:,}" in out
    assert f"{n_params * 4:,}" in out  # float32 bytes
    assert cli.main(["info", "--json", str(tiny_llama2c_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "llama2c" and info["config"]["dim"] == 64
    assert info["parameters"] == sum(v.size for v in ref_tensors(ReferenceModel.load(tiny_llama2c_path)).values())
    assert cli.main(["info", str(tiny_hf_dir / "missing")]) == 1
    assert "missing" in capsys.readouterr().err
