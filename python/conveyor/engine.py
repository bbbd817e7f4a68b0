"""The Python side of the engine, shared by LLM and AsyncLLM.

C owns sequence state; this layer turns prompts into token ids, hands
requests to conveyor._core.Engine, and turns the C engine's per-step events
(token, newly visible text bytes, finish) into RequestOutput objects.
"""
from __future__ import annotations

import codecs
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import _core
from .models import with_weights_dtype
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .request_budget import RequestBudget, request_budget_bytes
from .sampling_params import SamplingParams, field_error
from .speculative import parse_speculative_config, spec_stats
from .token_cache import CachedEncoder

# While sequences decode, a step carries at most this many prompt tokens unless
# max_prefill_tokens_while_decoding says otherwise (the C engine's defaults, by device).
DEFAULT_PREFILL_CAP = {"cpu": _core.DEFAULT_PREFILL_CAP_CPU, "cuda": _core.DEFAULT_PREFILL_CAP_CUDA}
# LLM (offline: generate/chat run a batch to completion, nobody watches a stream) takes no
# cap by default: the cap trades throughput for inter-token latency, which an offline batch
# does not have (docs/dev/study.md, "Offline batches end to end").
OFFLINE_PREFILL_CAP = 0
# LLM's default KV pool: room for this many sequences of max_model_len tokens (at most
# max_num_seqs), as the CLI's pool holds its requests. LLM does not know its workload when
# it is made; four full contexts hold dozens of typical requests at once, and the scheduler
# preempts rather than fails past that. kv_cache_memory or kv_cache_sequences overrides it.
OFFLINE_KV_SEQUENCES = 4

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(value: Any, name: str = "kv_cache_memory") -> int:
    """An int of bytes, or a string such as "4GiB", "512MB" or "1.5 GiB"."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a string such as '4GiB'")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size (examples: 4GiB, 512MB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise TypeError(f"{name} must be an int or a string such as '4GiB', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n


def check_allowed_in_mask(allowed, mask: np.ndarray) -> None:
    """A grammar whose first token may be none of allowed_token_ids: the request could
    only end at once with finish_reason "error", so it is refused now (ValueError,
    .field "allowed_token_ids")."""
    ids = np.asarray([t for t in allowed if 0 <= t < 32 * len(mask)], dtype=np.int64)
    if ids.size and ((mask[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any():
        return
    raise field_error(ValueError, "allowed_token_ids", "none of allowed_token_ids is allowed by the grammar at "
                                                       "the first token: no token could be sampled")


# The error of a completion that ended with finish_reason "error": its constraints
# left no token to sample (the sampler never picks one outside them).
NO_TOKEN_ERROR = "no token satisfies the request's constraints"
NON_FINITE_LOGITS = "the model's logits were all NaN or -inf"


def _constrained(params: SamplingParams) -> bool:
    """Whether a request bans tokens (so that its constraints may leave none)."""
    return bool(params.allowed_token_ids is not None or params.bad_words or params.min_tokens or
                params.guided_decoding is not None or params.logit_bias)


MAX_MODEL_LEN = 1 << 24  # the largest max_model_len an engine takes


def check_context_fits(model_cfg: dict) -> None:
    """Without max_model_len the engine sizes itself for the model's whole context
    (GGUF context_length, max_position_embeddings): one that cannot fit (its KV cache
    for one sequence is over this machine's memory) is a ValueError naming
    max_model_len, the fix, instead of an allocation failure deep in the engine."""
    ctx = int(model_cfg["max_pos"])
    kv_per_token = 2 * model_cfg["n_layers"] * model_cfg["n_kv_heads"] * model_cfg["head_dim"] * 2  # K+V, 2 bytes
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        memory = 1 << 40
    if ctx > MAX_MODEL_LEN or ctx * kv_per_token > memory:
        raise field_error(ValueError, "max_model_len",
                          f"the model's context length is {ctx} tokens, which cannot fit (at most "
                          f"{MAX_MODEL_LEN} tokens, and a KV cache of {ctx * kv_per_token} bytes for one "
                          f"sequence against {memory} bytes of memory); pass max_model_len "
                          f"(e.g. max_model_len=4096, --max-model-len 4096) to use less of it")


def check_timeout(t) -> float:
    """A request deadline in seconds from arrival, as the C engine takes it (0.0: none).
    The C engine checks the range; 0 is refused here, since C reads it as "none"."""
    if t is None:
        return 0.0
    if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise field_error(TypeError, "timeout", f"timeout must be a number of seconds or None, "
                                                f"got {type(t).__name__}")
    if t == 0:
        raise field_error(ValueError, "timeout", "timeout must be > 0 seconds (None: no deadline), got 0")
    return float(t)


def check_priority(p) -> int:
    """A request priority: an int in the int32 range (lower runs first)."""
    if not isinstance(p, (int, np.integer)) or isinstance(p, bool):
        raise field_error(TypeError, "priority", f"priority must be an int, got {type(p).__name__}")
    if not -(1 << 31) <= p < (1 << 31):
        raise field_error(ValueError, "priority", f"priority must be in [-2**31, 2**31), got {p}")
    return int(p)


@dataclass
class EngineArgs:
    model: str
    tokenizer: Optional[str] = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    kv_cache_memory: Any = None
    # The default pool (kv_cache_memory None) holds this many sequences of max_model_len
    # tokens, at most max_num_seqs, capped by a share of free memory. None: max_num_seqs.
    kv_cache_sequences: Optional[int] = None
    kv_cache_dtype: str = "auto"  # auto: the activation dtype; bfloat16 under quantized weights; int8: CPU only
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    num_threads: Optional[int] = None
    device: str = "cpu"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    quantization: Optional[str] = None  # "q8_0" | "q4_0" | "q4_1": quantize the matrices at load
    # GEMM inputs over bf16 weights on the CPU. "auto": rounded to bf16 where the CPU has
    # vdpbf16ps (AVX512_BF16; twice the fp32 FMA rate, as vLLM's and oneDNN's bf16 paths);
    # "float32": exact float32 activations on every CPU (docs/dev/bf16.md: what it costs).
    activation_dtype: str = "auto"
    # Stall-free mixed steps: while sequences decode, a step carries at most this many
    # prompt tokens (chunked prefill only). None: 96 on the CPU (a step's time grows with
    # every token), 512 on CUDA; 0: no cap.
    max_prefill_tokens_while_decoding: Optional[int] = None
    # Admission margin (continuous and priority scheduling): a request starts only when the
    # free KV covers the running requests' and its own growth by this percentage of the
    # expected remaining output (learned from the outputs that ended by a stop; each request's
    # max_tokens until one did), counting on the blocks of requests that reach their max_tokens
    # sooner coming back.
    # None: 50 (chosen by measurement, docs/dev/admission.md); 0: no margin, a request
    # starts whenever its first prompt chunk fits and running ones are preempted when the
    # pool runs out.
    admission_reserve: Optional[int] = None
    # A latency option for CPU serving: where a step's time grows with its rows, admissions
    # stop at the batch where decoding reaches 80% of its rate limit, from a model of the
    # step time fitted as the engine runs (while the model cannot pin that batch down and
    # requests wait, every eighth step holds back half its decodes to time another size):
    # beyond it a larger batch buys little throughput and costs every request latency
    # (docs/dev/admission.md). Where a step's time hardly grows (a GPU) it changes nothing.
    # False (default): only max_num_seqs and the KV cache limit the batch.
    adaptive_batch_limit: bool = False
    # Overload control: a request that would make more than this many wait to be
    # scheduled is refused with EngineOverloadedError. None: no limit.
    max_queued_requests: Optional[int] = None
    # Speculative decoding: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b, "disable_by_batch_size": n}, or a draft
    # model: {"model": PATH, "num_speculative_tokens": k, "disable_by_batch_size": n}. None: off.
    speculative_config: Optional[Any] = None
    # LoRA adapters per request (generate(..., lora_request=LoRARequest(...))): max_loras
    # adapters resident at once (slots; others wait in host memory, swapped in LRU), each
    # of rank at most max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # adapter weights held as "float32" or "bfloat16" (half the bytes per step); "auto": bfloat16
    # over a bf16, f16 or quantized base, float32 over a float32 one
    lora_dtype: str = "auto"

    def resolved_prefill_cap(self) -> int:
        if self.max_prefill_tokens_while_decoding is not None:
            return self.max_prefill_tokens_while_decoding
        return DEFAULT_PREFILL_CAP[self.device]

    @classmethod
    def from_kwargs(cls, model, kwargs: dict) -> "EngineArgs":
        """EngineArgs(model, **kwargs), naming unknown keywords in a TypeError."""
        unknown = set(kwargs) - (set(cls.__dataclass_fields__) - {"model"})
        if unknown:
            raise TypeError(f"unknown keyword argument(s): {', '.join(sorted(unknown))}")
        return cls(model=model, **kwargs)

    def validate(self):
        """Checks every field's type (TypeError naming it in .field) and reads the size
        strings of kv_cache_memory. Ranges and choices are the C engine's to check: it
        reads this object by attribute name when the engine is made."""
        if not isinstance(self.model, (str, os.PathLike)):
            raise field_error(TypeError, "model", f"model must be a path (str or os.PathLike), "
                                                  f"got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
        if not os.path.exists(self.model):
            raise FileNotFoundError(f"model path does not exist: {self.model}")

        def check_type(name, ok, what):
            v = getattr(self, name)
            if not ok(v):
                raise field_error(TypeError, name, f"{name} must be {what}, got {type(v).__name__}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("max_num_seqs", "block_size", "seed", "max_loras", "max_lora_rank"):
            check_type(name, is_int, "an int")
        for name in ("max_model_len", "max_num_batched_tokens", "num_threads", "kv_cache_sequences",
                     "max_prefill_tokens_while_decoding", "max_queued_requests", "admission_reserve"):
            check_type(name, lambda v: v is None or is_int(v), "an int or None")
        for name in ("dtype", "kv_cache_dtype", "scheduling", "device", "activation_dtype", "lora_dtype"):
            check_type(name, lambda v: isinstance(v, str), "a str")
        check_type("quantization", lambda v: v is None or isinstance(v, str), "a str or None")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "skip_tokenizer_init", "enable_lora",
                     "adaptive_batch_limit"):
            check_type(name, lambda v: isinstance(v, bool), "a bool")
        check_type("gpu_memory_utilization", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                   "a number")
        check_type("kv_cache_memory", lambda v: v is None or is_int(v) or isinstance(v, str),
                   "an int or a string such as '4GiB'")
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.enable_lora and isinstance(self.speculative_config, dict) and "model" in self.speculative_config:
            # the draft would propose without the adapter: refused rather than silently slow
            raise field_error(ValueError, "speculative_config",
                              "a draft model cannot be combined with enable_lora (its proposals would not "
                              "follow the adapter); use the n-gram method")


class _SeqState:
    """One completion's output so far. Text arrives as pieces: `parts` (joined only when
    the whole text is asked for) and `unsent` (the pieces not yet in a delta output), so
    that no per-token work grows with the text."""

    __slots__ = ("token_ids", "parts", "unsent", "decoder", "logprobs", "cum_logprob", "finish_reason",
                 "stop_reason", "sent_tokens")

    def __init__(self, want_logprobs: bool, want_cum: bool = False):
        self.token_ids: list[int] = []
        self.parts: list[str] = []
        self.unsent: list[str] = []
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.logprobs = [] if want_logprobs else None
        self.cum_logprob = 0.0 if (want_logprobs or want_cum) else None
        self.finish_reason = None
        self.stop_reason = None
        self.sent_tokens = 0

    def add_text(self, piece: str):
        if piece:
            self.parts.append(piece)
            self.unsent.append(piece)

    @property
    def text(self) -> str:
        parts = self.parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def take_unsent(self) -> str:
        u = self.unsent
        if not u:
            return ""
        text = u[0] if len(u) == 1 else "".join(u)
        u.clear()
        return text


class _StepTurns:
    """Threads stepping one engine take turns. A thread waiting for its turn
    wakes after every step and gives up its wait once its own requests have
    ended in another thread's step: it never waits out a thread that steps on
    for longer requests."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy = False

    def take(self, unfinished=None) -> bool:
        """Waits for the turn; False (no turn taken) once `unfinished` is empty."""
        with self._cond:
            while True:
                if unfinished is not None and not unfinished:
                    return False
                if not self._busy:
                    self._busy = True
                    return True
                self._cond.wait()

    def give(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class _Unfinished:
    """Whether any of a list of requests is still running; each request is
    looked at until it has finished, so a whole run costs linear time."""
    __slots__ = ("_reqs", "_i")

    def __init__(self, requests):
        self._reqs = list(requests)
        self._i = 0

    def __bool__(self) -> bool:
        while self._i < len(self._reqs) and self._reqs[self._i].finished:
            self._i += 1
        return self._i < len(self._reqs)


_PROMPT_KEYS = ("prompt", "prompt_token_ids")  # prompt: the text reported for the ids, if both are given


class _Request:
    __slots__ = ("request_id", "internal_id", "prompt", "prompt_token_ids", "params", "seqs",
                 "finished", "metrics", "consumer", "matchers", "prompt_logprobs", "sent_prompt_lp",
                 "guided_error", "lora", "waiting", "stops")

    def __init__(self, request_id, internal_id, prompt, prompt_ids, params, arrival):
        self.request_id = request_id
        self.internal_id = internal_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.stops = params.stop_strings  # as the C engine took them: a stop's index names one
        # best_of > n: every candidate runs; build_output keeps the n best
        n_run = max(params.n, params.best_of or 0)
        self.seqs = [_SeqState(params.logprobs is not None, n_run > params.n) for _ in range(n_run)]
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.sent_prompt_lp = 0
        self.finished = False
        self.metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(prompt_ids))
        self.consumer = None  # AsyncLLM's per-request queue
        self.matchers = None  # guided decoding: one grammar matcher per completion
        # why the grammar engine ended a completion ("abort"), or why its constraints
        # left no token ("error")
        self.guided_error = None
        self.lora = None     # its LoRARequest, or None: the base model
        self.waiting = None  # (engine args) while it waits for an adapter slot


class EngineCore:
    """Owns the C engine and the per-request Python state."""

    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        self.tokenizer = None
        token_bytes = special = None
        eos_ids: list[int] = []
        bos_id = -1
        strip = False
        # The model first: a wrong path or a broken checkpoint is the problem to report,
        # not a tokenizer that happens to be missing beside it.
        ckpt = _core.Checkpoint(args.model)
        try:
            model_cfg = ckpt.config
        finally:
            ckpt.close()
        if args.max_model_len is None:
            check_context_fits(model_cfg)
        if not args.skip_tokenizer_init:
            from .tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(args.model, args.tokenizer)
            token_bytes = self.tokenizer.all_token_bytes()
            special = sorted(self.tokenizer.special_ids)
            eos_ids = [i for i in (self.tokenizer.eos_ids or []) if i is not None]
            bos_id = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else -1
            strip = bool(self.tokenizer.strip_leading_space_after_bos)
        # C reads the config from args by attribute name and checks every range.
        self._engine = _core.Engine(args, eos_ids=eos_ids, bos_id=bos_id, strip_space_after_bos=strip,
                                    token_bytes=token_bytes, special_ids=special)
        self.model_config = with_weights_dtype(self._engine.model_config(), args.model, args.quantization)
        st = self._engine.stats()
        self.max_model_len = st["max_model_len"]
        self.vocab_size = self.model_config["vocab_size"]
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self._by_name: dict[str, _Request] = {}
        self._next_id = 0
        self._guided = None  # conveyor.guided.GuidedDecoder, built on first use
        self._guided_init = threading.Lock()  # matchers are built on worker threads too
        # A prompt of more bytes than this cannot fit in max_model_len whatever its
        # tokenization (each token covers at most the longest token's bytes; x2 leaves
        # room for normalizers that drop characters), so it is refused before the
        # tokenizer runs: tokenizing megabytes costs seconds.
        longest = max(map(len, token_bytes), default=0) if token_bytes else 0
        self.max_prompt_bytes = 2 * self.max_model_len * max(longest, 4)
        self.request_budget_bytes = request_budget_bytes(self.max_prompt_bytes)
        # Tokenizing runs Python (or holds the GIL in one call): one preparation thread at
        # a time does it, so that the event loop competes with one GIL holder, not two,
        # while the other thread's waits (a grammar, a template worker) go on beside it.
        self._tokenize_lock = threading.Lock()
        # bad words: each distinct word tokenized once, a request's new ones in one call
        self._word_encoder = CachedEncoder(self.tokenizer) if self.tokenizer is not None else None
        self._deferred_masks: list = []  # synchronous stepping: masks the next step computes
        # Synchronous stepping from several threads: one step (with its events and
        # masks) at a time, so the masks a step leaves are the next step's.
        self._turns = _StepTurns()
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, by token id
        self._mask_worker = None  # a thread that computes them while that step runs
        self._lora = None
        if args.enable_lora:
            from .lora_slots import LoRASlots

            self._lora = LoRASlots(self._engine, model_cfg, args.max_loras, args.max_lora_rank)
        self._lora_waiting: list[_Request] = []  # requests whose adapter waits for a slot, in arrival order
        self._ended_waiting: dict[str, int] = {}  # finish reason -> requests that ended while waiting
        self.closed = False

    # -- requests ---------------------------------------------------------
    def tokenize_prompt(self, prompt, exclusive: bool = True) -> tuple[Optional[str], Any]:
        """Returns (prompt text or None, token ids as list or int array). exclusive:
        see encode_prompt."""
        if isinstance(prompt, dict):
            unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
            if unknown:
                raise ValueError(f"a prompt dict takes 'prompt' and 'prompt_token_ids'; unknown key(s) {unknown}"
                                 + (" (this engine runs text-only models)" if any("multi_modal" in k for k in unknown)
                                    else ""))
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was given); "
                                 "pass token ids instead")
            return prompt, self.encode_prompt(prompt, exclusive=exclusive)
        return None, self._check_ids(prompt)

    def encode_prompt(self, text: str, add_special_tokens: bool = True, field: str = "prompt",
                      exclusive: bool = True) -> list:
        """The tokenizer's ids for a prompt text, after a byte-length bound that refuses a
        text too long for max_model_len without tokenizing it (ValueError, .field=field).
        exclusive: one preparation thread at a time; False for a short text tokenized on
        an event loop, which must not wait behind a long one (the tokenizers are
        thread-safe)."""
        self.check_prompt_size(text, field)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise field_error(ValueError, field, f"the {field} holds a lone surrogate at character {e.start}: "
                                                 "not valid Unicode") from None
        if not exclusive:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        with self._tokenize_lock:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_prompt_size(self, text: str, field: str = "prompt") -> None:
        """ValueError (.field=field) for a prompt text too long for max_model_len
        whatever its tokenization; costs no tokenizing."""
        n = len(text)
        if n > self.max_prompt_bytes or len(text.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes:
            raise field_error(ValueError, field, f"the prompt has {n} characters, more than can fit in "
                              f"max_model_len ({self.max_model_len}) tokens of this vocabulary "
                              f"(at most {self.max_prompt_bytes} bytes)")

    def _check_ids(self, ids):
        """Shape and type only: the C engine checks ids against the vocabulary."""
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1:
                raise ValueError(f"a token-id array prompt must be 1-D, got shape {ids.shape}")
            if not np.issubdtype(ids.dtype, np.integer):
                raise TypeError(f"a token-id array prompt must have an integer dtype, got {ids.dtype}")
            if ids.size == 0:
                raise ValueError("the prompt is empty")
            return ids
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"a prompt must be a str, a list of token ids or a NumPy integer array, "
                            f"got {type(ids).__name__}")
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        for t in ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise TypeError(f"token ids must be ints, got {type(t).__name__}")
        return list(ids)

    def check_request(self, prompt_ids, params: SamplingParams) -> None:
        """Raises what add_request would (the C engine's checks: vocabulary,
        context, KV cache, every sampling range), queueing nothing."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        self._check_stops(params)
        engine_params = self.prepare_params(params)
        with self._lock:  # close() waits: the C engine is not freed under the check
            if self.closed:
                raise _core.EngineClosedError("the engine is closed")
            self._engine.check_request(prompt_ids, engine_params)

    def _check_stops(self, params: SamplingParams) -> None:
        if self.tokenizer is None and params.stop_strings:
            # the engine matches stop strings in the tokens' bytes, which come with the tokenizer
            raise field_error(ValueError, "stop", "stop strings need a tokenizer (skip_tokenizer_init=True "
                              "was given); stop_token_ids work without one")

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """The params as the C engine reads them: bad_words tokenized with this engine's
        tokenizer, once, after their bytes are charged against the request budget.
        Work that grows with the request: servers and AsyncLLM.generate call it on a
        preparation worker, and check_request/add_request take its result as it is."""
        if not params.bad_words or params._bad_words_token_ids is not None:
            return params
        RequestBudget(self.request_budget_bytes).charge("bad_words", params.bad_words)
        with self._tokenize_lock:
            return params.with_bad_words_tokenized(self._word_encoder)

    def add_request(self, request_id: Optional[str], prompt_text, prompt_ids, params: SamplingParams,
                    priority: int = 0, consumer=None, timeout: Optional[float] = None,
                    guided=None, lora_request=None) -> _Request:
        """timeout: seconds from arrival; past it the request ends with finish_reason
        "timeout" and its KV blocks return to the pool. guided: prepare_guided(params)'s
        result when the caller built it already (off its event loop)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        timeout_s = check_timeout(timeout)
        self._check_stops(params)
        if guided is None:
            guided = self.prepare_guided(params)  # seconds for a hard grammar: not under the lock
        # prepared already by a server or AsyncLLM.generate; only direct callers pay here,
        # and never under the lock
        engine_params = self.prepare_params(params)
        prompt_list = list(map(int, prompt_ids))
        if lora_request is not None:
            from .lora import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise field_error(TypeError, "lora_request",
                                  f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            if self._lora is None:
                raise field_error(ValueError, "lora_request",
                                  "lora_request needs an engine made with enable_lora=True")
            self._engine.check_request(prompt_ids, engine_params, timeout=timeout_s)
            self.read_lora(lora_request)  # reads the files once; LoRAError names the key
        with self._lock:
            if self.closed:
                raise _core.EngineClosedError("the engine is closed")
            name = str(self._next_id) if request_id is None else request_id
            if name in self._by_name:
                raise ValueError(f"request_id {name!r} is already in use")
            internal = self._next_id
            req = _Request(name, internal, prompt_text, prompt_list, params, time.monotonic())
            req.lora = lora_request
            req.waiting = (prompt_ids, engine_params, priority, timeout_s, guided)
            if self._lora_waiting:  # they count against max_queued_requests too
                self._check_queue_room()
            if lora_request is not None and (self._lora_waiting or not self._submit(req)):
                self._check_queue_room()
                self._lora_waiting.append(req)  # every slot is in use: it waits for one
                self._lora.wait(lora_request.lora_int_id)
            elif lora_request is None:
                self._submit(req)
            self._next_id += 1
            req.consumer = consumer
            self._requests[internal] = req
            self._by_name[name] = req
        return req

    def _check_queue_room(self) -> None:
        """EngineOverloadedError when max_queued_requests requests wait already, those
        waiting here for an adapter slot included (under the lock)."""
        limit = self.args.max_queued_requests
        if limit:
            queued = self._engine.num_queued() + len(self._lora_waiting)
            if queued >= limit:
                raise _core.EngineOverloadedError(
                    f"the engine is overloaded: {queued} requests already wait to be scheduled "
                    f"(max_queued_requests={limit}); retry later")

    def _submit(self, req: _Request, accepted: bool = False) -> bool:
        """Hands a request to the C engine (under the lock), with its adapter's slot;
        False when its adapter cannot get a slot now. accepted: it waited here for a
        slot, counted against the queue then, so a full queue does not refuse it now."""
        slot = -1
        if req.lora is not None:
            slot = self._lora.acquire(req.lora.lora_int_id)
            if slot is None:
                return False
        prompt_ids, engine_params, priority, timeout_s, guided = req.waiting
        if accepted and timeout_s:  # the deadline counts from the call: the wait for a slot is spent
            timeout_s = max(self._deadline(req) - time.monotonic(), 1e-6)
        try:
            self._engine.add_request(req.internal_id, prompt_ids, engine_params, priority=priority,
                                     timeout=timeout_s, lora_slot=slot,
                                     lora_id=req.lora.lora_int_id if req.lora is not None else 0,
                                     accepted=accepted)
        except BaseException:
            if req.lora is not None:
                self._lora.release(req.lora.lora_int_id)
            raise
        req.waiting = None
        if guided is not None:
            req.matchers, first_mask = guided
            for i in range(len(req.matchers)):
                self._engine.set_token_mask(req.internal_id, i, 0, first_mask)
        return True

    def _submit_waiting(self) -> list[_Request]:
        """Requests waiting for an adapter slot, in order, as far as slots allow (under the
        lock); those past their deadline end with "timeout", and one the C engine refuses
        (out of memory) with "abort". Returns the requests that ended."""
        ended = []
        now = time.monotonic()
        for req in [r for r in self._lora_waiting if r.waiting[3] and self._deadline(r) <= now]:
            ended.append(self._end_waiting(req, "timeout"))
        while self._lora_waiting and not self.closed:
            req = self._lora_waiting[0]
            try:
                if not self._submit(req, accepted=True):
                    break
            except Exception as e:  # noqa: BLE001 - the request ends, not the caller's step
                logging.getLogger("conveyor").warning(
                    "request %s could not start after waiting for its adapter: %s", req.request_id, e)
                ended.append(self._end_waiting(req, "abort"))
                continue
            self._lora_waiting.pop(0)
            self._lora.waiter_left(req.lora.lora_int_id)
        return ended

    @staticmethod
    def _deadline(req: _Request) -> float:
        return req.metrics.arrival_time + req.waiting[3]

    def _end_waiting(self, req: _Request, reason: str) -> _Request:
        """Ends a request that waits for an adapter slot (never reached the C engine)."""
        self._lora_waiting.remove(req)
        for st in req.seqs:
            st.finish_reason = reason
        req.finished = True
        req.metrics.finished_time = time.monotonic()
        self._requests.pop(req.internal_id, None)
        if self._by_name.get(req.request_id) is req:
            del self._by_name[req.request_id]
        self._ended_waiting[reason] = self._ended_waiting.get(reason, 0) + 1
        self._lora.count_finished(req.lora.lora_name, 0)
        self._lora.waiter_left(req.lora.lora_int_id)
        return req

    def read_lora(self, lora_request) -> None:
        """Reads and checks an adapter now (LoRAError naming the key), so that requests
        naming it later need no file access. The files are read outside the lock, so
        running requests go on meanwhile."""
        if self._lora is None:
            raise field_error(ValueError, "lora_request", "LoRA needs an engine made with enable_lora=True")
        with self._lock:
            if self._lora.is_read(lora_request):
                return
        adapter = self._lora.load(lora_request)
        with self._lock:
            self._lora.keep(lora_request, adapter)

    @property
    def lora_enabled(self) -> bool:
        return self._lora is not None

    def is_lora_read(self, lora_request) -> bool:
        """Whether a request naming this adapter needs no file access (False for anything
        but a LoRARequest, which add_request then refuses)."""
        from .lora import LoRARequest

        if self._lora is None or not isinstance(lora_request, LoRARequest):
            return False
        with self._lock:
            return self._lora.is_read(lora_request)

    def forget_lora(self, lora_id: int) -> bool:
        """Drops an adapter from its slot and host memory. While requests use it or wait
        for it, False: it is dropped when the last of them ends."""
        if self._lora is None:
            return False
        with self._lock:
            return self._lora.forget(lora_id)

    def prepare_guided(self, params: SamplingParams):
        """Guided decoding: (a grammar matcher per completion that runs, the first
        token's mask), or None when unconstrained. Building them can take seconds for a
        hard grammar (llguidance releases the GIL meanwhile): servers call this on a
        worker thread. A grammar the grammar engine refuses, or gives up on at the first
        token, raises ValueError with .field "guided_decoding"."""
        if params.guided_decoding is None:
            return None
        with self._guided_init:
            if self._guided is None:
                from .guided import GuidedDecoder

                self._guided = GuidedDecoder(self.tokenizer, self.vocab_size)
        n_run = max(params.n, params.best_of or 0)  # best_of: every candidate is constrained
        matchers, mask = self._guided.start(params.guided_decoding, n_run)
        if params.allowed_token_ids is not None:
            check_allowed_in_mask(params.allowed_token_ids, mask)
        return matchers, mask

    def _advance_guided(self, pending) -> None:
        """Each (request, completion, token): the matcher takes the token, and the
        mask for the completion's next position goes to the engine (which, in
        the background loop, is running the next forward pass meanwhile). A
        matcher that fails ends its completion (aborted)."""
        for req, idx, token, pos in pending:
            mask = None
            try:
                m = req.matchers[idx]
                mask = self._guided.mask(m) if m.consume_token(token) else None
                if mask is None and req.guided_error is None:
                    req.guided_error = self._guided.error_of(m, idx, pos)
            finally:  # always post (None ends the completion): the engine may be waiting
                self._engine.set_token_mask(req.internal_id, idx, pos, mask)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            req = self._by_name.get(request_id)
            if self.closed or req is None or req.finished:
                return False
            if req.waiting is not None and req in self._lora_waiting:  # never reached the C engine
                self._end_waiting(req, "abort")
                if req.consumer is not None:  # AsyncLLM's (loop, queue): its last output
                    loop, queue = req.consumer
                    try:
                        out = self.build_output(req, delta=req.params.output_kind == "delta")
                        loop.call_soon_threadsafe(queue.put_nowait, out)
                    except RuntimeError:
                        pass  # that loop is closed
                return True
            self._engine.abort(req.internal_id)
            # The id is free for a new request at once; the old one's last
            # events still find it by its internal id.
            del self._by_name[request_id]
            return True

    def has_unfinished(self) -> bool:
        return self._engine.num_unfinished() > 0 or bool(self._lora_waiting)

    def num_unfinished(self) -> int:
        """Requests queued or running in the C engine, and those waiting for an adapter slot."""
        return self._engine.num_unfinished() + len(self._lora_waiting)

    # -- the loop ---------------------------------------------------------
    def step(self) -> list[_Request]:
        """Runs one engine step (GIL released) and applies its outputs; returns
        the requests that changed. The C engine refuses it (EngineClosedError,
        a RuntimeError) while the background loop runs. Threads that step one
        engine take turns: a step's events are applied, and the guided masks it
        leaves are posted, before the next step starts."""
        return self._step_in_turn()

    def _step_in_turn(self, unfinished=None) -> Optional[list[_Request]]:
        """One step in this thread's turn; None (no step) once `unfinished`, if
        given, has emptied while the thread waited for the turn."""
        if not self._turns.take(unfinished):
            return None
        try:
            return self._step_taken()
        finally:
            self._turns.give()

    def _step_taken(self) -> list[_Request]:
        pending, self._deferred_masks = self._deferred_masks, []
        if not pending:
            self._engine.step()
        else:
            # Guided decoding: the masks for this step's positions are computed
            # on a worker while the forward pass runs; the sampler waits for them.
            if self._mask_worker is None:
                from concurrent.futures import ThreadPoolExecutor

                self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="conveyor-guided")
            fut = self._mask_worker.submit(self._advance_guided, pending)
            try:
                self._engine.step(wait_masks=True)
            finally:
                fut.result()
        return self.process_events(defer_masks=True)

    def run(self, requests, on_step=None) -> None:
        """Steps until every one of `requests` has finished (other threads'
        requests on this engine advance meanwhile, and go on after it returns);
        on_step(changed requests) runs after each step this thread takes.
        Interrupted by any exception (KeyboardInterrupt too), it aborts what is
        left of `requests` and steps until they end, so the engine stays usable."""
        try:
            unfinished = _Unfinished(requests)
            while unfinished:
                changed = self._step_in_turn(unfinished)
                if changed is None:  # another thread's steps ended them
                    break
                if on_step is not None:
                    on_step(changed)
        except BaseException:
            if not self.closed:  # closed underneath (another thread, or the interpreter's exit): nothing to drain
                self.abort_requests(requests)
            elif not threading.main_thread().is_alive():
                # The interpreter is exiting and closed the engine under this daemon thread:
                # the thread ends quietly, as the exit ends any daemon thread, instead of
                # printing a traceback that the shutdown cuts off halfway.
                raise SystemExit from None
            raise

    def abort_requests(self, requests) -> None:
        """Aborts every unfinished request of `requests`, then steps until they
        have ended (synchronous use only)."""
        for r in requests:
            if not r.finished:
                self.abort(r.request_id)
        unfinished = _Unfinished(requests)
        while unfinished and self._step_in_turn(unfinished) is not None:
            pass

    def start_background(self, wake_fd: int) -> None:
        """Hands stepping to the C engine's own thread: after each step with
        outputs it writes an 8-byte 1 to wake_fd; process_events() then applies
        them. From here on step() is refused; close() stops the thread."""
        pending, self._deferred_masks = self._deferred_masks, []
        if pending:
            self._advance_guided(pending)
        self._engine.start_loop(wake_fd)

    def set_trace(self, on: bool) -> None:
        """Records each step's scheduled (request, completion, new tokens) for take_trace()."""
        self._engine.set_trace(on)

    def take_trace(self):
        return self._engine.take_trace()

    # -- outputs ----------------------------------------------------------
    def process_events(self, on_event=None, defer_masks: bool = False) -> list[_Request]:
        """Applies the pending C events; returns the requests that changed.
        on_event(req), if given, runs after each event (streaming snapshots).
        Guided completions' next masks are computed here, or, with defer_masks
        (synchronous stepping), by the next step() while its forward pass runs."""
        changed: dict[int, _Request] = {}
        guided = []
        with self._lock:  # events taken and applied in one turn: a request's tokens stay in order
            events = self._engine.take_outputs()
            for ev in events:  # _core.EngineEvent records
                iid = ev.request_id
                req = self._requests.get(iid)
                if req is None:
                    continue
                if ev.prompt_pos > 0:
                    # a prompt token's logprob (prompt_logprobs), in prompt order
                    if req.prompt_logprobs is not None:
                        req.prompt_logprobs.append(
                            self._logprob_entry(ev.token, ev.logprob, ev.rank, ev.top_logprobs))
                    changed[iid] = req
                    continue
                st = req.seqs[ev.seq_index]
                token = ev.token
                if token >= 0:
                    st.token_ids.append(token)
                    if st.logprobs is not None:
                        st.logprobs.append(self._logprob_entry(token, ev.logprob, ev.rank, ev.top_logprobs))
                    if st.cum_logprob is not None:
                        st.cum_logprob += ev.logprob
                if ev.text:
                    st.add_text(st.decoder.decode(ev.text))
                if req.matchers is not None and token >= 0 and not ev.finished:
                    guided.append((req, ev.seq_index, token, len(st.token_ids)))
                if ev.finished:
                    st.add_text(st.decoder.decode(b"", final=True))
                    st.finish_reason = ev.finish_reason
                    if ev.finish_reason == "error" and req.guided_error is None:
                        where = f"at output token {len(st.token_ids)} of completion {ev.seq_index}"
                        if _constrained(req.params):
                            req.guided_error = (f"{NO_TOKEN_ERROR} {where}: allowed_token_ids, bad_words, "
                                                "min_tokens and the grammar leave none")
                        else:  # nothing banned a token: every logit was NaN or -inf
                            req.guided_error = f"{NON_FINITE_LOGITS} {where} (a broken checkpoint?)"
                    if ev.stop_kind == _core.STOP_TOKEN:
                        st.stop_reason = ev.stop_value
                    elif ev.stop_kind == _core.STOP_STRING:
                        st.stop_reason = req.stops[ev.stop_value]
                m = ev.metrics
                if m is not None:
                    rm = req.metrics
                    rm.first_scheduled_time = m.first_scheduled or None
                    rm.first_token_time = m.first_token or None
                    rm.finished_time = m.finished
                    rm.num_cached_tokens = m.n_cached_prompt
                    req.finished = True
                    if req.lora is not None:
                        self._lora.release(req.lora.lora_int_id)
                        self._lora.count_finished(req.lora.lora_name, sum(len(s.token_ids) for s in req.seqs))
                    del self._requests[iid]
                    if self._by_name.get(req.request_id) is req:
                        del self._by_name[req.request_id]
                changed[iid] = req
                if on_event is not None:
                    on_event(req)
            if self._lora_waiting:
                for req in self._submit_waiting():
                    changed[req.internal_id] = req
                    if on_event is not None:
                        on_event(req)
            if guided and defer_masks:
                self._deferred_masks.extend(guided)
                guided = None
        if guided:
            # after the lock: a mask can take a grammar's whole fuel (a second), and
            # add_request/check_request on the event loop must not wait for it
            self._advance_guided(guided)
        return list(changed.values())

    def _logprob_entry(self, token: int, logprob: float, rank: Optional[int], top) -> dict:
        """{token: Logprob} for the chosen token, then the top alternatives with their ranks."""
        text = self._token_text
        entry = {token: Logprob(logprob, rank, text(token))}
        for place, (tid, lp) in enumerate(top or (), start=1):
            if tid != token:
                entry[tid] = Logprob(lp, place, text(tid))
        return entry

    def _token_text(self, tid: int) -> Optional[str]:
        """A token's own text (its bytes as UTF-8, a partial character replaced), or None
        without a tokenizer."""
        if self.tokenizer is None:
            return None
        t = self._token_texts.get(tid)
        if t is None:
            t = self.tokenizer.token_bytes(tid).decode("utf-8", errors="replace")
            if len(self._token_texts) < 1_000_000:
                self._token_texts[tid] = t
        return t

    @staticmethod
    def build_output(req: _Request, delta: bool = False) -> RequestOutput:
        outs = []
        seqs = list(enumerate(req.seqs))
        n = req.params.n
        if len(seqs) > n:
            # best_of: the n candidates with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda p: -p[1].cum_logprob)[:n]
        for i, (_, st) in enumerate(seqs):
            if delta:
                toks = st.token_ids[st.sent_tokens:]
                text = st.take_unsent()
                lps = st.logprobs[st.sent_tokens:] if st.logprobs is not None else None
                st.sent_tokens = len(st.token_ids)
            else:
                st.unsent.clear()
                toks, text = list(st.token_ids), st.text
                lps = list(st.logprobs) if st.logprobs is not None else None
            outs.append(CompletionOutput(i, text, toks, st.cum_logprob, lps, st.finish_reason,
                                         st.stop_reason))
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                            req.metrics, guided_error=req.guided_error)
        if req.prompt_logprobs is not None:
            # delta: only the prompt positions not sent yet
            start = req.sent_prompt_lp if delta else 0
            out.prompt_logprobs = req.prompt_logprobs[start:]
            if delta:
                req.sent_prompt_lp = len(req.prompt_logprobs)
        return out

    def stats(self) -> dict:
        """The C engine's figures; with speculative decoding, the proposals
        verified and accepted by position (lists of num_speculative_tokens) and
        the acceptance rate at each position."""
        st = self._engine.stats()
        spec = self.args.speculative_config
        st.update(spec_stats(st, spec["num_speculative_tokens"] if spec else 0))
        if self._lora is not None:
            with self._lock:
                st.update(self._lora.stats(len(self._lora_waiting)))
                # requests that ended while they waited for a slot never reached the C engine
                st["requests_aborted"] = st.get("requests_aborted", 0) + self._ended_waiting.get("abort", 0)
                st["requests_timed_out"] = st.get("requests_timed_out", 0) + self._ended_waiting.get("timeout", 0)
        return st

    def aborted_before_start(self, request_id: str, prompt_text, prompt_ids, params: SamplingParams) -> RequestOutput:
        """The last output of a request aborted before it reached the engine (while it was
        prepared): every completion empty, ended "abort"."""
        req = _Request(request_id, -1, prompt_text, list(map(int, prompt_ids)), params, time.monotonic())
        for st in req.seqs:
            st.finish_reason = "abort"
        req.finished = True
        req.metrics.finished_time = req.metrics.arrival_time
        return self.build_output(req)

    def fail_pending(self) -> list[_Request]:
        """After close: marks every request still in flight aborted and returns them."""
        with self._lock:
            pending = list(self._requests.values())
            self._requests.clear()
            self._by_name.clear()
        for req in pending:
            for st in req.seqs:
                if st.finish_reason is None:
                    st.finish_reason = "abort"
            req.finished = True
        return pending

    def close(self):
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._engine.stop_loop()
        self._engine.close()
        if self._mask_worker is not None:
            self._mask_worker.shutdown(wait=True)


class EngineFrontend:
    """What LLM and AsyncLLM share: the core, its tokenizer, stats and closing.
    Subclasses set self._core and self._finalizer (which closes everything)."""

    _core: EngineCore

    @property
    def tokenizer(self):
        return self._core.tokenizer

    def get_tokenizer(self):
        return self._core.tokenizer

    @property
    def model_config(self) -> dict:
        """The model's shape and the prepared weights' size and dtypes."""
        return dict(self._core.model_config)

    @property
    def closed(self) -> bool:
        return self._core.closed

    def check_prompt_size(self, text: str) -> None:
        """ValueError (.field "prompt") for a prompt text too long for max_model_len
        whatever its tokenization; costs no tokenizing."""
        self._core.check_prompt_size(text)

    @property
    def request_budget_bytes(self) -> int:
        """The byte budget of one request (conveyor.request_budget): the most prompt
        text the context takes, and 256 KiB for every other field."""
        return self._core.request_budget_bytes

    def prepare_params(self, sampling_params: SamplingParams) -> SamplingParams:
        """sampling_params as the engine reads them (bad_words tokenized once, within
        the request budget): pass the result to check_request/add_request so that
        neither tokenizes again. Grows with the request: run it off an event loop."""
        return self._core.prepare_params(sampling_params)

    def check_request(self, prompt_token_ids, sampling_params: SamplingParams) -> None:
        """Raises what generate would refuse this prompt (token ids) and
        SamplingParams with: ValueError/TypeError whose .field names the field
        ("prompt" for the prompt). Queues nothing."""
        self._core.check_request(prompt_token_ids, sampling_params)

    def num_unfinished(self) -> int:
        """Requests queued or running."""
        return self._core.num_unfinished()

    @property
    def max_queued_requests(self) -> Optional[int]:
        """The engine's queue limit (None: unbounded)."""
        return self._core.args.max_queued_requests or None

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list:
        """A prompt text's token ids; a text too long for max_model_len is refused
        (ValueError, .field "prompt") before the tokenizer runs."""
        if self._core.tokenizer is None:
            raise field_error(ValueError, "prompt", "text prompts need a tokenizer (skip_tokenizer_init=True "
                                                    "was given); pass token ids instead")
        return self._core.encode_prompt(text, add_special_tokens)

    def stats(self) -> dict:
        """Engine statistics: queue sizes, KV blocks, prefix-cache hits, timings."""
        return self._core.stats()

    def settings(self) -> dict:
        """The engine's settings as given and completed with their defaults
        (EngineArgs as a dict)."""
        return dict(vars(self._core.args))

    def set_step_trace(self, on: bool) -> None:
        """Turns the engine's step trace on or off: when on, every step records
        its scheduled sequences for take_step_trace(); off, it records nothing."""
        self._core.set_trace(on)

    def take_step_trace(self) -> list:
        """The steps recorded since the last call: (step, t0, t1, internal request id,
        completion index, new tokens, of them prompt tokens) per scheduled sequence."""
        return self._core.take_trace()

    def close(self):
        """Frees the engine; requests still in flight end as aborted. Safe to call twice."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
