"""GGUF files held to HF transformers' own GGUF loader: a second implementation of the
architectures (transformers' Llama/Qwen2/Qwen3/Gemma3 models) and a third of the block
formats (transformers dequantizes with the `gguf` package's NumPy code, not ours).

Runs where the `peers` extra is installed (torch; transformers and gguf come with the test
extra); skips, saying why, without torch or under tools/sanitize.sh (torch is not built
with the sanitizers and its start-up allocations would fill LeakSanitizer's report).

The files are the random-weight GGUFs of tests/test_gguf.py and tests/test_gguf_archs.py
(conveyor.testing, llama.cpp's metadata keys and tensor names, llama's q/k rows permuted as
llama.cpp's converter does, gemma3's norms stored as (1 + w)), loaded with
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)``.

Bounds (max|diff| / max|ref| and rms(diff) / rms(ref) over every position's logits):
  * F32 files: Conveyor with activation_dtype="float32" against transformers' float32 eager
    forward: the same weights and the same float32 arithmetic in another summation order.
    Measured 3.8e-7..2.4e-6 (max); bound 1e-4, as for F32 files against the float64 reference
    in test_gguf.py. A wrong norm offset, RoPE layout, window or scale is 1e-1..1e0.
  * Quantized files: transformers runs float32 on the gguf package's dequantized weights.
    The NumPy reference (conveyor.gguf's dequantizer, float64) agrees with it to 1e-4
    (measured 2.8e-7..1.5e-6: the two dequantizers agree on every block). Conveyor's kernels
    round each activation vector to int8 per block (test_gguf.py's header gives the size of
    that), so Conveyor against transformers has test_gguf.py's quantization bounds (max 9e-2,
    rms 6e-2; measured 0.7-3.3% max, 1.4-2.9% rms) and greedy argmax agreement on >= 85% of
    positions (measured 92-100%).

Where transformers' GGUF loader does not read what the file says, the case passes the
source model's HF config values as from_pretrained keyword arguments (and says so), or skips
with the reason:
  * gemma3: no GGUF key holds HF's query_pre_attn_scalar; transformers keeps
    Gemma3TextConfig's 256 (right for every Gemma 3 but 27B: their head_dim is 256), llama.cpp
    and Conveyor use head_dim. Files with head_dim 256 load as they are; others pass it.
  * gemma3.attention.sliding_window_pattern is not read (transformers keeps every 6th layer
    global): that file is skipped.
  * qwen3: qwen3.attention.key_length is not read (Qwen3Config's head_dim 128, which the
    real Qwen3 models have, stays): files with another head_dim pass it.
  * llama 3.x: rope_freqs.weight (the llama3 RoPE scaling) is not read; the case passes the
    rope_parameters the file's frequencies were computed from.
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

from conveyor.gguf import GGUFReader
from conveyor.gguf import GGUFValueType as T
from conveyor.reference import ReferenceModel, rope_inv_freq
from conveyor.testing import rewrite_gguf, write_gguf_checkpoint

from test_gguf import GRID, MIXED_TYPES, QUANT_RMS_TOL, QUANT_TOL, all_logits, rel_err, rms_err
from test_gguf_archs import CASES as ARCH_CASES

if os.environ.get("CONVEYOR_SANITIZED") == "1":
    pytest.skip("torch is not run under the sanitizers (its own start-up allocations leak)", allow_module_level=True)
try:
    import torch
except ImportError:
    pytest.skip("torch (the 'peers' extra) is not installed: transformers reads GGUF files only with torch",
                allow_module_level=True)
except OSError as e:  # a torch whose install was cut short (a full disk) fails to load its libraries
    pytest.skip(f"torch is installed but does not load: {e}", allow_module_level=True)
pytest.importorskip("gguf", reason="the gguf package (test extra) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (test extra) is not installed")

F32_TOL = 1e-4
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}


def _hf_kwargs(arch, shape, extra):
    """The from_pretrained keyword arguments a file needs (see the module docstring)."""
    hd = shape.get("head_dim") or shape["dim"] // shape["n_heads"]
    if arch == "gemma3" and "gemma3.attention.sliding_window_pattern" in extra:
        return None  # skipped
    if arch == "gemma3" and hd != 256:
        return {"query_pre_attn_scalar": hd}
    if arch == "qwen3" and hd != 128:
        return {"head_dim": hd}
    return {}


# (id, arch, shape, writer kwargs); test_gguf.py's grid and K-mix, test_gguf_archs.py's
# cases, and files shaped as the real models are (gemma3 head_dim 256, qwen3 head_dim 128)
# that transformers loads without help.
FILES = [(gid, arch, shape, dict(ggml_type=t, embed_type=et, tie_embeddings=tied)) for gid, shape, arch, t, et, tied in GRID]
FILES.append(("llama-k-mix", "llama", dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=264),
              dict(ggml_type="Q4_K", embed_type="Q8_0", tie_embeddings=True, tensor_types=MIXED_TYPES)))
FILES.append(("llama-q2_k-mix", "llama", dict(dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264),
              dict(ggml_type="Q2_K", embed_type="Q2_K", tensor_types={"attn_v": "Q4_K", "ffn_down": "Q3_K", "output": "Q6_K"})))
FILES += [(cid, arch, shape, dict(ggml_type=t, embed_type="Q8_0" if t != "F32" else None, tensor_types=types,
                                  tie_embeddings=tied, extra_metadata=extra))
          for cid, arch, shape, t, types, tied, extra in ARCH_CASES]
GEMMA_SHAPE = dict(dim=64, hidden_dim=160, n_layers=6, n_heads=2, n_kv_heads=1, vocab_size=300, head_dim=256)
FILES += [
    ("gemma3-f32-head256-theta1e6", "gemma3", GEMMA_SHAPE,
     dict(tie_embeddings=True, rope_theta=1e6, extra_metadata={"gemma3.attention.sliding_window": (5, T.UINT32)})),
    ("gemma3-q4_k_m-head256", "gemma3", dict(GEMMA_SHAPE, dim=256, hidden_dim=512),
     dict(ggml_type="Q4_K", embed_type="Q8_0", tensor_types=ARCH_CASES[-1][4], tie_embeddings=True, rope_theta=1e6,
          extra_metadata={"gemma3.attention.sliding_window": (6, T.UINT32)})),
    ("qwen3-f32-head128", "qwen3", dict(dim=64, hidden_dim=160, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=300,
                                        head_dim=128), dict(tie_embeddings=False)),
]


TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def hf_logits(path, tokens, **kwargs) -> np.ndarray:
    kwargs = copy.deepcopy(kwargs)  # from_pretrained writes into the dicts it is given
    kwargs["dtype" if TRANSFORMERS_5 else "torch_dtype"] = torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, attn_implementation="eager", **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def check(path, tokens, hf, quantized):
    got = all_logits(path, tokens, activation_dtype="float32")
    if not quantized:
        assert rel_err(got, hf) < F32_TOL, rel_err(got, hf)
        return
    ref = ReferenceModel.load(path).logits(tokens)
    assert rel_err(hf, ref) < F32_TOL, rel_err(hf, ref)  # the gguf package's dequantizer equals ours
    assert rel_err(got, hf) < QUANT_TOL and rms_err(got, hf) < QUANT_RMS_TOL, (rel_err(got, hf), rms_err(got, hf))
    assert (got.argmax(1) == hf.argmax(1)).mean() >= 0.85


@pytest.mark.parametrize("case", FILES, ids=[f[0] for f in FILES])
def test_logits_match_transformers(tmp_path, case):
    fid, arch, shape, kw = case
    kwargs = _hf_kwargs(arch, shape, kw.get("extra_metadata") or {})
    if kwargs is None:
        pytest.skip("transformers' GGUF loader does not read gemma3.attention.sliding_window_pattern "
                    "(it keeps every 6th layer global)")
    path = write_gguf_checkpoint(tmp_path / f"{fid}.gguf", shape=shape, arch=arch, seed=7, **kw)
    tokens = [int(x) for x in np.random.default_rng(3).integers(0, shape["vocab_size"], 37)]
    quantized = any(i.ggml_type.name not in ("F32", "F16", "BF16") for i in GGUFReader(path).tensors.values())
    check(path, tokens, hf_logits(path, tokens, **kwargs), quantized)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    """A Llama 3.x file's rope_freqs.weight (the frequency divisors llama.cpp's converter
    writes) read by Conveyor equals transformers' llama3 RoPE given the rope_parameters
    they came from (its GGUF loader does not read the tensor)."""
    shape = dict(dim=64, hidden_dim=160, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_pos=64)
    plain = write_gguf_checkpoint(tmp_path / "plain.gguf", shape=shape, tokenizer=None)
    hd = shape["dim"] // shape["n_heads"]
    factors = (rope_inv_freq(hd, 10000.0) / rope_inv_freq(hd, 10000.0, LLAMA3_SCALING)).astype(np.float32)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    path = rewrite_gguf(plain, tmp_path / "llama3.gguf", add_tensors={"rope_freqs.weight": factors})
    tokens = list(range(3, 60))
    if TRANSFORMERS_5:
        hf = hf_logits(path, tokens, rope_parameters={**LLAMA3_SCALING, "rope_theta": 10000.0})
    else:  # transformers 4: rope_scaling beside rope_theta
        hf = hf_logits(path, tokens, rope_scaling=dict(LLAMA3_SCALING), rope_theta=10000.0)
    check(path, tokens, hf, quantized=False)
    assert rel_err(all_logits(plain, tokens, activation_dtype="float32"), hf) > 1e-3  # the scaling matters here


# ---------------------------------------------------------------------------- the real files


PROMPT = "The capital of France is Paris. The capital of Germany is Berlin.\ndef fib(n):\n    return n"


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_file_matches_transformers(request, which):
    """The real Q4_1 SmolLM2 and Q4_K_M Gemma 3 files: Conveyor against transformers'
    float32 forward on the gguf package's dequantized weights, to the quantization bounds
    (measured on Gemma 3: 3.9% max, 3.1% rms, every argmax equal). transformers dequantizes
    the whole model to float32 (about 4 GB resident for Gemma 3's 262k-token vocabulary)."""
    from conveyor.tokenizer import load_tokenizer

    path = request.getfixturevalue("smollm2_gguf" if which == "smollm2" else "gemma3_file")
    tokens = load_tokenizer(path).encode(PROMPT)
    got = all_logits(path, tokens, activation_dtype="float32")
    hf = hf_logits(path, tokens)
    assert rel_err(got, hf) < QUANT_TOL and rms_err(got, hf) < QUANT_RMS_TOL, (rel_err(got, hf), rms_err(got, hf))
    assert (got.argmax(1) == hf.argmax(1)).mean() >= 0.85
