"""The engine config crosses into C by attribute name: C is the one authority on
ranges (each error names its field in .field), Python checks types only, and a
call the background loop owns is refused with EngineBusyError."""
from __future__ import annotations

import math
import os
import types
from pathlib import Path

import pytest

import conveyor
from conveyor import LLM, SamplingParams
from conveyor.engine import EngineArgs
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} not found")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 0}

# (field, value, the error's text): values of the right type that C refuses
RANGE_CASES = [
    ("num_threads", 0, "num_threads must be in [1, 1024], got 0"),
    ("num_threads", 1025, "num_threads must be in [1, 1024], got 1025"),
    ("max_model_len", 0, "max_model_len must be in [1, 16777216], got 0"),
    ("max_model_len", (1 << 24) + 1, "max_model_len must be in [1, 16777216]"),
    ("max_model_len", 513, "max_model_len 513 exceeds the model's context of 512 tokens"),
    ("max_num_seqs", 0, "max_num_seqs must be in [1, 65536], got 0"),
    ("max_num_seqs", 65537, "max_num_seqs must be in [1, 65536], got 65537"),
    ("max_num_seqs", 1 << 63, "max_num_seqs is out of range"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be in [1, 16777216], got 0"),
    ("max_num_batched_tokens", -5, "max_num_batched_tokens must be in [1, 16777216], got -5"),
    ("block_size", 0, "block_size must be in [1, 1024], got 0"),
    ("block_size", 1025, "block_size must be in [1, 1024], got 1025"),
    ("kv_cache_memory", 0, "kv_cache_memory must be positive"),
    ("kv_cache_memory", -(1 << 40), "kv_cache_memory must be positive"),
    ("kv_cache_sequences", 0, "kv_cache_sequences must be in [1, 65536], got 0"),
    ("kv_cache_sequences", 65537, "kv_cache_sequences must be in [1, 65536], got 65537"),
    ("gpu_memory_utilization", 0.0, "gpu_memory_utilization must be in (0, 1], got 0"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ("gpu_memory_utilization", math.nan, "gpu_memory_utilization must be in (0, 1], got nan"),
    ("max_prefill_tokens_while_decoding", -1, "max_prefill_tokens_while_decoding must be in [0, 16777216], got -1"),
    ("max_queued_requests", -1, "max_queued_requests must be in [0, 1073741824], got -1"),
    ("max_queued_requests", (1 << 30) + 1, "max_queued_requests must be in [0, 1073741824]"),
    ("seed", -1, "seed must be in [0, 2**64)"),
    ("seed", 1 << 64, "seed must be in [0, 2**64)"),
    ("dtype", "int8", "dtype must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'int8'"),
    ("kv_cache_dtype", "int4", "kv_cache_dtype must be one of"),
    ("quantization", "q2_k", "quantization must be one of ('q8_0', 'q4_0', 'q4_1', None), got 'q2_k'"),
    ("scheduling", "random", "scheduling must be one of ('continuous', 'static', 'priority', 'fcfs'), got 'random'"),
    ("device", "tpu", "device must be one of ('cpu', 'cuda'), got 'tpu'"),
    ("activation_dtype", "bfloat16", "activation_dtype must be one of ('auto', 'float32')"),
]

# (key, value, text) inside speculative_config (n-gram unless "model" is given)
SPEC_RANGE_CASES = [
    ("num_speculative_tokens", 0, "num_speculative_tokens must be in [1, 16], got 0"),
    ("num_speculative_tokens", 17, "num_speculative_tokens must be in [1, 16], got 17"),
    ("prompt_lookup_min", 0, "prompt_lookup_min must be in [1, 64], got 0"),
    ("prompt_lookup_max", 65, "prompt_lookup_max must be in [1, 64], got 65"),
    ("prompt_lookup_min", 5, "prompt_lookup_min (5) must be <= prompt_lookup_max (3)"),
    ("disable_by_batch_size", -1, "disable_by_batch_size must be >= 0"),
]


def _raises_field(exc, field, text, fn, *args, **kw):
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert getattr(info.value, "field", None) == field, (field, info.value)
    assert text in str(info.value)
    return info.value


@pytest.mark.parametrize("field,value,text", RANGE_CASES, ids=[f"{c[0]}={c[1]!r}" for c in RANGE_CASES])
def test_range_error_names_its_field(field, value, text):
    """Through LLM (EngineArgs read by attribute) and through the C engine's own
    constructor (a path and keyword fields): the same error from the same check."""
    kw = {"num_threads": 1, field: value}
    EngineArgs(model=str(STORIES), **kw).validate()  # Python's type checks pass it: only C judges the value
    _raises_field(ValueError, field, text, LLM, str(STORIES), **kw)
    _raises_field(ValueError, field, text, conveyor._core.Engine, str(STORIES), **kw)


@pytest.mark.parametrize("key,value,text", SPEC_RANGE_CASES, ids=[f"{c[0]}={c[1]!r}" for c in SPEC_RANGE_CASES])
def test_speculative_range_error_names_its_key(key, value, text):
    spec = dict(NGRAM, **{key: value})
    _raises_field(ValueError, key, text, LLM, str(STORIES), num_threads=1, speculative_config=spec)
    _raises_field(ValueError, key, text, conveyor._core.Engine, str(STORIES), num_threads=1,
                  speculative_config=spec)


@pytest.mark.parametrize("field,value", [
    ("max_num_seqs", 1.5), ("max_num_seqs", True), ("block_size", "16"), ("seed", None), ("seed", 2.0),
    ("max_model_len", "512"), ("num_threads", 1.0), ("max_num_batched_tokens", [8]),
    ("max_prefill_tokens_while_decoding", 0.5), ("max_queued_requests", False),
    ("dtype", None), ("kv_cache_dtype", 8), ("scheduling", b"static"), ("device", 0), ("activation_dtype", None),
    ("quantization", 4), ("enable_prefix_caching", 1), ("enable_chunked_prefill", "yes"),
    ("skip_tokenizer_init", None), ("gpu_memory_utilization", "0.5"), ("gpu_memory_utilization", True),
    ("kv_cache_memory", 1.5), ("kv_cache_memory", True), ("kv_cache_sequences", 2.0),
])
def test_python_rejects_types_naming_the_field(field, value):
    e = _raises_field(TypeError, field, field, EngineArgs(model=str(STORIES), **{field: value}).validate)
    assert type(value).__name__ in str(e)


@pytest.mark.parametrize("field,value,text", [
    ("block_size", "16", "block_size must be an int, got str"),
    ("max_model_len", 1.5, "max_model_len must be an int or None, got float"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be a bool, got int"),
    ("gpu_memory_utilization", "x", "gpu_memory_utilization must be a number, got str"),
    ("dtype", 3, "dtype must be a str, got int"),
    ("quantization", 3, "quantization must be a str or None, got int"),
    ("seed", -0.5, "seed must be an int, got float"),
    ("model", 12, "model must be a path (str or os.PathLike), got int"),
])
def test_c_reader_rejects_types_naming_the_field(field, value, text):
    """The C engine's reader converts types only, and says which field has the wrong one,
    for callers that hand it an object of their own."""
    args = types.SimpleNamespace(model=str(STORIES), num_threads=1)
    setattr(args, field, value)
    _raises_field(TypeError, field, text, conveyor._core.Engine, args)


@pytest.mark.parametrize("spec,exc,field,text", [
    (dict(NGRAM, num_speculative_tokens="3"), TypeError, "num_speculative_tokens",
     "num_speculative_tokens must be an int, got str"),
    (dict(NGRAM, method="beam"), ValueError, "method", "method must be one of ('ngram', 'draft_model')"),
    (dict(NGRAM, lookahead=2), ValueError, "lookahead", "unknown key 'lookahead'"),
    ({"model": 5, "num_speculative_tokens": 2, "disable_by_batch_size": 0}, TypeError, "model",
     "model must be a path"),
    ("ngram", TypeError, "speculative_config", "speculative_config must be a dict or None, got str"),
])
def test_c_reader_speculative_config(spec, exc, field, text):
    _raises_field(exc, field, text, conveyor._core.Engine, str(STORIES), num_threads=1, speculative_config=spec)


def test_speculative_types_rejected_in_python():
    _raises_field(TypeError, "prompt_lookup_max", "prompt_lookup_max must be an int",
                  EngineArgs(model=str(STORIES), speculative_config=dict(NGRAM, prompt_lookup_max=2.0)).validate)


def test_unknown_keyword_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        conveyor._core.Engine(str(STORIES), max_num_seq=4)


def test_config_read_by_attribute():
    """Any object with EngineArgs' attribute names is a config; a keyword overrides one
    of its fields; fields it lacks keep EngineArgs' defaults. The engine reports the
    values it took."""
    args = types.SimpleNamespace(model=os.fspath(STORIES), num_threads=1, block_size=8, max_num_seqs=3,
                                 max_model_len=128, max_num_batched_tokens=None, kv_cache_memory=1 << 20)
    eng = conveyor._core.Engine(args, max_num_seqs=5)
    try:
        st = eng.stats()
        assert (st["block_size"], st["max_num_seqs"], st["max_model_len"]) == (8, 5, 128)
        assert abs(st["kv_cache_bytes"] - (1 << 20)) < (1 << 20) // 50  # the cache as asked, to its layout
        assert st["max_num_batched_tokens"] == 2048  # None: the default
    finally:
        eng.close()
    defaults = EngineArgs(model=str(STORIES))
    eng = conveyor._core.Engine(str(STORIES), num_threads=1)
    try:
        st = eng.stats()
        assert (st["block_size"], st["max_num_seqs"]) == (defaults.block_size, defaults.max_num_seqs)
    finally:
        eng.close()


def _pool_tokens(llm):
    st = llm.stats()
    return st["num_blocks"] * st["block_size"]


def test_default_pool_holds_full_length_sequences():
    """Without kv_cache_memory the pool holds kv_cache_sequences sequences of
    max_model_len tokens (never more than max_num_seqs): LLM asks for four, the engine's
    own default is max_num_seqs. The pool is counted in whole blocks, plus the few
    blocks the engine keeps beyond one sequence's need."""
    full = 128
    cases = [({}, 4), ({"kv_cache_sequences": 2}, 2), ({"max_num_seqs": 3}, 3),
             ({"kv_cache_sequences": 10, "max_num_seqs": 6}, 6)]
    for kw, seqs in cases:
        with LLM(str(STORIES), num_threads=1, block_size=8, max_model_len=full, **kw) as llm:
            assert seqs * full <= _pool_tokens(llm) <= seqs * full + 8, (kw, _pool_tokens(llm))
    eng = conveyor._core.Engine(str(STORIES), num_threads=1, block_size=8, max_model_len=full, max_num_seqs=5)
    try:
        st = eng.stats()
        assert 5 * full <= st["num_blocks"] * 8 <= 5 * full + 8
    finally:
        eng.close()


def test_engine_args_fields_reach_the_engine():
    llm = LLM(str(STORIES), num_threads=1, block_size=32, max_num_seqs=7, max_model_len=256,
              max_num_batched_tokens=300, seed=2**64 - 1)
    try:
        st = llm._core._engine.stats()
        assert (st["block_size"], st["max_num_seqs"], st["max_model_len"], st["max_num_batched_tokens"]) == \
            (32, 7, 256, 300)
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_busy_error_while_the_loop_runs():
    """A call the background loop owns raises EngineBusyError (still a RuntimeError);
    a closed engine still raises EngineClosedError."""
    assert conveyor.EngineBusyError is conveyor._core.EngineBusyError
    assert issubclass(conveyor.EngineBusyError, conveyor.ConveyorError)
    assert issubclass(conveyor.EngineBusyError, RuntimeError)
    assert not issubclass(conveyor.EngineBusyError, conveyor.EngineClosedError)
    eng = conveyor._core.Engine(str(STORIES), num_threads=1)
    rfd, wfd = os.pipe()
    try:
        eng.start_loop(wfd)
        with pytest.raises(conveyor.EngineBusyError, match="while its background loop runs"):
            eng.step()
        with pytest.raises(conveyor.EngineBusyError, match="while its background loop runs"):
            eng.check_invariants()
        with pytest.raises(conveyor.EngineBusyError, match="already running"):
            eng.start_loop(wfd)
        eng.stop_loop()
        assert eng.step() == 0
    finally:
        eng.close()
        os.close(rfd)
        os.close(wfd)
    with pytest.raises(conveyor.EngineClosedError):
        eng.step()
