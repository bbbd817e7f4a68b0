"""The catalogue of bad inputs (docs/reliability.md holds the same list as a table).

Every bad input gets a specific exception (or HTTP error) whose message names
the problem, and the engine goes on serving: after each bad input a good request
is run and must succeed, with no request left queued and no KV block held.

Cases marked `known_bug` are strict xfails: the catalogue states what the answer
should be, the engine does not give it yet; when it is
fixed the xfail turns into a failure and the marker must be removed.

    python tests/test_bad_inputs.py     prints the catalogue as a Markdown table
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest

import conveyor
from conveyor import AsyncLLM, LLM, SamplingParams
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
needs_stories = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} not found")
pytestmark = needs_stories

MFE = conveyor.ModelFormatError
UNS = conveyor.UnsupportedError
GOOD_PROMPT = "Once upon a time"
GOOD = SamplingParams(temperature=0.0, max_tokens=6)


@dataclass
class Case:
    id: str
    what: str                  # the input, in words (the doc table's "input" column)
    exc: Any                   # exception type(s), or an HTTP status for HTTP cases
    match: str                 # regex the message must match (names the problem)
    arg: Any = None            # case data, read by the test that runs it
    bug: Optional[str] = None  # a known bug: the case is a strict xfail until fixed

    def param(self):
        marks = [pytest.mark.xfail(strict=True, reason=f"known bug: {self.bug}")] if self.bug else []
        return pytest.param(self, id=self.id, marks=marks)


def _exc_name(exc) -> str:
    if isinstance(exc, int):
        return f"HTTP {exc}"
    if isinstance(exc, tuple):
        return " or ".join(e.__name__ for e in exc)
    return exc.__name__


# ============================================================================ fixtures


@pytest.fixture(scope="module")
def llm():
    with LLM(str(STORIES), num_threads=1) as m:
        yield m


def assert_serves(m: LLM):
    """The engine goes on: a good request succeeds and nothing is left behind."""
    out = m.generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].finish_reason in ("stop", "length")
    assert len(out.outputs[0].token_ids) > 0
    st = m.stats()
    assert st["blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
    assert m.num_unfinished() == 0


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


# ============================================================================ model files

def _l2c_field(i: int, value: int):
    def mutate(model: Path, tok: Path):
        b = bytearray(model.read_bytes())
        struct.pack_into("<i", b, 4 * i, value)
        model.write_bytes(bytes(b))
    return mutate


def _l2c_truncate(model: Path, tok: Path):
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])


def _tok_record_len(model: Path, tok: Path):
    b = bytearray(tok.read_bytes())
    struct.pack_into("<i", b, 4 + 4, -7)  # the first record's length
    tok.write_bytes(bytes(b))


def _tok_few_tokens(model: Path, tok: Path):
    # header vocab 200: the tokenizer reads 200 records, fewer than llama2.c's 259
    _l2c_field(5, 200)(model, tok)


L2C_CASES = [
    Case("l2c-empty", "llama2.c .bin of 0 bytes", MFE, r"model\.bin: (file is empty|too short for a llama2\.c header)",
         lambda m, t: m.write_bytes(b"")),
    Case("l2c-truncated", "llama2.c .bin cut in half", MFE, r"model\.bin: truncated: .* needs \d+ bytes",
         _l2c_truncate),
    Case("l2c-negative-dim", "header dim = -5", MFE, r"dim is -5, must be positive", _l2c_field(0, -5)),
    Case("l2c-zero-layers", "header n_layers = 0", MFE, r"n_layers is 0", _l2c_field(2, 0)),
    Case("l2c-huge-layers", "header n_layers = 2^31-1 (size overflow bait)", MFE,
         r"truncated: .*n_layers=2147483647.* needs \d+ bytes", _l2c_field(2, 2**31 - 1)),
    Case("l2c-heads-not-multiple", "n_heads = 7 with n_kv_heads = 2", MFE,
         r"n_heads=7 is not a multiple of n_kv_heads=2", _l2c_field(3, 7)),
    Case("l2c-vocab-zero", "header vocab_size = 0", MFE, r"vocab_size is 0", _l2c_field(5, 0)),
    Case("l2c-int-min-vocab", "header vocab_size = INT32_MIN", MFE, r"vocab_size|truncated",
         _l2c_field(5, -2**31)),
    Case("l2c-seq-len-negative", "header seq_len = -1", MFE, r"seq_len is -1", _l2c_field(6, -1)),
    Case("l2c-no-tokenizer", "no tokenizer.bin / tok*.bin beside the .bin", FileNotFoundError,
         r"no llama2\.c tokenizer beside", lambda m, t: t.unlink()),
    Case("tok-too-short", "tokenizer.bin of 2 bytes", MFE, r"tokenizer\.bin: tokenizer file is too short",
         lambda m, t: t.write_bytes(b"\x01\x00")),
    Case("tok-truncated", "tokenizer.bin cut at 100 bytes", MFE, r"tokenizer\.bin: truncated at token",
         lambda m, t: t.write_bytes(t.read_bytes()[:100])),
    Case("tok-max-len-zero", "tokenizer.bin max_token_length = 0", MFE, r"max_token_length 0 is not positive",
         lambda m, t: t.write_bytes(struct.pack("<i", 0) + t.read_bytes()[4:])),
    Case("tok-negative-record", "a token record of length -7", MFE, r"token 0 has bad length -7",
         _tok_record_len),
    Case("tok-too-few", "a vocabulary of 200 (< 259) tokens", MFE, r"needs at least 259", _tok_few_tokens),
]


def _hf_cfg(**over):
    def mutate(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(over)
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def _write(name: str, data):
    def mutate(d: Path):
        p = d / name
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return mutate


def _hf_st_truncate(d: Path):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:1000])


def _hf_st_data_short(d: Path):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


HF_CASES = [
    Case("hf-no-config", "HF folder without config.json", FileNotFoundError, r"config\.json",
         lambda d: (d / "config.json").unlink()),
    Case("hf-config-not-json", "config.json = '{bad'", MFE, r"config\.json: .*(JSON|json)",
         _write("config.json", "{bad")),
    Case("hf-config-array", "config.json = '[]'", MFE, r"config\.json", _write("config.json", "[]")),
    Case("hf-config-bad-utf8", "config.json with a 0xFF byte", MFE, r"config\.json.*UTF-8",
         _write("config.json", b'{"a": "\xff"}')),
    Case("hf-unknown-arch", "architectures = [GPT2LMHeadModel]", UNS, r"GPT2LMHeadModel",
         _hf_cfg(architectures=["GPT2LMHeadModel"])),
    Case("hf-zero-layers", "num_hidden_layers = 0", MFE, r"num_hidden_layers", _hf_cfg(num_hidden_layers=0)),
    Case("hf-string-int", 'hidden_size = "64"', MFE, r'"hidden_size" must be an integer',
         _hf_cfg(hidden_size="64")),
    Case("hf-kv-heads", "num_key_value_heads = 3 with 4 heads", MFE, r"num_key_value_heads",
         _hf_cfg(num_key_value_heads=3)),
    Case("hf-vocab-mismatch", "config vocab_size 1000 vs a [512, 64] embedding", MFE,
         r"model\.embed_tokens\.weight.*\[512, 64\].*\[1000, 64\]", _hf_cfg(vocab_size=1000)),
    Case("hf-bad-dtype", 'torch_dtype = "int8"', UNS, r"torch_dtype", _hf_cfg(torch_dtype="int8")),
    Case("hf-negative-rope", "rope_theta = -1", MFE, r"rope_theta", _hf_cfg(rope_theta=-1)),
    Case("hf-eps-float-underflow", "rms_norm_eps = 1e-85 (0 as a float; found by fuzz_config)", MFE,
         r"rms_norm_eps", _hf_cfg(rms_norm_eps=1e-85)),
    Case("hf-theta-float-underflow", "rope_theta = 1e-50 (0 as a float)", MFE, r"rope_theta",
         _hf_cfg(rope_theta=1e-50)),
    Case("hf-llama3-equal-factors", "llama3 rope_scaling with low/high_freq_factor equal as floats", MFE,
         r"rope_scaling llama3", _hf_cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 1.00000000001,
                                                       "original_max_position_embeddings": 64})),
    Case("hf-no-weights", "no model.safetensors", FileNotFoundError, r"model\.safetensors",
         lambda d: (d / "model.safetensors").unlink()),
    Case("hf-st-truncated", "model.safetensors cut to 1000 bytes", MFE,
         r"model\.safetensors: header length \d+ goes past the end", _hf_st_truncate),
    Case("hf-st-data-short", "model.safetensors missing its last 100 bytes", MFE,
         r"model\.safetensors: tensor .* past the data section", _hf_st_data_short),
    Case("hf-st-garbage-header", "safetensors header 'not json!!'", MFE, r"model\.safetensors: invalid JSON",
         _write("model.safetensors", struct.pack("<Q", 10) + b"not json!!")),
    Case("hf-st-huge-header-len", "safetensors header length 2^63", MFE, r"model\.safetensors: header length",
         _write("model.safetensors", struct.pack("<Q", 2**63) + b"{}")),
    Case("hf-no-tokenizer", "no tokenizer.json", FileNotFoundError, r"tokenizer\.json",
         lambda d: (d / "tokenizer.json").unlink()),
    Case("hf-tokenizer-not-json", "tokenizer.json = '[1,2'", MFE, r"tokenizer\.json: not valid JSON",
         _write("tokenizer.json", "[1,2")),
    Case("hf-tokenizer-config-array", "tokenizer_config.json = '[]'", MFE, r"tokenizer_config\.json",
         _write("tokenizer_config.json", "[]")),
]


def _load_fails(path: Path, case: Case, **kw):
    fds = _open_fds()
    with pytest.raises(case.exc, match=case.match):
        LLM(str(path), num_threads=1, **kw)
    # no descriptor and no mapping of the bad file is left behind
    assert _open_fds() <= fds
    assert not _mapped(path)


@pytest.mark.parametrize("case", [c.param() for c in L2C_CASES])
def test_bad_llama2c_file(case, llm, tiny_llama2c_path, tmp_path):
    model, tok = tmp_path / "model.bin", tmp_path / "tokenizer.bin"
    shutil.copy(tiny_llama2c_path, model)
    shutil.copy(tiny_llama2c_path.parent / "tokenizer.bin", tok)
    case.arg(model, tok)
    _load_fails(model, case)
    assert_serves(llm)


@pytest.mark.parametrize("case", [c.param() for c in HF_CASES])
def test_bad_hf_folder(case, llm, tiny_hf_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, d)
    case.arg(d)
    _load_fails(d, case)
    assert_serves(llm)


def test_missing_model_path(llm):
    with pytest.raises(FileNotFoundError, match="/nonexistent/model.bin"):
        LLM("/nonexistent/model.bin")
    assert_serves(llm)


def test_folder_that_is_no_model(llm, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match=r"(tokenizer|config)\.json"):
        LLM(str(tmp_path))
    assert_serves(llm)


# ============================================================================ constructor knobs

KNOB_CASES = [
    Case("knob-unknown", "LLM(model, bogus=1)", TypeError, r"bogus", dict(bogus=1)),
    Case("knob-model-type", "LLM(123)", TypeError, r"model must be a path", dict(model=123)),
    Case("knob-block-size-0", "block_size=0", ValueError, r"block_size", dict(block_size=0)),
    Case("knob-block-size-huge", "block_size=2048", ValueError, r"block_size must be in \[1, 1024\], got 2048",
         dict(block_size=2048)),
    Case("knob-block-size-float", "block_size=1.5", TypeError, r"block_size must be an int", dict(block_size=1.5)),
    Case("knob-max-num-seqs-0", "max_num_seqs=0", ValueError, r"max_num_seqs", dict(max_num_seqs=0)),
    # with a small KV budget: with the default one the engine first sizes and zeroes a
    # KV cache for 10**12 sequences (~8 GB resident for 5 s) before the scheduler fails
    Case("knob-max-num-seqs-huge", "max_num_seqs=10**12 (kv_cache_memory 1 MiB)", ValueError,
         r"max_num_seqs must be in \[1, 65536\], got 1000000000000",
         dict(max_num_seqs=10**12, kv_cache_memory="1MiB")),
    Case("knob-max-num-seqs-2e63", "max_num_seqs=2**63", (ValueError, OverflowError), r"max_num_seqs",
         dict(max_num_seqs=2**63)),
    Case("knob-max-model-len-0", "max_model_len=0", ValueError, r"max_model_len", dict(max_model_len=0)),
    Case("knob-max-model-len-huge", "max_model_len=100000 (model has 512)", ValueError,
         r"max_model_len 100000 exceeds the model's context of 512 tokens", dict(max_model_len=100000)),
    Case("knob-batched-tokens", "max_num_batched_tokens=4 without chunked prefill", ValueError,
         r"max_num_batched_tokens \(4\) must be >= max_model_len",
         dict(max_num_batched_tokens=4, enable_chunked_prefill=False)),
    Case("knob-kv-tiny", "kv_cache_memory=1000 (less than a block)", ValueError, r"holds no KV block",
         dict(kv_cache_memory=1000)),
    Case("knob-kv-unparsable", 'kv_cache_memory="lots"', ValueError, r"kv_cache_memory: cannot read 'lots'",
         dict(kv_cache_memory="lots")),
    Case("knob-kv-negative", "kv_cache_memory=-1", ValueError, r"kv_cache_memory must be positive",
         dict(kv_cache_memory=-1)),
    Case("knob-kv-bool", "kv_cache_memory=True", TypeError, r"kv_cache_memory", dict(kv_cache_memory=True)),
    Case("knob-dtype", 'dtype="int8"', ValueError, r"dtype must be one of", dict(dtype="int8")),
    Case("knob-kv-dtype", 'kv_cache_dtype="int4"', ValueError, r"kv_cache_dtype", dict(kv_cache_dtype="int4")),
    Case("knob-scheduling", 'scheduling="random"', ValueError, r"scheduling", dict(scheduling="random")),
    Case("knob-device", 'device="tpu"', ValueError, r"device", dict(device="tpu")),
    Case("knob-threads-0", "num_threads=0", ValueError, r"num_threads", dict(num_threads=0)),
    Case("knob-threads-huge", "num_threads=100000", ValueError, r"num_threads must be in \[1, 1024\], got 100000", dict(num_threads=100000)),
    Case("knob-seed-negative", "seed=-1", ValueError, r"seed", dict(seed=-1)),
    Case("knob-seed-huge", "seed=2**70", ValueError, r"seed", dict(seed=2**70)),
    Case("knob-bool-type", 'enable_chunked_prefill="yes"', TypeError, r"enable_chunked_prefill must be a bool",
         dict(enable_chunked_prefill="yes")),
    Case("knob-gpu-util", "gpu_memory_utilization=0", ValueError, r"gpu_memory_utilization",
         dict(gpu_memory_utilization=0)),
    Case("knob-tokenizer-missing", 'tokenizer="/nonexistent/tok.bin"', FileNotFoundError,
         r"tokenizer not found: /nonexistent/tok\.bin", dict(tokenizer="/nonexistent/tok.bin")),
    Case("knob-tokenizer-is-model", "tokenizer= the model .bin itself", MFE, r"stories260K\.bin: token \d+ has bad length",
         dict(tokenizer=str(STORIES))),
]


@pytest.mark.parametrize("case", [c.param() for c in KNOB_CASES])
def test_bad_engine_knob(case, llm):
    kw = dict(case.arg)
    model = kw.pop("model", str(STORIES))
    kw.setdefault("num_threads", 1)
    with pytest.raises(case.exc, match=case.match):
        LLM(model, **kw)
    assert_serves(llm)


def test_cuda_without_a_gpu(llm):
    """device="cuda" where no GPU or driver is present: UnsupportedError naming CUDA."""
    try:
        m = LLM(str(STORIES), device="cuda")
    except UNS as e:
        assert "CUDA" in str(e)
    else:
        m.close()
        pytest.skip("a CUDA device is present")
    assert_serves(llm)


# ============================================================================ SamplingParams

SP_CASES = [
    Case("sp-n-0", "n=0", ValueError, r"SamplingParams\.n must be in \[1, 1024\]", dict(n=0)),
    Case("sp-n-huge", "n=2000", ValueError, r"SamplingParams\.n", dict(n=2000)),
    Case("sp-n-bool", "n=True", TypeError, r"SamplingParams\.n must be an int", dict(n=True)),
    Case("sp-temp-nan", "temperature=nan", ValueError, r"temperature", dict(temperature=float("nan"))),
    Case("sp-temp-negative", "temperature=-0.1", ValueError, r"temperature", dict(temperature=-0.1)),
    Case("sp-temp-inf", "temperature=inf", ValueError, r"temperature", dict(temperature=float("inf"))),
    Case("sp-temp-str", 'temperature="hot"', TypeError, r"temperature must be a number", dict(temperature="hot")),
    Case("sp-top-p-0", "top_p=0", ValueError, r"top_p", dict(top_p=0.0)),
    Case("sp-top-p-big", "top_p=1.5", ValueError, r"top_p", dict(top_p=1.5)),
    Case("sp-top-k", "top_k=-5", ValueError, r"top_k", dict(top_k=-5)),
    Case("sp-min-p", "min_p=2", ValueError, r"min_p", dict(min_p=2.0)),
    Case("sp-rep-penalty", "repetition_penalty=0", ValueError, r"repetition_penalty", dict(repetition_penalty=0)),
    Case("sp-presence", "presence_penalty=3", ValueError, r"presence_penalty", dict(presence_penalty=3)),
    Case("sp-frequency", "frequency_penalty=-3", ValueError, r"frequency_penalty", dict(frequency_penalty=-3)),
    Case("sp-seed-huge", "seed=2**64", ValueError, r"seed", dict(seed=2**64)),
    Case("sp-max-tokens-0", "max_tokens=0", ValueError, r"max_tokens", dict(max_tokens=0)),
    Case("sp-max-tokens-str", 'max_tokens="10"', TypeError, r"max_tokens must be an int", dict(max_tokens="10")),
    Case("sp-min-tokens-negative", "min_tokens=-1", ValueError, r"min_tokens", dict(min_tokens=-1)),
    Case("sp-min-gt-max", "min_tokens=20, max_tokens=10", ValueError, r"min_tokens \(20\) must be <= max_tokens",
         dict(min_tokens=20, max_tokens=10)),
    Case("sp-logprobs-big", "logprobs=100", ValueError, r"logprobs must be in \[0, 20\]", dict(logprobs=100)),
    Case("sp-logprobs-negative", "logprobs=-1", ValueError, r"logprobs", dict(logprobs=-1)),
    Case("sp-stop-empty", 'stop=[""]', ValueError, r"stop must not contain an empty string", dict(stop=[""])),
    Case("sp-stop-surrogate", 'stop=["\\ud800"] (not encodable text)', ValueError, r"surrogate",
         dict(stop=["\ud800"])),
    Case("sp-stop-int", "stop=3", TypeError, r"stop must be a str or a list", dict(stop=3)),
    Case("sp-stop-list-int", "stop=[1]", TypeError, r"stop must contain only str", dict(stop=[1])),
    Case("sp-stop-ids-int", "stop_token_ids=5", TypeError, r"stop_token_ids must be a list", dict(stop_token_ids=5)),
    Case("sp-stop-ids-negative", "stop_token_ids=[-1]", ValueError, r"stop_token_ids must be >= 0",
         dict(stop_token_ids=[-1])),
    Case("sp-bool-field", 'ignore_eos="yes"', TypeError, r"ignore_eos must be a bool", dict(ignore_eos="yes")),
    Case("sp-output-kind", 'output_kind="x"', ValueError, r"output_kind", dict(output_kind="x")),
    Case("sp-unknown", "SamplingParams(bogus=1)", TypeError, r"bogus", dict(bogus=1)),
    Case("sp-logit-bias-range", 'logit_bias={5: 101}', ValueError, r"logit_bias values must be in \[-100, 100\]", dict(logit_bias={5: 101})),
    Case("sp-logit-bias-key", 'logit_bias={"5": 1}', TypeError, r"logit_bias keys must be int token ids", dict(logit_bias={"5": 1})),
    Case("sp-logit-bias-negative-id", 'logit_bias={-1: 1}', ValueError, r"logit_bias keys must be token ids >= 0", dict(logit_bias={-1: 1})),
    Case("sp-allowed-empty", 'allowed_token_ids=[]', ValueError, r"allowed_token_ids must not be empty", dict(allowed_token_ids=[])),
    Case("sp-bad-words-str", 'bad_words="dog"', TypeError, r"bad_words must be a list of str", dict(bad_words="dog")),
    Case("sp-prompt-logprobs-big", 'prompt_logprobs=21', ValueError, r"prompt_logprobs must be in \[0, 20\]", dict(prompt_logprobs=21)),
    Case("sp-best-of-lt-n", 'n=3, best_of=2', ValueError, r"best_of must be in \[n, 1024\]", dict(n=3, best_of=2)),
]


@pytest.mark.parametrize("case", [c.param() for c in SP_CASES])
def test_bad_sampling_params(case, llm):
    with pytest.raises(case.exc, match=case.match):
        SamplingParams(**case.arg)
    assert_serves(llm)


# ============================================================================ prompts and generate()

def _gen(prompts, params=GOOD, **kw):
    return lambda m: m.generate(prompts, params, use_tqdm=False, **kw)


GEN_CASES = [
    Case("prompt-empty-str", 'generate("")', ValueError, r"the prompt is empty", _gen("")),
    Case("prompt-empty-ids", "generate([[]]) (an empty id list)", ValueError, r"the prompt is empty",
         _gen([GOOD_PROMPT, []])),
    Case("prompt-no-prompts", "generate([])", ValueError, r"prompts is empty", _gen([])),
    Case("prompt-id-out-of-vocab", "token id 99999 (vocab 512)", ValueError,
         r"token id 99999 is outside the vocabulary \[0, 512\)", _gen([[1, 2, 99999]])),
    Case("prompt-id-negative", "token id -3", ValueError, r"token id -3 is outside the vocabulary",
         _gen([[1, -3]])),
    Case("prompt-id-int64-huge", "int64 array holding 2**40", ValueError, r"token id 1099511627776 is outside",
         _gen(np.array([1, 2**40], dtype=np.int64))),
    Case("prompt-id-uint64-huge", "uint64 array holding 2**63", ValueError, r"token id 9223372036854775808",
         _gen(np.array([1, 2**63], dtype=np.uint64))),
    Case("prompt-float", "generate(3.5)", TypeError, r"prompts must be a str", _gen(3.5)),
    Case("prompt-bytes", 'generate(b"hi")', TypeError, r"got bytes", _gen(b"hi")),
    Case("prompt-none", "generate(None)", TypeError, r"got NoneType", _gen(None)),
    Case("prompt-mixed-list", '[1, "a"] as one prompt', TypeError, r"got str|token ids must be ints",
         _gen([GOOD_PROMPT, [1, "a"]])),
    Case("prompt-float-array", "float64 NumPy array", TypeError, r"integer dtype, got float64",
         _gen(np.array([1.5, 2.0]))),
    Case("prompt-bool-array", "bool NumPy array", TypeError, r"integer dtype, got bool",
         _gen(np.array([True, False]))),
    Case("prompt-3d-array", "a 3-D int array", ValueError, r"1-D or 2-D, got shape \(2, 2, 2\)",
         _gen(np.zeros((2, 2, 2), dtype=np.int32))),
    Case("prompt-empty-2d-array", "a (0, 3) int array", ValueError, r"empty", _gen(np.zeros((0, 3), np.int32))),
    Case("prompt-dict-no-keys", '{}', ValueError, r"needs 'prompt' or 'prompt_token_ids'", _gen({})),
    Case("prompt-dict-unknown-key", '{"prompt": "hi", "promt_token_ids": [1]}', ValueError,
         r"unknown key\(s\) \['promt_token_ids'\]", _gen({"prompt": "hi", "promt_token_ids": [1]})),
    Case("prompt-dict-multimodal", '{"prompt": "hi", "multi_modal_data": {...}}', ValueError,
         r"'multi_modal_data'.*text-only", _gen({"prompt": "hi", "multi_modal_data": {"image": None}})),
    Case("prompt-lone-surrogate", 'a str holding "\\ud800"', ValueError, r"surrogate", _gen("a\ud800b")),
    Case("prompt-too-long-text", "a 1200-token text (max_model_len 512)", ValueError,
         r"the prompt has \d+ tokens, more than max_model_len \(512\)", _gen("hello " * 600)),
    Case("prompt-huge-text", "a 4 MB text: refused before tokenizing", ValueError,
         r"the prompt has 4000000 characters, more than can fit in max_model_len \(512\) tokens",
         _gen("x" * 4_000_000)),
    Case("prompt-too-long-ids", "600 token ids", ValueError, r"600 tokens, more than max_model_len",
         _gen([[1] * 600])),
    Case("prompt-plus-max-tokens", "500 ids + max_tokens=100", ValueError,
         r"prompt \(500 tokens\) \+ max_tokens \(100\) exceeds max_model_len \(512\)",
         _gen([[1] * 500], SamplingParams(max_tokens=100))),
    Case("prompt-fills-context", "512 ids, max_tokens=None", ValueError, r"leaves no room to generate",
         _gen([[1] * 512], SamplingParams(max_tokens=None))),
    Case("gen-huge-max-tokens", "max_tokens=10**9", ValueError, r"max_tokens \(1000000000\) exceeds max_model_len",
         _gen([GOOD_PROMPT], SamplingParams(max_tokens=10**9))),
    Case("gen-stop-id-out-of-vocab", "stop_token_ids=[10**6]", ValueError,
         r"stop_token_ids contains 1000000, outside the vocabulary", _gen([GOOD_PROMPT], SamplingParams(stop_token_ids=[10**6]))),
    Case("gen-params-count", "2 prompts, 1 SamplingParams in a list", ValueError,
         r"got 1 SamplingParams for 2 prompts", _gen(["a", "b"], [GOOD])),
    Case("gen-params-type", "sampling_params={'temperature': 0}", TypeError, r"sampling_params must be",
         _gen(["a"], {"temperature": 0})),
    Case("gen-priority-count", "priority list of the wrong length", ValueError, r"got 2 priorities for 1 prompts",
         _gen(["a"], GOOD, priority=[1, 2])),
    Case("gen-priority-huge", "priority=[2**40]", (ValueError, OverflowError), r"priority",
         _gen(["a"], GOOD, priority=[2**40])),
    Case("chat-no-content", 'chat([{"role": "user"}])', ValueError, r"'role' and 'content'",
         lambda m: m.chat([{"role": "user"}], GOOD, use_tqdm=False)),
    Case("chat-not-a-list", 'chat("hello")', TypeError, r"messages must be a non-empty list",
         lambda m: m.chat("hello", GOOD, use_tqdm=False)),
]


@pytest.mark.parametrize("case", [c.param() for c in GEN_CASES])
def test_bad_generate_call(case, llm):
    with pytest.raises(case.exc, match=case.match):
        case.arg(llm)
    assert_serves(llm)  # nothing was queued (or all of it was taken back)


def test_generate_after_close():
    m = LLM(str(STORIES), num_threads=1)
    m.close()
    with pytest.raises(conveyor.EngineClosedError, match="closed"):
        m.generate([GOOD_PROMPT], GOOD, use_tqdm=False)
    m.close()  # twice is fine


# ============================================================================ AsyncLLM misuse


@pytest.fixture(scope="module")
def aengine():
    e = AsyncLLM(str(STORIES), num_threads=1)
    yield e
    e.close()


async def _collect(gen):
    outs = []
    async for o in gen:
        outs.append(o)
    return outs


async def _good(e: AsyncLLM):
    outs = await _collect(e.generate(GOOD_PROMPT, GOOD))
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason in ("stop", "length")


def assert_async_serves(e: AsyncLLM):
    asyncio.run(_good(e))
    st = e.stats()
    assert st["blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
    assert e.num_unfinished() == 0


LONG = SamplingParams(max_tokens=300, ignore_eos=True)


def test_async_duplicate_request_id(aengine):
    async def go():
        g1 = aengine.generate(GOOD_PROMPT, LONG, request_id="dup")
        await g1.__anext__()
        with pytest.raises(ValueError, match=r"request_id 'dup' is already in use"):
            await _collect(aengine.generate("b", GOOD, request_id="dup"))
        await g1.aclose()

    asyncio.run(go())
    assert_async_serves(aengine)
    # once the first one's abort has gone through, the id may be used again
    outs = asyncio.run(_collect(aengine.generate("b", GOOD, request_id="dup")))
    assert outs[-1].finished


def test_async_abort_unknown_id(aengine):
    """Not an error: abort() answers False for an id that is not running."""
    async def go():
        assert await aengine.abort("no-such-request") is False
        outs = await _collect(aengine.generate(GOOD_PROMPT, GOOD, request_id="done-one"))
        assert await aengine.abort(outs[-1].request_id) is False  # already finished

    asyncio.run(go())
    assert_async_serves(aengine)


def test_async_abort_wrong_type(aengine):
    with pytest.raises(TypeError, match="request_id must be a str, got int"):
        asyncio.run(aengine.abort(5))
    assert_async_serves(aengine)


def test_async_iterator_consumed_twice(aengine):
    """An exhausted stream stays exhausted: a second pass yields nothing (no repeated
    outputs, no hang) and __anext__ raises StopAsyncIteration."""
    async def go():
        g = aengine.generate(GOOD_PROMPT, GOOD)
        first = await _collect(g)
        assert first[-1].finished
        assert await _collect(g) == []
        with pytest.raises(StopAsyncIteration):
            await g.__anext__()

    asyncio.run(go())
    assert_async_serves(aengine)


def test_async_iterator_consumed_concurrently(aengine):
    """Two tasks pulling one stream: the second gets RuntimeError; the request is
    then aborted with its consumer and its blocks freed."""
    async def go():
        g = aengine.generate(GOOD_PROMPT, LONG)
        t1 = asyncio.ensure_future(_collect(g))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already running"):
            await g.__anext__()
        t1.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t1

    asyncio.run(go())
    assert_async_serves(aengine)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    pytest.param(([GOOD_PROMPT, "b"],), {}, TypeError, "takes one prompt", id="async-list-of-prompts"),
    pytest.param((GOOD_PROMPT,), dict(request_id=5), TypeError, "request_id must be a str", id="async-request-id-int"),
    pytest.param((GOOD_PROMPT, {"max_tokens": 2}), {}, TypeError, "sampling_params must be a SamplingParams",
                 id="async-params-dict"),
    pytest.param(("",), {}, ValueError, "the prompt is empty", id="async-empty-prompt"),
    pytest.param(([1] * 600,), {}, ValueError, "max_model_len", id="async-too-long"),
    pytest.param(([1, 99999],), {}, ValueError, "outside the vocabulary", id="async-out-of-vocab"),
])
def test_async_bad_call(aengine, args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        asyncio.run(_collect(aengine.generate(*args, **kwargs)))
    assert_async_serves(aengine)


def test_async_generate_outside_event_loop(aengine):
    g = aengine.generate(GOOD_PROMPT, GOOD)
    with pytest.raises(RuntimeError, match="no running event loop"):
        g.__anext__().send(None)
    assert_async_serves(aengine)


def test_async_cancel_mid_stream(aengine):
    async def go():
        async def consume():
            async for _ in aengine.generate(GOOD_PROMPT, LONG):
                pass
        t = asyncio.ensure_future(consume())
        while aengine.stats()["generation_tokens"] == 0 or aengine.stats()["num_running"] == 0:
            await asyncio.sleep(0.001)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(go())
    assert_async_serves(aengine)


def test_async_generate_after_close_and_close_in_flight():
    e = AsyncLLM(str(STORIES), num_threads=1)

    async def go():
        g = e.generate(GOOD_PROMPT, LONG)
        await g.__anext__()
        e.close()  # with a request in flight: its stream ends, finished as aborted
        rest = await asyncio.wait_for(_collect(g), 30)
        assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(conveyor.EngineClosedError, match="closed"):
            await _collect(e.generate(GOOD_PROMPT, GOOD))
        assert await e.abort("anything") is False

    asyncio.run(go())
    e.close()


# ============================================================================ HTTP

try:
    import httpx
    from conveyor.serve import build_app
except ImportError:  # the server (or its dependencies) is not there
    build_app = None

needs_server = pytest.mark.skipif(build_app is None, reason="conveyor.serve (or httpx/starlette) not importable")
BODY_LIMIT = 65536


def _post(path="/v1/completions", **kw):
    return ("POST", path, kw)


HTTP_CASES = [
    Case("http-malformed-json", "body '{\"prompt\": \"hi\",'", 400, r"not valid JSON",
         _post(content=b'{"prompt": "hi",')),
    Case("http-empty-body", "empty body", 400, r"not valid JSON", _post(content=b"")),
    Case("http-not-object", "body [1, 2]", 400, r"must be a JSON object, got array", _post(json=[1, 2])),
    Case("http-nan", "temperature: NaN (not JSON)", 400, r"NaN is not valid JSON",
         _post(content=b'{"prompt": "hi", "temperature": NaN}')),
    Case("http-invalid-utf8", "body bytes \\xff\\xfe", 400, r"not valid UTF-8",
         _post(content=b'{"prompt": "\xff\xfe"}')),
    Case("http-lone-surrogate", 'prompt "a\\ud800" (JSON escape)', 400, r"'prompt' contains invalid Unicode",
         _post(content=b'{"prompt": "a\\ud800"}')),
    Case("http-oversized", "a 100 kB body (limit 64 KiB)", 413, r"the limit is 65536",
         _post(content=b'{"prompt": "' + b"a" * 100000 + b'"}')),
    Case("http-deep-nesting", "30,000 nested arrays", 400, r"not valid JSON|recursion",
         _post(content=b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}")),
    Case("http-huge-int", "max_tokens with 5000 digits", 400, r"not valid JSON|max_tokens",
         _post(content=b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")),
    Case("http-bad-content-length", "Content-Length: abc", 400, r"Content-Length",
         _post(content=b"{}", headers={"content-length": "abc"})),
    Case("http-max-tokens-type", 'max_tokens: "10"', 400, r"'max_tokens' must be an integer, got string",
         _post(json={"prompt": "hi", "max_tokens": "10"})),
    Case("http-max-tokens-float", "max_tokens: 2.5", 400, r"'max_tokens' must be an integer",
         _post(json={"prompt": "hi", "max_tokens": 2.5})),
    Case("http-prompt-type", "prompt: 5", 400, r"'prompt' must be a string or an array",
         _post(json={"prompt": 5})),
    Case("http-missing-prompt", "no prompt", 400, r"'prompt' is required", _post(json={"max_tokens": 3})),
    Case("http-huge-n", "n: 1000000", 400, r"'n' must be in \[1, \d+\]", _post(json={"prompt": "hi", "n": 10**6})),
    Case("http-n-times-prompts", "200 prompts x n=100", 400, r"more than \d+ sequences",
         _post(json={"prompt": ["a"] * 200, "n": 100})),
    Case("http-huge-max-tokens", "max_tokens: 10**9", 400, r"max_tokens \(1000000000\) exceeds max_model_len",
         _post(json={"prompt": "hi", "max_tokens": 10**9})),
    Case("http-temperature", "temperature: -1", 400, r"temperature must be finite",
         _post(json={"prompt": "hi", "temperature": -1})),
    Case("http-stream-type", 'stream: "yes"', 400, r"'stream' must be a boolean", _post(json={"prompt": "hi", "stream": "yes"})),
    Case("http-logprobs", "logprobs: 1000", 400, r"logprobs must be in \[0, 20\]", _post(json={"prompt": "hi", "logprobs": 1000})),
    Case("http-seed-huge", "seed: 2**70", 400, r"seed must be in", _post(json={"prompt": "hi", "seed": 2**70})),
    Case("http-stop-type", "stop: [1]", 400, r"'stop' must be a string or an array of strings",
         _post(json={"prompt": "hi", "stop": [1]})),
    Case("http-token-out-of-vocab", "prompt: [1, 99999]", 400, r"token id 99999 is outside the vocabulary",
         _post(json={"prompt": [1, 99999]})),
    Case("http-unknown-model", 'model: "gpt-9"', 404, r"the model 'gpt-9' does not exist",
         _post(json={"prompt": "hi", "model": "gpt-9"})),
    Case("http-chat-no-messages", "chat without messages", 400, r"'messages' is required",
         _post("/v1/chat/completions", json={})),
    Case("http-chat-bad-role", 'chat role "robot"', 400, r"'messages\[0\]\.role' must be one of",
         _post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})),
    Case("http-no-route", "GET /v1/nothing", 404, r"no route for /v1/nothing", ("GET", "/v1/nothing", {})),
    Case("http-wrong-method", "GET /v1/completions", 405, r"method GET not allowed", ("GET", "/v1/completions", {})),
]


@pytest.fixture(scope="module")
def http_app(aengine):
    if build_app is None:
        pytest.skip("conveyor.serve not importable")
    return build_app(aengine, model_name="stories260K", max_body_bytes=BODY_LIMIT)


async def _http(app, method, path, **kw):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        bad = await c.request(method, path, **kw)
        good = await c.post("/v1/completions", json={"prompt": GOOD_PROMPT, "max_tokens": 5, "temperature": 0})
    return bad, good


@needs_server
@pytest.mark.parametrize("case", [c.param() for c in HTTP_CASES])
def test_bad_http_request(case, http_app, aengine):
    method, path, kw = case.arg
    bad, good = asyncio.run(_http(http_app, method, path, **kw))
    assert bad.status_code == case.exc, bad.text
    err = bad.json()["error"]
    assert err["message"] and err["type"]
    import re

    assert re.search(case.match, err["message"]), err["message"]
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"]
    st = aengine.stats()
    assert st["blocks_used"] == 0 and st["num_running"] == 0


# ============================================================================ the table

ALL_CASES = [("test_bad_llama2c_file", L2C_CASES), ("test_bad_hf_folder", HF_CASES),
             ("test_bad_engine_knob", KNOB_CASES), ("test_bad_sampling_params", SP_CASES),
             ("test_bad_generate_call", GEN_CASES), ("test_bad_http_request", HTTP_CASES)]


# The cases that have a test of their own: (case, input, expected, test).
OTHER_ROWS = [
    ("model-missing", "LLM('/nonexistent/model.bin')", "FileNotFoundError naming the path", "test_missing_model_path"),
    ("model-not-a-model", "a folder holding only notes.txt", "FileNotFoundError naming tokenizer.json / config.json",
     "test_folder_that_is_no_model"),
    ("knob-cuda-no-gpu", 'device="cuda" without a GPU or driver', "UnsupportedError naming CUDA (skipped with a GPU)",
     "test_cuda_without_a_gpu"),
    ("llm-after-close", "LLM.generate after close()", "EngineClosedError `closed`; close() twice is fine",
     "test_generate_after_close"),
    ("async-duplicate-id", "a second request_id='dup' while the first runs", "ValueError `request_id 'dup' is "
     "already in use`; the id is free again once the first ends", "test_async_duplicate_request_id"),
    ("async-abort-unknown", "abort('no-such-request'), abort of a finished id", "no exception: returns False",
     "test_async_abort_unknown_id"),
    ("async-abort-type", "abort(5)", "TypeError `request_id must be a str, got int`", "test_async_abort_wrong_type"),
    ("async-consumed-twice", "async for over a finished stream again", "yields nothing; __anext__ raises "
     "StopAsyncIteration (no repeated outputs, no hang)", "test_async_iterator_consumed_twice"),
    ("async-consumed-concurrently", "two tasks pulling one stream", "RuntimeError `already running`; the request "
     "is aborted with its consumer", "test_async_iterator_consumed_concurrently"),
    ("async-list-of-prompts", "generate(['a', 'b'])", "TypeError `takes one prompt`", "test_async_bad_call"),
    ("async-request-id-int", "generate(p, request_id=5)", "TypeError `request_id must be a str`", "test_async_bad_call"),
    ("async-params-dict", "generate(p, {'max_tokens': 2})", "TypeError `sampling_params must be a SamplingParams`",
     "test_async_bad_call"),
    ("async-empty-prompt", 'generate("")', "ValueError `the prompt is empty`", "test_async_bad_call"),
    ("async-too-long", "600 token ids", "ValueError `max_model_len`", "test_async_bad_call"),
    ("async-out-of-vocab", "token id 99999", "ValueError `outside the vocabulary`", "test_async_bad_call"),
    ("async-no-loop", "stepping generate() outside an event loop", "RuntimeError `no running event loop`",
     "test_async_generate_outside_event_loop"),
    ("async-cancel", "the consumer task cancelled mid-stream", "CancelledError in the consumer; request aborted, "
     "blocks freed", "test_async_cancel_mid_stream"),
    ("async-after-close", "close() with a request in flight, then generate/abort",
     "the stream ends with finish_reason 'abort'; then EngineClosedError `closed`; abort returns False",
     "test_async_generate_after_close_and_close_in_flight"),
]


def catalogue_markdown() -> str:
    rows = ["| case | input | expected error (message matches) | test |", "| --- | --- | --- | --- |"]
    for case, what, exp, test in OTHER_ROWS:
        rows.append(f"| {case} | {what.replace('|', '/')} | {exp} | `{test}` |")
    for test, cases in ALL_CASES:
        for c in cases:
            what = c.what.replace("|", "\\|")
            exp = f"{_exc_name(c.exc)} `{c.match.replace('|', ' or ')}`"
            if c.bug:
                exp += f" — **known bug**: {c.bug}"
            rows.append(f"| {c.id} | {what} | {exp} | `{test}[{c.id}]` |")
    return "\n".join(rows)


def test_catalogue_is_complete():
    n = sum(len(cs) for _, cs in ALL_CASES) + len(OTHER_ROWS)
    ids = [c.id for _, cs in ALL_CASES for c in cs] + [r[0] for r in OTHER_ROWS]
    tests = {name for name in globals() if name.startswith("test_")}
    assert {r[3] for r in OTHER_ROWS} <= tests
    assert n >= 40 and len(set(ids)) == len(ids)


if __name__ == "__main__":
    print(catalogue_markdown())


# The C engine is the one authority on ranges: its errors name the field in .field.
FIELD_CASES = [
    (dict(temperature=-1), ValueError, "temperature"),
    (dict(top_k=-5), ValueError, "top_k"),
    (dict(logprobs=100), ValueError, "logprobs"),
    (dict(min_tokens=5, max_tokens=2), ValueError, "min_tokens"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    (dict(seed=2**70), ValueError, "seed"),
    (dict(n=True), TypeError, "n"),
    (dict(top_k=2**40), ValueError, "top_k"),
]


@pytest.mark.parametrize("kw,exc,field", FIELD_CASES, ids=[c[2] + str(i) for i, c in enumerate(FIELD_CASES)])
def test_sampling_error_names_field(kw, exc, field):
    with pytest.raises(exc) as info:
        SamplingParams(**kw)
    assert info.value.field == field


def test_check_request_names_field(llm):
    cases = [([1, 99999], SamplingParams(), "prompt"),
             ([1] * 600, SamplingParams(), "prompt"),
             ([1, 2], SamplingParams(max_tokens=10**6), "max_tokens"),
             ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids")]
    for ids, params, field in cases:
        with pytest.raises(ValueError) as info:
            llm.check_request(ids, params)
        assert info.value.field == field, (ids, params)
    llm.check_request([1, 2], SamplingParams(max_tokens=4))  # a good request passes and queues nothing
    assert llm.stats()["num_waiting"] == 0


def test_step_refused_while_background_loop_runs(aengine):
    """The C engine enforces "not while the background loop runs"."""
    with pytest.raises(RuntimeError, match="background loop"):
        aengine._core.step()
    assert_async_serves(aengine)


def test_owner_calls_refused_while_background_loop_runs():
    """Every call that must not overlap the background loop fails with an error
    naming it (the binding's own Engine: step with or without mask waiting, a
    second start); after stop_loop, stepping is the caller's again."""
    eng = conveyor._core.Engine(str(STORIES), num_threads=1)
    rfd, wfd = os.pipe()
    try:
        eng.start_loop(wfd)
        for kw in ({}, {"wait_masks": True}):
            with pytest.raises(RuntimeError, match="while its background loop runs"):
                eng.step(**kw)
        with pytest.raises(RuntimeError, match="already running"):
            eng.start_loop(wfd)
        eng.stop_loop()
        eng.stop_loop()  # a second stop finds nothing to stop
        assert eng.step(wait_masks=True) == 0  # idle: nothing queued
    finally:
        eng.close()
        os.close(rfd)
        os.close(wfd)


def test_too_many_eos_ids_refused():
    """eos_ids is a fixed array of CV_MAX_EOS (8) in C: more is an error, never a truncation."""
    with pytest.raises(ValueError, match="eos_ids holds 9 ids; at most 8"):
        conveyor._core.Engine(str(STORIES), num_threads=1, eos_ids=list(range(9)))

    def greedy(eos_ids):
        eng = conveyor._core.Engine(str(STORIES), num_threads=1, eos_ids=eos_ids)
        try:
            eng.add_request(1, [1, 403, 407], SamplingParams(temperature=0.0, max_tokens=8))
            while eng.num_unfinished():
                eng.step()
            return [(ev.token, ev.finish_reason) for ev in eng.take_outputs()]
        finally:
            eng.close()

    first = greedy([2])[0][0]
    others = [t for t in range(300, 320) if t != first][:7]
    # all 8 are kept: the last one of them ends the completion at its first token
    assert greedy(others + [first]) == [(first, "stop")]


def test_kv_cache_size_formula(llm):
    """_core.kv_bytes_per_token is the engine's own formula: the pool it made
    is a whole number of blocks of it."""
    st, cfg = llm.stats(), llm.model_config
    per_token = conveyor._core.kv_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"],
                                                  cfg["kv_cache_dtype"])
    assert per_token == 2 * cfg["n_layers"] * cfg["n_kv_heads"] * cfg["head_dim"] * 4  # float32 stories260K
    assert st["kv_cache_bytes"] == st["num_blocks"] * st["block_size"] * per_token


def _with_nan_final_norm(src: Path, dst: Path) -> Path:
    """A copy of an HF folder whose final norm weight is all NaN (a broken checkpoint)."""
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    data = bytearray(st.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    entry = header["model.norm.weight"]
    assert entry["dtype"] == "F32"
    lo, hi = entry["data_offsets"]
    data[8 + n + lo:8 + n + hi] = np.full((hi - lo) // 4, np.nan, np.float32).tobytes()
    st.write_bytes(bytes(data))
    return dst


def test_nan_logits_are_named_not_blamed_on_constraints(tiny_hf_dir, tmp_path):
    model = _with_nan_final_norm(tiny_hf_dir, tmp_path / "nan")
    with LLM(str(model), skip_tokenizer_init=True) as llm, pytest.warns(UserWarning, match="all NaN or -inf"):
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "constraints" not in out.guided_error
