"""The gemma3 and qwen3 GGUF architectures and llama 3.x RoPE scaling, held to the NumPy
reference (conveyor.reference reads the same file with its own reader and runs float64).

* Random-weight files written by conveyor.testing with llama.cpp's metadata keys and tensor
  names: F32 files agree to 1e-4 (float32 kernels against float64); K-quant mixes to the
  quantization tolerance of tests/test_gguf.py.
* Gemma 3's sliding window: windows shorter than the prompt, with the default layer pattern
  (every 6th layer global) and with the pattern key; one-pass prefill, decode steps over
  paged blocks and chunked prefill all give the reference's greedy tokens.
* Every "<arch>." key is read or refused by name.
* The real Gemma 3 270M Q4_K_M file (the built-in name "gemma-3-270m"; skipped, saying why, when it is
  not in the cache): greedy answers name Paris and Berlin, batch and preemption invariance,
  and tokenizer ids equal transformers' tokenizer built from the same file where that works.
"""
from __future__ import annotations

import numpy as np
import pytest

import conveyor
from conveyor import LLM, SamplingParams
from conveyor._core import Checkpoint
from conveyor.gguf import GGUFValueType as T
from conveyor.reference import ReferenceModel, rope_inv_freq
from conveyor.testing import rewrite_gguf, write_gguf_checkpoint

from test_gguf import QUANT_RMS_TOL, QUANT_TOL, all_logits, rel_err, rms_err

SHAPE = dict(dim=64, hidden_dim=160, n_layers=6, n_heads=4, n_kv_heads=1, vocab_size=300, head_dim=32)
K_SHAPE = dict(dim=256, hidden_dim=512, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=300, head_dim=64)
GEMMA_MIX = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
             "ffn_up": "Q5_0", "ffn_down": "Q6_K"}  # the real file's kinds


def window(n):
    return {"gemma3.attention.sliding_window": (n, T.UINT32)}


CASES = [  # (id, arch, shape, ggml_type, tensor_types, tied, extra metadata)
    ("qwen3-f32", "qwen3", SHAPE, "F32", None, False, {}),
    ("qwen3-q4_k-tied", "qwen3", K_SHAPE, "Q4_K", None, True, {}),
    ("gemma3-f32-window5", "gemma3", SHAPE, "F32", None, True, window(5)),
    ("gemma3-f32-window7-pattern2", "gemma3", SHAPE, "F32", None, True,
     {**window(7), "gemma3.attention.sliding_window_pattern": (2, T.UINT32)}),
    ("gemma3-f32-no-window", "gemma3", SHAPE, "F32", None, True, {}),
    ("gemma3-q4_k_m-mix", "gemma3", K_SHAPE, "Q4_K", GEMMA_MIX, True, window(6)),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("archs")
    out = {}
    for i, (cid, arch, shape, t, types, tied, extra) in enumerate(CASES):
        out[cid] = write_gguf_checkpoint(d / f"{cid}.gguf", shape=shape, arch=arch, ggml_type=t,
                                         embed_type="Q8_0" if t != "F32" else None, tensor_types=types,
                                         tie_embeddings=tied, extra_metadata=extra, seed=i)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_logits_match_reference(files, case):
    cid, arch, shape, t = case[:4]
    tokens = [int(x) for x in np.random.default_rng(3).integers(0, shape["vocab_size"], 37)]
    got = all_logits(files[cid], tokens)
    ref = ReferenceModel.load(files[cid]).logits(tokens)
    if t == "F32":
        assert rel_err(got, ref) < 1e-4, rel_err(got, ref)
    else:
        assert rel_err(got, ref) < QUANT_TOL and rms_err(got, ref) < QUANT_RMS_TOL
        assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.85


def test_config_of_the_architectures(files):
    g = Checkpoint(files["gemma3-f32-window5"]).config
    assert g["arch"] == "gemma3" and g["qk_norm"] and g["sliding_window"] == 5 and not g["qkv_bias"]
    q = Checkpoint(files["qwen3-f32"]).config
    assert q["arch"] == "qwen3" and q["qk_norm"] and q["sliding_window"] == 0 and not q["qkv_bias"]


def test_the_window_is_applied(files):
    """The windowed file's logits differ from the same weights attended in full (the
    reference with the window off), past the window only."""
    p = files["gemma3-f32-window5"]
    tokens = list(range(3, 40))
    got = all_logits(p, tokens)
    full = ReferenceModel.load(p)
    full.config["sliding_window"] = 0
    ref_full = full.logits(tokens)
    assert rel_err(got[:5], ref_full[:5]) < 1e-4   # within the first window: no difference
    assert rel_err(got[6:], ref_full[6:]) > 1e-2   # past it: the local layers see fewer keys


@pytest.mark.parametrize("cid", ["gemma3-f32-window5", "qwen3-f32"])
def test_generation_through_the_engine_equals_reference(files, cid):
    """Decode steps over small paged blocks (block_size 4, so the window spans blocks),
    chunked prefill (16-token budget) and a batch: every path gives the reference's greedy
    continuation."""
    p = files[cid]
    ref = ReferenceModel.load(p)
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(3, 300, n)] for n in (3, 11, 23)]
    want = [ref.greedy(pr, 14) for pr in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    with LLM(str(p), num_threads=2, block_size=4, max_num_batched_tokens=16) as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        alone = [llm.generate([pr], greedy, use_tqdm=False)[0].outputs[0].token_ids for pr in prompts]
    assert together == alone == want


def test_llama3_rope_freqs_match_hf_scaling(tmp_path):
    """A Llama 3.x GGUF carries its RoPE scaling as rope_freqs.weight (llama.cpp's converter
    writes 1 / the factor each frequency is scaled by): the model equals the reference run
    with HF's rope_scaling {"rope_type": "llama3"} on the plain file's weights."""
    shape = dict(dim=64, hidden_dim=160, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_pos=64)
    plain = write_gguf_checkpoint(tmp_path / "plain.gguf", shape=shape, tokenizer=None)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    hd = 16
    base = rope_inv_freq(hd, 10000.0)
    factors = (base / rope_inv_freq(hd, 10000.0, scaling)).astype(np.float32)  # divisors
    # kept, blended and slowed frequencies are all in play
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    p = rewrite_gguf(plain, tmp_path / "llama3.gguf", add_tensors={"rope_freqs.weight": factors})
    tokens = list(range(3, 60))
    got = all_logits(p, tokens)
    hf = ReferenceModel.load(plain)
    hf.inv_freq = rope_inv_freq(hd, 10000.0, scaling)
    assert rel_err(got, hf.logits(tokens)) < 1e-4
    assert rel_err(got, ReferenceModel.load(p).logits(tokens)) < 1e-4
    assert rel_err(got, all_logits(plain, tokens)) > 1e-3  # the scaling is applied


@pytest.mark.parametrize("arch,key,value", [
    ("gemma3", "gemma3.final_logit_softcapping", (30.0, T.FLOAT32)),
    ("gemma3", "gemma3.attention.layer_norm_epsilon", (1e-6, T.FLOAT32)),
    ("qwen3", "qwen3.expert_count", (8, T.UINT32)),
    ("llama", "llama.attention.sliding_window", (4, T.UINT32)),
])
def test_unknown_architecture_keys_are_refused_by_name(tmp_path, arch, key, value):
    p = write_gguf_checkpoint(tmp_path / "m.gguf", shape=SHAPE, arch=arch, tokenizer=None,
                              extra_metadata={key: value})
    with pytest.raises(conveyor.UnsupportedError, match=f"metadata '{key}' is not supported for {arch}"):
        Checkpoint(p)


def test_rope_freqs_on_another_arch_is_refused(tmp_path):
    from conveyor.gguf import GGUFReader, GGUFWriter

    plain = write_gguf_checkpoint(tmp_path / "q.gguf", shape=SHAPE, arch="qwen3", tokenizer=None)
    r = GGUFReader(plain)
    w = GGUFWriter(tmp_path / "bad.gguf")
    for k, v in r.metadata.items():
        w.add(k, v)
    for name, info in r.tensors.items():
        w.add_tensor_producer(name, info.shape, info.ggml_type, lambda name=name: [r.raw(name).tobytes()])
    w.add_tensor("rope_freqs.weight", np.ones(16, np.float32))
    with pytest.raises(conveyor.UnsupportedError, match="rope_freqs.weight"):
        Checkpoint(w.write())


# ---------------------------------------------------------------------------- the real file


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_file):
    with LLM(str(gemma3_file), num_threads=2, max_model_len=512) as llm:
        yield llm


def test_real_gemma3_answers(gemma3_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["Question: What is the capital of France?\nAnswer:", "The capital of Germany is the city of",
               "Paris is the capital of"]
    outs = [o.outputs[0].text for o in gemma3_llm.generate(prompts, greedy, use_tqdm=False)]
    assert "Paris" in outs[0], outs
    assert "Berlin" in outs[1], outs
    assert "France" in outs[2], outs


def test_real_gemma3_batch_and_preemption_invariance(gemma3_file, gemma3_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fib(n):"]
    alone = [gemma3_llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in gemma3_llm.generate(prompts, greedy, use_tqdm=False)]
    assert together == alone
    # a cache of 12 blocks of 4 tokens cannot hold the four sequences at once: preemption
    kv = 12 * 4 * 18 * 2 * 256 * 2  # blocks * block_size * layers * (k, v) * kv_dim * bfloat16 (the default)
    with LLM(str(gemma3_file), num_threads=2, max_model_len=32, block_size=4, kv_cache_memory=kv,
             admission_reserve=0) as small:
        tight = [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)]
    assert tight == alone


TOKENIZER_TEXTS = ["The capital of France is", "digits 1234567890 and 3.14159", "emoji 😀🎉👍🏽 ok", "   ", "\n\n\n",
                   "CJK 你好，世界 日本語のテキスト 한국어", "def f(x):\n    return x ** 2  # code\n",
                   "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "  two spaces\tand tab",
                   "Ünïcödé çàfé naïve", "a" * 40]


def test_real_gemma3_tokenizer(gemma3_file):
    from conveyor.tokenizer import load_tokenizer

    tok = load_tokenizer(gemma3_file)
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert ids[:3] == [2, 105, 2364] and 106 in ids  # <bos>, the turn markers as single ids
    for text in TOKENIZER_TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False).replace("<bos>", "", 1) == text
    hf = _transformers_gguf_tokenizer(gemma3_file)
    for text in TOKENIZER_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == hf(text), text


def _transformers_gguf_tokenizer(path):
    """transformers' tokenizer built from the GGUF: AutoTokenizer(gguf_file=...) where it
    works; without torch (its GGUF reader imports it) the same converter,
    convert_gguf_tokenizer, fed the file's tokenizer metadata through conveyor.gguf's reader.
    Returns text -> ids (no special tokens added); skips when transformers has neither."""
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return lambda text: hf.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 (no transformers, or no torch for its GGUF reader)
        pass
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as m
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"transformers cannot build a tokenizer from a GGUF here: {type(e).__name__}: {e}")
    from conveyor.gguf import read_gguf_metadata

    md = read_gguf_metadata(path)
    grouped = {group: {name: md[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in md}
               for group, renames in m.GGUF_TOKENIZER_MAPPING.items()}
    hf, _ = m.convert_gguf_tokenizer(md["general.architecture"], grouped["tokenizer"])
    return lambda text: hf.encode(text, add_special_tokens=False).ids
