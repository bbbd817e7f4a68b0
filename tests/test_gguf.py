"""GGUF checkpoints in the C core (csrc/model/gguf.c, checkpoint_gguf.c) held to the NumPy reference.

Random models come from conveyor.testing.write_gguf_checkpoint (llama.cpp's names, keys and
q/k row permutation); the reference reads them with its own Python reader and NumPy
dequantizer, so a bug in the C reader cannot hide in both.

Tolerances (max|diff| / max|ref| over the logits compared):
  * F32 / F16 / BF16 files: 1e-4. The reference uses the same (widened) weights, the C forward
    runs in float32: summation noise only, as in test_runner.py.
  * Q8_0 / Q4_0 / Q4_1 files: the reference uses the dequantized weights exactly, so the only
    difference is that the C kernels quantize each activation vector to int8 per block of 32, as
    llama.cpp does (test_quant_kernels.py checks each dot product against an exact NumPy
    emulation and bounds the rounding: half a step, amax/254, per element). The rounding error
    per element is ~ amax/(127*sqrt(12)); heavy-tailed activations (SwiGLU products, outlier
    blocks) make amax several times the rms, so a dot product moves by ~1% and the layers
    compound it: measured rms error 1.4-3.1% of the logits' rms on these random models (2.6% on
    SmolLM2-135M Q4_1, whose greedy argmax still agrees everywhere) and max error 2-4.5% of the
    logit scale. Bounds: rms 6e-2, max 9e-2 (~2x margin); a wrong block layout, nibble order or
    scale gives errors of order 100%.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import conveyor
from conveyor import LLM, SamplingParams
from conveyor._core import Checkpoint
from conveyor._testing import ModelRunner
from conveyor.gguf import GGUFReader, GGUFWriter
from conveyor.reference import ReferenceModel
from conveyor import _core
from conveyor.testing import gemm_input_dtype, write_gguf_checkpoint, write_hf_checkpoint

QUANT_TOL = 9e-2  # max|diff| / max|ref|
QUANT_RMS_TOL = 6e-2  # rms(diff) / rms(ref)

# (id, shape, arch, ggml_type, embed_type, tied)
GRID = [
    ("llama-gqa-f32", dict(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320), "llama", "F32", None, False),
    ("qwen2-tied-f32", dict(dim=64, hidden_dim=160, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=300), "qwen2", "F32", None, True),
    ("llama-f16", dict(dim=96, hidden_dim=256, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=264), "llama", "F16", None, False),
    ("llama-bf16-tied", dict(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=264), "llama", "BF16", None, True),
    ("llama-q8_0-gqa", dict(dim=64, hidden_dim=192, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320), "llama", "Q8_0", None, False),
    ("llama-q4_0-tied", dict(dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=288), "llama", "Q4_0", "Q8_0", True),
    ("llama-q4_1-smollm-like", dict(dim=96, hidden_dim=256, n_layers=3, n_heads=3, n_kv_heads=1, vocab_size=320), "llama", "Q4_1", "Q8_0", True),
    ("qwen2-q4_1-untied", dict(dim=64, hidden_dim=176, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264), "qwen2", "Q4_1", "Q4_1", False),
    # K-quant and Q5 files: rows of whole 256-element super-blocks
    ("llama-q4_k-tied", dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264), "llama", "Q4_K", "Q6_K", True),
    ("llama-q5_k", dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264), "llama", "Q5_K", "Q8_0", False),
    ("qwen2-q5_0-q5_1", dict(dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264), "qwen2", "Q5_0", "Q5_1", False),
    ("llama-q3_k", dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264), "llama", "Q3_K", "Q6_K", False),
    ("qwen2-q2_k-tied", dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264), "qwen2", "Q2_K", "Q2_K", True),
]
# A Q4_K_M-like mix: stacked q/k/v and gate/up of different types (computed as Q8_F)
MIXED_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def rms_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()))


def all_logits(path, tokens, **kw) -> np.ndarray:
    """Logits of every position of one sequence, prompt fed in one pass."""
    bs = 16
    n = len(tokens)
    nblk = (n + bs - 1) // bs
    with ModelRunner(str(path), block_size=bs, num_blocks=nblk + 2, max_tokens=max(n, 1), max_seqs=max(n, 1),
                     num_threads=2, **kw) as r:
        return r.forward(tokens=np.array(tokens, np.int32), positions=np.arange(n, dtype=np.int64),
                         slot_mapping=np.arange(bs, bs + n, dtype=np.int64),
                         query_start=np.array([0, n], np.int32), context_lens=np.array([n], np.int32),
                         block_tables=np.arange(1, nblk + 1, dtype=np.int32)[None, :],
                         logits_rows=np.arange(n, dtype=np.int32))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    d = tmp_path_factory.mktemp("gguf")
    for gid, shape, arch, t, et, tied in GRID:
        out[gid] = write_gguf_checkpoint(d / f"{gid}.gguf", shape=shape, arch=arch, ggml_type=t, embed_type=et,
                                         tie_embeddings=tied, seed=len(out))
    out["llama-k-mix"] = write_gguf_checkpoint(
        d / "k-mix.gguf", shape=dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=264),
        ggml_type="Q4_K", embed_type="Q8_0", tie_embeddings=True, tensor_types=MIXED_TYPES, seed=9)
    return out


def test_k_quant_mix_matches_reference(models):
    """A file like a downloaded Q4_K_M one: every stacked matrix mixes types."""
    from conveyor.gguf import GGUFReader

    path = models["llama-k-mix"]
    kinds = {i.ggml_type.name for i in GGUFReader(path).tensors.values()}
    assert {"Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"} <= kinds
    tokens = [int(x) for x in np.random.default_rng(2).integers(0, 264, 29)]
    got, ref = all_logits(path, tokens), ReferenceModel.load(path).logits(tokens)
    assert rel_err(got, ref) < QUANT_TOL and rms_err(got, ref) < QUANT_RMS_TOL
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.85


def test_q2_k_mix_matches_reference(tmp_path):
    """A file like llama.cpp's Q2_K mixes: Q2_K matrices and embedding, attn_v in Q4_K and
    ffn_down in Q3_K, the output in Q6_K. The q/k/v stack mixes Q2_K with Q4_K (computed as
    Q8_M, a scale and a min per 16), gate/up stay Q2_K as stored."""
    from conveyor.gguf import GGUFReader

    shape = dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264)
    path = write_gguf_checkpoint(tmp_path / "q2_k-mix.gguf", shape=shape, ggml_type="Q2_K", embed_type="Q2_K",
                                 tensor_types={"attn_v": "Q4_K", "ffn_down": "Q3_K", "output": "Q6_K"}, seed=4)
    kinds = {i.ggml_type.name for i in GGUFReader(path).tensors.values()}
    assert {"Q2_K", "Q3_K", "Q4_K", "Q6_K"} <= kinds
    tokens = [int(x) for x in np.random.default_rng(2).integers(0, 264, 29)]
    got, ref = all_logits(path, tokens), ReferenceModel.load(path).logits(tokens)
    assert rel_err(got, ref) < QUANT_TOL and rms_err(got, ref) < QUANT_RMS_TOL
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.85


@pytest.mark.parametrize("case", GRID, ids=[g[0] for g in GRID])
def test_logits_match_reference(models, case):
    gid, shape, arch, t, et, tied = case
    path = models[gid]
    rng = np.random.default_rng(5)
    tokens = [int(x) for x in rng.integers(0, shape["vocab_size"], 37)]
    got = all_logits(path, tokens)
    # The path that runs: on vdpbf16ps (bf16 weights at avx512_bf16) each GEMM reads its input
    # rows rounded to bf16, and the reference rounds them the same way. What is left is float32
    # summation order, plus inputs that land within float32 noise of a bf16 rounding boundary
    # and round the other way: one bf16 step (2^-8 of the value) in one input, which the later
    # layers carry on (and can tip more). Measured on avx512_bf16 over three token sets: max
    # 3.5e-5..2.3e-3, rms 5e-6..7.3e-4; against the reference without the rounding the same
    # logits are 6.7e-3..1.1e-2 max and 5.7e-3..7.5e-3 rms off, so the bounds below (3e-3 max,
    # 1e-3 rms) hold the rounding model and fail without it. Elsewhere float32 order only.
    gemm_in = gemm_input_dtype("bfloat16" if t == "BF16" else "float32")
    ref = ReferenceModel.load(path, gemm_inputs=gemm_in).logits(tokens)
    err = rel_err(got, ref)
    level = _core.kernel_info()["paths"]["gemm_bf16" if t == "BF16" else "gemm_f32"]
    if t in ("F32", "F16", "BF16") and gemm_in == "bfloat16":
        assert err < 3e-3 and rms_err(got, ref) < 1e-3, (level, gemm_in, err, rms_err(got, ref))
    elif t in ("F32", "F16", "BF16"):
        assert err < 1e-4, (level, gemm_in, err)
    else:
        assert err < QUANT_TOL and rms_err(got, ref) < QUANT_RMS_TOL, (err, rms_err(got, ref))
        assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.85


def test_exact_activations_switch(models, tmp_path):
    """activation_dtype="float32" keeps GEMM inputs over bf16 weights exact on every level
    (float32 order only against the float32 reference); "auto" rounds them to bf16 only where
    vdpbf16ps runs. A bad value is a ValueError naming the argument."""
    path = models["llama-bf16-tied"]
    tokens = list(range(3, 40))
    exact = all_logits(path, tokens, activation_dtype="float32")
    assert rel_err(exact, ReferenceModel.load(path).logits(tokens)) < 1e-4
    auto = all_logits(path, tokens)
    ref_auto = ReferenceModel.load(path, gemm_inputs=gemm_input_dtype("bfloat16")).logits(tokens)
    assert rel_err(auto, ref_auto) < 3e-3 and rms_err(auto, ref_auto) < 1e-3  # see test_logits_match_reference
    if gemm_input_dtype("bfloat16") == "float32":  # no vdpbf16ps here: both are the same path
        np.testing.assert_array_equal(auto, exact)
    with pytest.raises(ValueError, match="activation_dtype"):
        LLM(str(path), activation_dtype="bfloat16")
    with pytest.raises(ValueError, match="activation_dtype"):
        ModelRunner(str(path), activation_dtype="half")


def test_plain_c_kernels_give_the_same_model(models):
    """force_scalar (plain C everywhere) vs the SIMD kernels on a quantized model: the dots
    differ by float32 rounding only, which can move an activation across an int8 rounding
    boundary now and then; the logits agree far inside the quantization tolerance."""
    path = models["llama-q4_1-smollm-like"]
    tokens = list(range(3, 40))
    simd = all_logits(path, tokens)
    plain = all_logits(path, tokens, force_scalar=True)
    # An int8 rounding flip moves one activation by one step of its block's scale (~1% of the
    # block's max), so a few flips across 37 tokens give rms differences of a few 1e-3: still a
    # tenth of the quantization tolerance (QUANT_RMS_TOL) the reference comparison allows.
    assert rms_err(plain, simd) < QUANT_RMS_TOL / 6 and (plain.argmax(1) == simd.argmax(1)).mean() >= 0.95


def untied_twin(src, dst) -> Path:
    """GGUF ``src`` with its LM head stored apart: output.weight holds token_embd's bytes, so
    the model is the same but the engine keeps the embedding table and the head separately."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, alignment=r.alignment)
    for k, value in r.metadata.items():
        if k != "general.alignment":
            w.add(k, value, *r.metadata_types[k])
    for name, info in r.tensors.items():
        w.add_tensor_producer(name, info.shape, info.ggml_type, lambda name=name: [r.raw(name).tobytes()])
    e = r.tensors["token_embd.weight"]
    w.add_tensor_producer("output.weight", e.shape, e.ggml_type, lambda: [r.raw("token_embd.weight").tobytes()])
    return w.write()


@pytest.mark.parametrize("gtype,dtype,quantization", [("F32", "float32", None), ("F16", "float16", None),
                                                      ("BF16", "bfloat16", None), ("F32", "bfloat16", None),
                                                      ("Q8_0", "auto", None), ("F32", "float32", "q8_0"),
                                                      ("F32", "float32", "q4_1")])
def test_tied_embedding_is_stored_once(tmp_path, gtype, dtype, quantization):
    """A tied model reads its token embedding from the LM head: no table is kept apart (the
    weights count the embedding once), and every logit equals, bit for bit, the same model
    with the head stored as a separate copy (a table for the lookup, a matrix for the head)."""
    shape = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=272)
    tied = write_gguf_checkpoint(tmp_path / "tied.gguf", shape=shape, ggml_type=gtype, tie_embeddings=True, seed=5)
    twin = untied_twin(tied, tmp_path / "untied.gguf")
    kw = dict(dtype=dtype, quantization=quantization)
    cfgs = {}
    for name, path in (("tied", tied), ("twin", twin)):
        with LLM(str(path), kv_cache_memory="1MiB", num_threads=1, skip_tokenizer_init=True, **kw) as llm:
            cfgs[name] = dict(llm.model_config)
    head = cfgs["tied"]["weight_bytes"] - (cfgs["twin"]["weight_bytes"] - cfgs["twin"]["embed_bytes"])
    assert cfgs["tied"]["embed_bytes"] == 0 and cfgs["twin"]["embed_bytes"] > 0
    assert head == 0  # the tied model holds exactly the twin's weights less its table
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 272, 40)] + [0, 271]
    np.testing.assert_array_equal(all_logits(tied, tokens, **kw), all_logits(twin, tokens, **kw))


def test_checkpoint_config_tensors_and_metadata(models):
    path = models["llama-q4_1-smollm-like"]
    with Checkpoint(path) as ck:
        assert ck.format == "gguf"
        c = ck.config
        assert (c["arch"], c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"]) == \
            ("llama", 96, 256, 3, 3, 1)
        assert c["rope_layout"] == "pairs" and c["tie_embeddings"] and c["vocab_size"] == 320
        tens = ck.tensors()
        assert tens["embed"] == ("q8_0", (320, 96)) and tens["layers.0.wq"] == ("q4_1", (96, 96))
        assert "lm_head" not in tens and tens["final_norm"] == ("float32", (96,))
        md = ck.metadata
        want = GGUFReader(path).metadata
        assert list(md) == list(want)  # every key, in file order
        for k, v in want.items():
            assert md[k] == pytest.approx(v) if isinstance(v, float) else md[k] == v, k
        assert isinstance(md["tokenizer.ggml.tokens"], list) and len(md["tokenizer.ggml.tokens"]) == 320
        # dequantized by the C reader == by NumPy
        np.testing.assert_array_equal(ck.tensor("layers.1.w_up"), GGUFReader(path).tensor("blk.1.ffn_up.weight"))
    with Checkpoint(models["qwen2-tied-f32"]) as ck:
        assert ck.config["rope_layout"] == "halves" and ck.config["qkv_bias"]


def test_metadata_value_types(tmp_path):
    from conveyor.gguf import GGUFValueType as T

    extra = {"x.u8": (200, T.UINT8), "x.i8": (-5, T.INT8), "x.u16": (60000, T.UINT16), "x.i16": (-300, T.INT16),
             "x.i32": (-70000, T.INT32), "x.u64": (2**63 + 5, T.UINT64), "x.i64": (-2**40, T.INT64),
             "x.f64": (0.125, T.FLOAT64), "x.f32": (1.5, T.FLOAT32), "x.bool": (True, T.BOOL), "x.str": "héllo",
             "x.arr_i16": [1, -2, 3], "x.arr_f": [0.5, 2.25], "x.arr_s": ["a", "", "ü"], "x.arr_b": [True, False]}
    path = write_gguf_checkpoint(tmp_path / "m.gguf", shape="tiny", tokenizer=None, extra_metadata=extra)
    md = Checkpoint(path).metadata
    want = GGUFReader(path).metadata
    for k in extra:
        assert md[k] == want[k], k
    assert md["x.u64"] == 2**63 + 5 and md["x.arr_s"] == ["a", "", "ü"] and md["x.bool"] is True
    # the metadata alone (what the tokenizer reads): every key, in file order, the same values
    alone = conveyor._core.gguf_metadata(path)
    assert list(alone) == list(want) and alone == want


def test_metadata_alone_of_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        conveyor._core.gguf_metadata(tmp_path / "nope.gguf")
    with pytest.raises(TypeError):
        conveyor._core.gguf_metadata(3)
    p = tmp_path / "t.gguf"
    p.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(conveyor.ModelFormatError, match="not a GGUF"):
        conveyor._core.gguf_metadata(p)
    good = tiny_gguf()
    for cut in (8, 30, len(good) // 2):
        p.write_bytes(good[:cut])
        with pytest.raises(conveyor.ModelFormatError):
            conveyor._core.gguf_metadata(p)


# ---------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def q41(models):
    return models["llama-q4_1-smollm-like"]


def test_llm_generate_batch_and_preemption_invariant(q41):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, 320, n)] for n in (5, 17, 9, 30, 2)]
    with LLM(str(q41), num_threads=2) as llm:
        alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert together == alone
    with LLM(str(q41), num_threads=2, block_size=4, kv_cache_memory=4 * 4 * 2 * 3 * 32 * 4 * 5,
             max_num_batched_tokens=16, admission_reserve=0) as small:  # no margin: preemption
        got = [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)]
        assert small.stats()["num_preemptions"] > 0
    assert got == alone


def test_quantization_knob_equals_quantized_file(tmp_path):
    """An F32 HF checkpoint quantized at load == the GGUF file quantized by NumPy, bit for bit:
    write_hf_checkpoint and write_gguf_checkpoint draw the same weights, qwen2 GGUF files keep
    HF's row order and RoPE layout, and the C quantizer rounds like conveyor.gguf.quantize."""
    shape = dict(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264)
    hf = write_hf_checkpoint(tmp_path / "hf", shape=shape, arch="qwen2", seed=3, tie_embeddings=False)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 264, 20)]
    for q in ("q8_0", "q4_0", "q4_1"):
        g = write_gguf_checkpoint(tmp_path / f"{q}.gguf", shape=shape, arch="qwen2", seed=3, ggml_type=q.upper(),
                                  tie_embeddings=False)
        a = all_logits(hf, tokens, quantization=q)
        b = all_logits(g, tokens)
        np.testing.assert_array_equal(a, b)
        plain = all_logits(hf, tokens)
        assert rel_err(a, plain) > 1e-4  # the knob really quantized
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(str(hf), quantization="q3_k")


def test_quantization_leaves_a_quantized_files_matrices_alone(tmp_path):
    """quantization= quantizes float matrices only: on a Q4_1 file with a Q8_0 embedding
    (SmolLM2's layout) any choice gives the file's own logits, bit for bit."""
    shape = dict(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264)
    g = write_gguf_checkpoint(tmp_path / "m.gguf", shape=shape, seed=3, ggml_type="Q4_1", embed_type="Q8_0")
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 264, 20)]
    own = all_logits(g, tokens)
    for q in ("q8_0", "q4_0", "q4_1"):
        np.testing.assert_array_equal(all_logits(g, tokens, quantization=q), own)


@pytest.mark.skipif(not (hasattr(conveyor._testing, "cuda_available") and conveyor._testing.cuda_available()),
                    reason="no CUDA device (conveyor._testing.cuda_available() is False)")
def test_cuda_dequantizes_to_bf16_at_load(tmp_path):
    """The CUDA backend keeps quantized weights as bfloat16 (dequantized at load, no activation
    quantization): its first greedy token is the reference's argmax on the dequantized weights."""
    shape = dict(dim=64, hidden_dim=128, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=264)
    p = write_gguf_checkpoint(tmp_path / "m.gguf", shape=shape, ggml_type="Q4_1", embed_type="Q8_0",
                              tie_embeddings=True)
    tokens = [5, 6, 7, 8]
    with LLM(str(p), device="cuda", dtype="float32", skip_tokenizer_init=True) as llm:
        assert llm.model_config["matrix_dtype"] == "bfloat16"
        out = llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)[0]
    ref = ReferenceModel.load(p)
    assert out.outputs[0].token_ids[0] == int(ref.logits(tokens)[-1].argmax())


# ---------------------------------------------------------------------------- bad files


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _u32(key, v):
    return _kv(key, 4, struct.pack("<I", v))


def _str(key, s):
    b = s.encode()
    return _kv(key, 8, struct.pack("<Q", len(b)) + b)


def _f32(key, v):
    return _kv(key, 6, struct.pack("<f", v))


DIM, HID, VOCAB = 32, 64, 40


def _tensors(drop=(), shapes=None, types=None):
    rng = np.random.default_rng(0)
    spec = [("token_embd.weight", (VOCAB, DIM)), ("output_norm.weight", (DIM,)),
            ("blk.0.attn_norm.weight", (DIM,)), ("blk.0.attn_q.weight", (DIM, DIM)),
            ("blk.0.attn_k.weight", (DIM, DIM)), ("blk.0.attn_v.weight", (DIM, DIM)),
            ("blk.0.attn_output.weight", (DIM, DIM)), ("blk.0.ffn_norm.weight", (DIM,)),
            ("blk.0.ffn_gate.weight", (HID, DIM)), ("blk.0.ffn_up.weight", (HID, DIM)),
            ("blk.0.ffn_down.weight", (DIM, HID))]
    out = []
    for name, shp in spec:
        if name in drop:
            continue
        shp = (shapes or {}).get(name, shp)
        out.append((name, shp, (types or {}).get(name, 0), rng.standard_normal(shp).astype(np.float32).tobytes()))
    return out


def _default_kvs(arch="llama"):
    return [_str("general.architecture", arch), _u32(f"{arch}.embedding_length", DIM),
            _u32(f"{arch}.feed_forward_length", HID), _u32(f"{arch}.block_count", 1),
            _u32(f"{arch}.attention.head_count", 2), _u32(f"{arch}.context_length", 64),
            _f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)]


def tiny_gguf(*, magic=b"GGUF", version=3, kvs=None, tensors=None, offsets=None, n_tensors=None, n_kvs=None,
              alignment=32) -> bytes:
    """A one-layer llama GGUF built byte by byte (F32 tensors)."""
    if kvs is None:
        kvs = [_str("general.architecture", "llama"), _u32("llama.embedding_length", DIM),
               _u32("llama.feed_forward_length", HID), _u32("llama.block_count", 1),
               _u32("llama.attention.head_count", 2), _u32("llama.context_length", 64),
               _f32("llama.attention.layer_norm_rms_epsilon", 1e-5)]
    tensors = _tensors() if tensors is None else tensors
    infos, data = b"", b""
    for i, (name, shp, t, raw) in enumerate(tensors):
        off = len(data) if offsets is None or i not in offsets else offsets[i]
        nb = name.encode()
        infos += struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(shp))
        infos += b"".join(struct.pack("<Q", d) for d in reversed(shp)) + struct.pack("<IQ", t, off)
        data += raw + b"\0" * (-len(raw) % alignment)
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kvs is None else n_kvs)
    body = head + b"".join(kvs) + infos
    return body + b"\0" * (-len(body) % alignment) + data


def test_tiny_builder_file_is_valid(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(tiny_gguf())
    ref = ReferenceModel.load(p).logits([1, 2, 3])
    assert rel_err(all_logits(p, [1, 2, 3]), ref) < 1e-4


BAD = [
    ("wrong-magic", dict(magic=b"GGUX"), "not a GGUF file"),
    ("unknown-version", dict(version=7), "unknown GGUF version 7"),
    ("big-endian", dict(version=3 << 24), "big-endian"),
    ("tensor-count-past-end", dict(n_tensors=10**12), "more than"),
    ("kv-count-past-end", dict(n_kvs=10**9), "more than"),
    ("string-longer-than-file", dict(kvs=[_kv("general.architecture", 8, struct.pack("<Q", 10**15) + b"llama")]),
     "claims 1000000000000000 bytes"),
    ("unknown-value-type", dict(kvs=[_kv("general.architecture", 77, b"")]), "unknown value type 77"),
    ("unknown-tensor-type", dict(tensors=_tensors(types={"blk.0.attn_q.weight": 99})), "unknown tensor type 99"),
    ("unsupported-tensor-type", dict(tensors=_tensors(types={"blk.0.attn_q.weight": 16})), "IQ2_XXS"),
    ("k-quant-rows-not-whole-super-blocks", dict(tensors=_tensors(types={"blk.0.attn_q.weight": 12})),
     "'blk.0.attn_q.weight' of type Q4_K has rows of .* not a multiple of the block size 256"),
    ("q2_k-rows-not-whole-super-blocks", dict(tensors=_tensors(types={"blk.0.attn_q.weight": 10})),
     "'blk.0.attn_q.weight' of type Q2_K has rows of .* not a multiple of the block size 256"),
    ("misaligned-data", dict(offsets={3: 4}), "not a multiple of the alignment"),
    ("data-past-end", dict(offsets={3: 1 << 40}), "runs past the end"),
    ("missing-tensor", dict(tensors=_tensors(drop=("blk.0.ffn_up.weight",))), "'blk.0.ffn_up.weight' is missing"),
    ("shape-disagrees", dict(tensors=_tensors(shapes={"blk.0.ffn_gate.weight": (HID + 1, DIM)})),
     "'blk.0.ffn_gate.weight' has shape \\[65, 32\\]"),
    ("missing-metadata", dict(kvs=[_str("general.architecture", "llama")]), "llama.embedding_length"),
    ("duplicate-key", dict(kvs=[_str("general.architecture", "llama")] * 2), "appears twice"),
    ("bad-alignment", dict(kvs=[_u32("general.alignment", 3)]), "general.alignment"),
    ("nested-array", dict(kvs=[_kv("x.a", 9, struct.pack("<IQ", 9, 1))]), "array of arrays"),
    ("unread-arch-key", dict(kvs=_default_kvs() + [_u32("llama.expert_count", 8)]),
     "metadata 'llama.expert_count' is not supported for llama"),
    ("gemma3-window-not-integer", dict(kvs=_default_kvs("gemma3") + [_str("gemma3.attention.sliding_window", "512")]),
     "'gemma3.attention.sliding_window' must be an integer"),
    ("gemma3-missing-qk-norm", dict(kvs=_default_kvs("gemma3")), "tensor 'blk.0.attn_q_norm.weight' is missing"),
]
UNSUPPORTED = ("nested-array", "unsupported-tensor-type", "unread-arch-key")


@pytest.mark.parametrize("name,kw,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_files_raise_clear_errors(tmp_path, name, kw, msg):
    p = tmp_path / f"{name}.gguf"
    p.write_bytes(tiny_gguf(**kw))
    exc = conveyor.UnsupportedError if name in UNSUPPORTED else conveyor.ModelFormatError
    with pytest.raises(exc, match=msg):
        Checkpoint(p)
    with pytest.raises(exc, match=msg):
        LLM(str(p), skip_tokenizer_init=True)


def test_truncated_anywhere_raises(tmp_path):
    good = tiny_gguf()
    p = tmp_path / "t.gguf"
    for cut in (3, 4, 8, 20, 30, 100, 400, len(good) // 2, len(good) - 1):
        p.write_bytes(good[:cut])
        with pytest.raises(conveyor.ModelFormatError, match="truncated|past the end|not a GGUF|more than|claims"):
            Checkpoint(p)


def test_an_error_quoting_bytes_that_are_not_utf8_is_still_the_format_error(tmp_path):
    """A tensor name with a stray byte and a bad dimension count: the error quotes the name
    (the byte replaced), not a UnicodeDecodeError naming neither file nor tensor."""
    good = tiny_gguf()
    name = b"output_norm.weight"
    at = good.find(name)
    assert at > 0
    bad = bytearray(good)
    bad[at + len(name) - 1] = 0x95  # "weigh\x95"
    bad[at + len(name):at + len(name) + 4] = struct.pack("<I", 3943334502)  # its n_dims
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(bad))
    with pytest.raises(conveyor.ModelFormatError, match="bad.gguf: tensor 'output_norm.weigh\ufffd' has 3943334502"):
        Checkpoint(p)


# ---------------------------------------------------------------------------- the real model


def test_smollm2_q4_1_says_paris(smollm2_gguf):
    with Checkpoint(smollm2_gguf) as ck:
        assert ck.tensors()["layers.0.w_gate"][0] == "q4_1" and ck.tensors()["embed"][0] == "q8_0"
    with LLM(str(smollm2_gguf), num_threads=2) as llm:
        prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
        assert "Paris" in out.outputs[0].text


def test_smollm2_logits_match_reference(smollm2_gguf):
    """First-layer-to-logits check on the real file: the C forward vs NumPy on the same
    dequantized weights (the activation-quantization bound above)."""
    tokens = [1, 9690, 198, 2683, 314, 253, 5356, 30]
    got = all_logits(smollm2_gguf, tokens)
    ref = ReferenceModel.load(smollm2_gguf).logits(tokens)
    assert rel_err(got, ref) < QUANT_TOL and rms_err(got, ref) < QUANT_RMS_TOL
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.85


def test_conveyor_info_on_gguf(models, capsys):
    from conveyor.cli import main

    path = models["llama-q4_1-smollm-like"]
    assert main(["info", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "format:          gguf" in out and "architecture:    llama" in out
    assert "tokenizer:       gpt2   chat template: yes" in out
    # per-tensor type and bytes: a [256, 96] Q4_1 matrix is 256 * 3 blocks of 20 bytes
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("layers.0.w_gate "))
    assert "q4_1" in line and "[256, 96]" in line and f"{256 * 3 * 20:,} B" in line
    assert main(["info", str(path), "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    total = sum(r.nbytes for r in GGUFReader(path).tensors.values())
    assert info["weight_bytes"] == total and info["chat_template"] is True and info["tokenizer"] == "gpt2"


@pytest.mark.parametrize("gid,kinds", [("llama-k-mix", {"q5_0", "q4_k", "q5_k", "q6_k", "q8_0"}),
                                      ("qwen2-q2_k-tied", {"q2_k", "float32"})])
def test_conveyor_info_lists_each_tensor_type(models, capsys, gid, kinds):
    """A K-quant mix: each type's tensor count and bytes, summing to the file's tensor bytes."""
    from conveyor.cli import main

    path = models[gid]
    assert main(["info", str(path), "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    want_n, want_b = {}, {}
    for r in GGUFReader(path).tensors.values():
        name = r.ggml_type.name.lower().replace("f32", "float32")
        want_n[name] = want_n.get(name, 0) + 1
        want_b[name] = want_b.get(name, 0) + r.nbytes
    assert info["tensor_dtypes"] == want_n and info["tensor_dtype_bytes"] == want_b
    assert kinds <= set(want_n)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    for name in want_n:
        assert f"{want_n[name]:>5} tensors {want_b[name]:>14,} bytes" in out, name


def test_linear_rope_scaling(tmp_path):
    from conveyor.gguf import GGUFValueType as T

    shape = dict(dim=64, hidden_dim=192, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=264)
    p = write_gguf_checkpoint(tmp_path / "lin.gguf", shape=shape, tokenizer=None,
                              extra_metadata={"llama.rope.scaling.type": "linear",
                                              "llama.rope.scaling.factor": (4.0, T.FLOAT32)})
    plain = write_gguf_checkpoint(tmp_path / "plain.gguf", shape=shape, tokenizer=None)
    tokens = list(range(3, 40))
    got = all_logits(p, tokens)
    assert rel_err(got, ReferenceModel.load(p).logits(tokens)) < 1e-4
    assert rel_err(got, all_logits(plain, tokens)) > 1e-3  # the scaling is applied
    bad = write_gguf_checkpoint(tmp_path / "yarn.gguf", shape=shape, tokenizer=None,
                                extra_metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(conveyor.UnsupportedError, match="rope scaling 'yarn'"):
        Checkpoint(bad)


def test_quantization_knob_on_llama2c(tmp_path):
    """A llama2.c checkpoint quantized at load == the reference run on the same weights
    quantized and dequantized by NumPy (every matrix and the embedding whose rows are a
    multiple of 32; w2 with 160-wide rows is too, the norms stay float)."""
    from conveyor.gguf import dequantize, quantize
    from conveyor.testing import write_llama2c_checkpoint

    shape = dict(dim=64, hidden_dim=160, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300)
    p = write_llama2c_checkpoint(tmp_path / "m.bin", shape=shape, seed=4)
    tokens = [1] + list(range(5, 30))
    plain = ReferenceModel.load(p).logits(tokens)
    for q in ("q8_0", "q4_1"):
        ref = ReferenceModel.load(p)
        w = ref.weights

        def rt(a):
            a = np.asarray(a, np.float32)
            return dequantize(quantize(a, q), q, a.shape).astype(np.float64)

        w["embed"] = rt(w["embed"])
        if w["lm_head"] is not None:
            w["lm_head"] = rt(w["lm_head"])
        for layer in w["layers"]:
            for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                layer[k] = rt(layer[k])
        want = ref.logits(tokens)
        got = all_logits(p, tokens, quantization=q)
        assert rel_err(got, want) < QUANT_TOL and rms_err(got, want) < QUANT_RMS_TOL, q
        if q == "q4_1":  # 4-bit weight rounding dominates: far closer to its own quantized weights
            assert rms_err(got, plain) > 5 * rms_err(got, want)
