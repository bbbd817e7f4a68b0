"""The NumPy reference model: a real model's known output, and the math checked against
hand-written forms (GQA vs MHA, the two RoPE layouts, llama3 scaling, biases, tying)."""
import copy
import math

import numpy as np
import pytest

import conveyor
from conveyor.reference import ReferenceModel, rope_inv_freq
from conveyor.testing import write_hf_checkpoint
from conveyor.tokenizer import load_tokenizer

KNOWN = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")


@pytest.fixture(scope="module")
def stories(stories_dir):
    return ReferenceModel.load(stories_dir / "stories260K.bin")


def test_stories260k_known_output(stories, stories_dir):
    c = stories.config
    assert (c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"], c["vocab_size"],
            c["max_pos"]) == (64, 172, 5, 8, 4, 512, 512)
    assert c["tie_embeddings"] and c["rope_layout"] == "pairs"
    tok = load_tokenizer(stories_dir / "stories260K.bin")
    out = stories.greedy([1], 199)  # 200 positions, BOS at position 0
    assert len(out) == 199
    text = tok.decode([1] + out)
    assert text.startswith(KNOWN), text[:200]


def test_greedy_matches_full_recompute(stories):
    prompt = [1, 403, 407, 261]
    out = stories.greedy(prompt, 12)
    seq = list(prompt)
    for tok in out:
        assert tok == int(np.argmax(stories.logits(seq)[-1]))
        seq.append(tok)
    stop = out[3]
    assert stories.greedy(prompt, 12, stop_ids=[stop]) == out[:out.index(stop) + 1]


@pytest.mark.parametrize("which", ["stories", "hf", "llama2c"])
def test_logits_are_causal(which, stories, tiny_hf_dir, tiny_llama2c_path):
    model = {"stories": stories, "hf": None, "llama2c": None}[which] or ReferenceModel.load(
        tiny_hf_dir if which == "hf" else tiny_llama2c_path)
    toks = list(np.random.default_rng(1).integers(0, model.vocab_size, 24))
    full = model.logits(toks)
    assert full.shape == (24, model.vocab_size) and full.dtype == np.float64
    for k in (1, 7, 23):
        np.testing.assert_allclose(model.logits(toks[:k]), full[:k], rtol=1e-10, atol=1e-10)
    # changing a later token changes later rows only
    other = toks[:10] + [(toks[10] + 1) % model.vocab_size] + toks[11:]
    changed = model.logits(other)
    np.testing.assert_allclose(changed[:10], full[:10], rtol=1e-10, atol=1e-10)
    assert not np.allclose(changed[10:], full[10:])


def _as_mha(model: ReferenceModel) -> ReferenceModel:
    """The same model with every kv head copied to the query heads it serves."""
    c = dict(model.config)
    group = c["n_heads"] // c["n_kv_heads"]
    hd = c["head_dim"]
    w = copy.deepcopy(model.weights)
    for L in w["layers"]:
        for key in ("wk", "wv", "bk", "bv"):
            if L.get(key) is not None:
                heads = L[key].reshape(c["n_kv_heads"], hd, *L[key].shape[1:])
                L[key] = np.repeat(heads, group, axis=0).reshape(c["n_heads"] * hd, *L[key].shape[1:])
    c["n_kv_heads"] = c["n_heads"]
    return ReferenceModel(c, w)


def test_gqa_equals_expanded_mha(stories, tiny_hf_dir, tmp_path):
    qwen = ReferenceModel.load(write_hf_checkpoint(tmp_path / "q", arch="qwen2", tokenizer=False))
    for model in (stories, ReferenceModel.load(tiny_hf_dir), qwen):
        assert model.config["n_kv_heads"] < model.config["n_heads"]
        toks = [1, 5, 300, 42, 7, 99, 100, 3]
        np.testing.assert_allclose(_as_mha(model).logits(toks), model.logits(toks), rtol=1e-10, atol=1e-10)


def test_rope_layouts_agree_after_permuting_rows(stories):
    """RoPE on adjacent pairs equals RoPE on halves once each head's q/k rows are reordered
    (even rows first, then odd rows), the conversion between llama2.c and HF checkpoints."""
    c = dict(stories.config)
    hd = c["head_dim"]
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    w = copy.deepcopy(stories.weights)
    for L in w["layers"]:
        for key, heads in (("wq", c["n_heads"]), ("wk", c["n_kv_heads"])):
            L[key] = L[key].reshape(heads, hd, -1)[:, perm, :].reshape(heads * hd, -1)
    c["rope_layout"] = "halves"
    halves = ReferenceModel(c, w)
    toks = [1, 403, 407, 261, 378, 432, 383, 286]
    np.testing.assert_allclose(halves.logits(toks), stories.logits(toks), rtol=1e-9, atol=1e-9)
    c2 = dict(stories.config, rope_layout="halves")  # without the permutation: different
    assert not np.allclose(ReferenceModel(c2, stories.weights).logits(toks)[1:], stories.logits(toks)[1:])


def test_single_token_by_hand(tiny_hf_dir):
    """At position 0 RoPE is the identity and attention returns v: the whole forward pass
    written out for one token."""
    m = ReferenceModel.load(tiny_hf_dir)
    c, W = m.config, m.weights
    tok = 77
    group = c["n_heads"] // c["n_kv_heads"]
    hd = c["head_dim"]

    def norm(x, w):
        return x / math.sqrt(float(np.mean(x * x)) + c["rms_eps"]) * w

    x = W["embed"][tok].copy()
    for L in W["layers"]:
        v = L["wv"] @ norm(x, L["attn_norm"])
        att = np.concatenate([v[(h // group) * hd:(h // group + 1) * hd] for h in range(c["n_heads"])])
        x = x + L["wo"] @ att
        h = norm(x, L["ffn_norm"])
        g = L["w_gate"] @ h
        x = x + L["w_down"] @ (g / (1 + np.exp(-g)) * (L["w_up"] @ h))
    expected = W["lm_head"] @ norm(x, W["final_norm"])
    np.testing.assert_allclose(m.logits([tok])[0], expected, rtol=1e-10, atol=1e-10)


def test_llama3_rope_scaling_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
    base = rope_inv_freq(16, 10000.0)
    scaled = rope_inv_freq(16, 10000.0, scaling)
    np.testing.assert_allclose(base, 10000.0 ** (-np.arange(0, 16, 2) / 16))
    wavelen = 2 * np.pi / base
    high = wavelen < 512 / 4
    low = wavelen > 512 / 1
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8)
    # in between: a blend that moves from f/8 (long waves) to f (short waves)
    assert np.all(scaled[mid] > base[mid] / 8) and np.all(scaled[mid] < base[mid])
    smooth = (512 / wavelen[mid] - 1) / (4 - 1)
    np.testing.assert_allclose(scaled[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid])
    assert np.all(np.diff(scaled) < 0)
    with pytest.raises(conveyor.UnsupportedError):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_rope_scaling_and_theta_change_logits(tmp_path):
    plain = ReferenceModel.load(write_hf_checkpoint(tmp_path / "a", tokenizer=False))
    scaled = ReferenceModel.load(write_hf_checkpoint(tmp_path / "b", rope_scaling="llama3", tokenizer=False))
    theta = ReferenceModel.load(write_hf_checkpoint(tmp_path / "c", rope_theta=500000.0, tokenizer=False))
    assert scaled.config["rope_scaling"]["rope_type"] == "llama3"
    toks = [0, 10, 20, 30, 40, 50]
    a, b, t = plain.logits(toks), scaled.logits(toks), theta.logits(toks)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-12)  # position 0: no rotation at all
    np.testing.assert_allclose(t[0], a[0], rtol=1e-12)
    assert not np.allclose(b[1:], a[1:]) and not np.allclose(t[1:], a[1:])


def test_qwen2_biases_are_used(tmp_path):
    m = ReferenceModel.load(write_hf_checkpoint(tmp_path / "q", arch="qwen2", tokenizer=False))
    assert m.config["qkv_bias"] and m.weights["layers"][0]["bq"] is not None
    w = copy.deepcopy(m.weights)
    for L in w["layers"]:
        L["bq"] = L["bk"] = L["bv"] = None
    no_bias = ReferenceModel(m.config, w)
    toks = [0, 3, 9, 27]
    assert not np.allclose(no_bias.logits(toks), m.logits(toks))
    w2 = copy.deepcopy(w)
    for L in w2["layers"]:
        L["bq"] = np.zeros(m.config["n_heads"] * m.config["head_dim"])
        L["bk"] = L["bv"] = np.zeros(m.config["n_kv_heads"] * m.config["head_dim"])
    np.testing.assert_allclose(ReferenceModel(m.config, w2).logits(toks), no_bias.logits(toks), rtol=1e-12)


def test_tied_equals_untied_copy(tiny_llama2c_path):
    m = ReferenceModel.load(tiny_llama2c_path)
    assert m.config["tie_embeddings"] and m.weights["lm_head"] is None
    w = dict(m.weights, lm_head=m.weights["embed"].copy())
    untied = ReferenceModel(dict(m.config, tie_embeddings=False), w)
    np.testing.assert_array_equal(untied.logits([1, 2, 3]), m.logits([1, 2, 3]))


def test_errors(tmp_path, tiny_llama2c_path, stories):
    with pytest.raises(FileNotFoundError):
        ReferenceModel.load(tmp_path / "missing")
    truncated = tmp_path / "t.bin"
    truncated.write_bytes(tiny_llama2c_path.read_bytes()[:-4])
    with pytest.raises(conveyor.ModelFormatError):
        ReferenceModel.load(truncated)
    with pytest.raises(ValueError):
        stories.logits([1, 512])
    with pytest.raises(ValueError):
        stories.greedy([], 3)
    d = write_hf_checkpoint(tmp_path / "h", tokenizer=False)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-8])
    with pytest.raises(conveyor.ModelFormatError):
        ReferenceModel.load(d)
