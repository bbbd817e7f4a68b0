"""End to end on the default model, SmolLM2-135M-Instruct (Q4_1 GGUF): the C engine and
the NumPy reference (Python GGUF reader and dequantizer, written independently of the C
loader) both answer a factual question, and agree. Skips when the file is not here (CI
fetches it with `python -m conveyor.default_model` before the tests)."""
import os

import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
N_NEW = 16


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    from conveyor.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def reference_answer(smollm2_gguf, tok):
    """Greedy token ids of the NumPy reference (float64, dequantized weights)."""
    from conveyor.reference import ReferenceModel

    ref = ReferenceModel.load(smollm2_gguf)
    ids = tok.encode(tok.apply_chat_template(QUESTION), add_special_tokens=False)
    return ref.greedy(ids, N_NEW, stop_ids=tok.eos_ids)


def test_reference_answers_paris(reference_answer, tok):
    """The whole Python side on the real model, independent of C: GGUF reader, Q4_1/Q8_0
    dequantization, llama q/k layout (pairs RoPE), tokenizer and chat template."""
    assert "Paris" in tok.decode(reference_answer)
    assert reference_answer[-1] in tok.eos_ids  # a short answer that ends with <|im_end|>


def test_engine_answers_paris_like_the_reference(smollm2_gguf, reference_answer, tok):
    from conveyor import LLM, SamplingParams

    llm = LLM(str(smollm2_gguf), kv_cache_memory="128MiB", max_model_len=512)
    try:
        out = llm.chat(QUESTION, SamplingParams(max_tokens=N_NEW, temperature=0), use_tqdm=False)[0].outputs[0]
    finally:
        llm.close()
    assert "Paris" in out.text and out.finish_reason == "stop"
    # quantized kernels vs float64 NumPy: the confident opening tokens agree exactly
    assert out.token_ids[:4] == reference_answer[:4]


def test_c_metadata_matches_python_reader(smollm2_gguf, tok):
    """conveyor._core.Checkpoint.metadata (the C reader) equals conveyor.gguf's, and the
    tokenizer builds the same from either."""
    from conveyor import _core
    from conveyor.gguf import GGUFReader
    from conveyor.tokenizer import GGUFTokenizer

    with _core.Checkpoint(str(smollm2_gguf)) as ck:
        c_meta = ck.metadata
    py_meta = GGUFReader(smollm2_gguf).metadata
    assert c_meta == py_meta
    text = "<|im_start|>user\nHéllo  wörld 123!<|im_end|>\n"
    assert GGUFTokenizer(c_meta).encode(text) == tok.encode(text)


def test_generate_command_uses_the_default_model(smollm2_gguf, capsys):
    """`conveyor generate` without --model runs SmolLM2 and chats through its template."""
    from conveyor import generate

    assert generate.main(["--prompt", QUESTION[0]["content"], "--max-tokens", str(N_NEW)]) == 0
    out = capsys.readouterr().out
    assert f"model: {smollm2_gguf}" in out
    assert "Paris" in out


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    """transformers' own tokenizer built from the same GGUF file (its converter, not ours);
    needs torch and the gguf package (CI's peers step installs torch)."""
    if os.environ.get("CONVEYOR_SANITIZED") == "1":
        pytest.skip("torch is not run under the sanitizers (its own start-up leaks)")
    pytest.importorskip("torch", reason="transformers reads GGUF files only with torch installed")
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


TOKENIZER_TEXTS = [
    "The cat sat on the mat.", "  two leading spaces\n\nand blank lines\t\ttabs  ",
    "Numbers 1234567, 3.14159 and 2026-12-03", "emoji 🙂🚀, accents héllo wörld, 中文字符, ελληνικά",
    "don't won't I'm you'll they've", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment", "a" * 300, "",
]


@pytest.mark.parametrize("text", TOKENIZER_TEXTS, ids=range(len(TOKENIZER_TEXTS)))
def test_tokenizer_matches_transformers_reading_the_same_gguf(hf_tokenizer, tok, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
