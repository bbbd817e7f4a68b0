"""The two C extensions: conveyor._core is the product (engine, checkpoints,
errors, request and sampling params, GGUF metadata, kernel_info) and
conveyor._testing holds the test and benchmark hooks of the C parts; an error
raised by either is one of conveyor's own exception classes."""
import subprocess
import sys

import pytest

import conveyor
from conveyor import _core, _testing

# the hooks that moved out of the product module
HOOKS = ["kernel_gemm", "kernel_matrix", "kernel_matmul", "kernel_matmul_time", "kernel_rmsnorm", "kernel_rope",
         "kernel_swiglu", "kernel_embedding", "kernel_kv_write", "kernel_paged_attention", "kernel_triad",
         "kernel_read_bw", "measure_peak", "kernel_quantize", "kernel_dequantize", "kernel_qgemm", "kernel_qlevels",
         "cuda_available", "cuda_check", "cuda_info", "cuda_kernel_gemm", "sample", "process_logits", "rng_uint64",
         "stop_find", "stop_holdback", "Scheduler", "ModelRunner", "gguf_score_merges"]
PRODUCT = ["Engine", "Checkpoint", "check_sampling_params", "gguf_metadata", "kernel_info", "kv_bytes_per_token",
           "simd", "SpmTokenizer"]
ERRORS = ["ConveyorError", "ModelFormatError", "UnsupportedError", "EngineClosedError", "EngineOverloadedError"]


def test_the_product_module_holds_no_test_hook():
    assert [h for h in HOOKS if hasattr(_core, h)] == []
    assert [h for h in HOOKS if not hasattr(_testing, h)] == []
    assert [p for p in PRODUCT if not hasattr(_core, p)] == []


def test_both_modules_offer_the_same_exception_classes():
    for name in ERRORS:
        assert getattr(_testing, name) is getattr(_core, name) is getattr(conveyor, name), name


def test_an_error_from_either_module_is_caught_as_conveyors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 40)  # counts larger than the file
    for make in (_core.Checkpoint, _testing.ModelRunner):
        with pytest.raises(conveyor.ModelFormatError, match="bad.gguf"):
            make(str(bad))


def test_a_hook_error_is_caught_as_conveyors_without_a_gpu():
    if _testing.cuda_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(conveyor.UnsupportedError, match="CUDA"):
        _testing.cuda_check()


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_package_does_not_load_the_hooks():
    """Not on import, nor when a GGUF "llama" vocabulary's encoder is built (its merge
    list, the tests' reference, is a hook)."""
    r = _run("import sys, conveyor\n"
             "from conveyor import LLM, SamplingParams, ModelFormatError\n"
             "import conveyor.engine, conveyor.tokenizer\n"
             "tok = conveyor.tokenizer.GGUFTokenizer({'tokenizer.ggml.model': 'llama',\n"
             "    'tokenizer.ggml.tokens': ['<unk>', '\u2581', 'a', '\u2581a'],\n"
             "    'tokenizer.ggml.scores': [0, 0, 0, 1]})\n"
             "assert tok.encode('a', add_special_tokens=False) == [3], tok.encode('a')\n"
             "print('conveyor._testing' in sys.modules)\n")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_the_hooks_load_first_and_still_raise_conveyors_errors(tmp_path):
    """Imported before anything else, conveyor._testing loads conveyor._core
    itself, and the classes it raises are the package's."""
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00" * 3)  # shorter than a llama2.c header
    r = _run("from conveyor import _testing\n"
             "import conveyor\n"
             "try:\n"
             f"    _testing.ModelRunner({str(bad)!r})\n"
             "except conveyor.ConveyorError as e:\n"
             "    print(type(e).__name__)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ModelFormatError"
