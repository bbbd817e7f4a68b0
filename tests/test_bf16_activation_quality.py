"""tools/bf16_activation_quality.py (the measurement behind docs/dev/bf16.md, "bf16
activations: what they cost"): its dequantized copies are the same model as the quantized
original, and the whole script runs end to end on a small Q4_1 GGUF."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from conveyor import _core
from conveyor.gguf import GGMLType, GGUFReader, quantize
from conveyor.reference import ReferenceModel
from conveyor.testing import write_gguf_checkpoint

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bf16_activation_quality.py"
pytestmark = pytest.mark.skipif(not TOOL.is_file(), reason="tools/bf16_activation_quality.py not in this tree")

# every matrix a multiple of 32 wide, so all of them are Q4_1 (none falls back to F32)
SHAPE = dict(dim=64, hidden_dim=192, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_pos=4096,
             tie_embeddings=False)


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("bf16_activation_quality", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("q4")
    return write_gguf_checkpoint(d / "m.Q4_1.gguf", shape=SHAPE, ggml_type="Q4_1", embed_type="Q8_0", seed=3)


@pytest.mark.parametrize("ggml_type", [GGMLType.BF16, GGMLType.F32])
def test_dequantized_copy_is_the_same_model(tool, q4_model, tmp_path, ggml_type):
    dst = tool.write_dequantized_copy(q4_model, tmp_path / f"m.{ggml_type.name}.gguf", ggml_type)
    src, out = GGUFReader(q4_model), GGUFReader(dst)
    # metadata (tokenizer, chat template, arch keys) with its types; only the file type changes
    assert out.metadata_types == src.metadata_types
    assert {k: v for k, v in out.metadata.items() if k != "general.file_type"} == \
        {k: v for k, v in src.metadata.items() if k != "general.file_type"}
    assert out.metadata["general.file_type"] == {GGMLType.BF16: 32, GGMLType.F32: 0}[ggml_type]
    assert list(out.tensors) == list(src.tensors)
    kinds = set()
    for name, info in src.tensors.items():
        got = out.tensors[name]
        assert got.shape == info.shape, name
        if info.ggml_type == GGMLType.F32:  # the norms: copied byte for byte
            assert got.ggml_type == GGMLType.F32 and bytes(out.raw(name)) == bytes(src.raw(name)), name
        else:  # the quantized matrices: their dequantized values, rounded only by the new type
            kinds.add(info.ggml_type)
            assert got.ggml_type == ggml_type, name
            assert bytes(out.raw(name)) == quantize(src.tensor(name), ggml_type).tobytes(), name
    assert kinds == {GGMLType.Q4_1, GGMLType.Q8_0}
    # the float64 reference reads the F32 copy as exactly the original model
    tokens = [5, 17, 200, 3, 99, 411, 8]
    ref = ReferenceModel.load(q4_model).logits(tokens)
    got = ReferenceModel.load(dst).logits(tokens)
    if ggml_type == GGMLType.F32:
        np.testing.assert_array_equal(got, ref)
    else:  # bf16 weights: a relative error of at most 2^-9 per weight
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
        assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.8


def test_the_script_runs_end_to_end(tool, q4_model, tmp_path, capsys):
    out, js = tmp_path / "m.BF16.gguf", tmp_path / "r.json"
    assert tool.main(["--model", str(q4_model), "--out", str(out), "--threads", "1", "--max-tokens", "6",
                      "--json", str(js)]) == 0
    assert out.is_file() and (tmp_path / "m.F32.gguf").is_file()
    printed = capsys.readouterr().out
    path = _core.kernel_info()["paths"]["gemm_bf16"]
    assert f"gemm_bf16 path (what 'auto' runs on bf16 weights): {path}" in printed
    r = json.loads(js.read_text())
    assert r["text"]["tokens"] >= 300 and set(r["text"]["segments"]) == {"prose", "code", "numbers"}
    rows = r["text"]["compare"]
    auto = rows["bf16 activations (auto)"]
    for row in rows.values():
        assert row["kl_mean"] >= 0 and row["kl_max"] >= row["kl_mean"] and 0 <= row["argmax_agree"] <= 1
        assert row["ref"] == auto["ref"] or row["positions"] < auto["positions"]  # the same reference
    g = r["greedy"]
    assert g["prompts"] == len(tool.CHAT_PROMPTS) and 0 <= g["identical"] <= g["prompts"]
    if path != "avx512_bf16":  # no vdpbf16ps: "auto" is the float32 path, bit for bit
        assert auto["kl_max"] == 0 and auto["argmax_agree"] == 1 and g["identical"] == g["prompts"]
    else:  # the rounding is there, and it is small
        assert 0 < auto["kl_mean"] < 1e-2
