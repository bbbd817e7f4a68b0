"""LLM: offline batched generation (vLLM's LLM class, same names)."""
from __future__ import annotations

import copy
import time
import warnings
import weakref
from typing import Optional, Sequence, Union

import numpy as np

from ._core import EngineClosedError
from .engine import (OFFLINE_KV_SEQUENCES, OFFLINE_PREFILL_CAP, EngineArgs, EngineCore, EngineFrontend,
                     check_priority, check_timeout)
from .models import resolve_model
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def normalize_prompts(prompts) -> list:
    """A str, a list of str, a list of token ids, a NumPy int array, or a list of those."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            if prompts.shape[0] == 0:
                raise ValueError("prompts is empty")
            return list(prompts)
        raise ValueError(f"a prompt array must be 1-D or 2-D, got shape {prompts.shape}")
    if isinstance(prompts, (list, tuple)):
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        if all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of str, token ids or NumPy integer arrays, "
                    f"got {type(prompts).__name__}")


def _progress_bar_class():
    """tqdm's notebook widget where it can draw (Jupyter with ipywidgets), else the plain
    text bar: tqdm.auto without ipywidgets warns "IProgress not found" and shows nothing."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        from tqdm import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm


class LLM(EngineFrontend):
    """Generates text for batches of prompts with continuous batching.

    >>> llm = LLM()                        # the default model, SmolLM2-135M-Instruct (fetched once)
    >>> llm = LLM("stories260K")           # a built-in name (conveyor.models), or a path:
    >>> llm = LLM("path/to/model")         # an HF folder, a .gguf file or a llama2.c .bin
    >>> llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    """

    def __init__(self, model=None, **kwargs):
        # offline default: no prefill cap (a latency knob for watched streams; AsyncLLM and
        # the server keep it)
        kwargs.setdefault("max_prefill_tokens_while_decoding", OFFLINE_PREFILL_CAP)
        kwargs.setdefault("kv_cache_sequences", OFFLINE_KV_SEQUENCES)
        self._core = EngineCore(EngineArgs.from_kwargs(resolve_model(model), kwargs))
        self._finalizer = weakref.finalize(self, EngineCore.close, self._core)

    def generate(self, prompts, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 *, use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 timeout: Optional[float] = None, lora_request=None) -> list[RequestOutput]:
        """timeout: seconds from the call for each request; a request still running then
        ends with finish_reason "timeout", keeping what it generated, and its KV blocks
        return to the pool (the others go on).
        lora_request: a LoRARequest for every prompt, or a list of one (or None) per prompt
        (an engine made with enable_lora=True)."""
        core = self._core
        if core.closed:
            raise EngineClosedError("the LLM is closed")
        items = normalize_prompts(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(items)} prompts")
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        if priority is not None:
            if not isinstance(priority, (list, tuple)) and not hasattr(priority, "__array__"):
                raise TypeError(f"priority must be a list of ints, one per prompt, got {type(priority).__name__}")
            if len(priority) != len(items):
                raise ValueError(f"got {len(priority)} priorities for {len(items)} prompts")
            for p in priority:
                check_priority(p)
        check_timeout(timeout)
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(items):
                raise ValueError(f"got {len(lora_request)} lora_requests for {len(items)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(items)
        # Everything is validated before anything is queued; bad words are tokenized once.
        prepared: dict = {}  # one SamplingParams given for every prompt is prepared once
        for p in params:
            if id(p) not in prepared:
                prepared[id(p)] = core.prepare_params(p)
        params = [prepared[id(p)] for p in params]
        encoded = [core.tokenize_prompt(p) for p in items]
        for (_, ids), p in zip(encoded, params):
            core.check_request(ids, p)

        reqs = []
        try:
            for i, ((text, ids), p) in enumerate(zip(encoded, params)):
                reqs.append(core.add_request(None, text, ids, p,
                                             priority=priority[i] if priority is not None else 0,
                                             timeout=timeout, lora_request=loras[i]))
        except BaseException:
            core.abort_requests(reqs)
            raise
        self._run(reqs, use_tqdm)
        outs = [EngineCore.build_output(r) for r in reqs]
        for o in outs:  # the other prompts' results stand; this one's is said, not silent
            if o.guided_error:
                ended = sorted({c.finish_reason for c in o.outputs if c.finish_reason in ("abort", "error")})
                how = " or ".join(repr(r) for r in ended) or "early"
                warnings.warn(f"request {o.request_id}: {o.guided_error} (its completion ended {how}; "
                              "RequestOutput.guided_error)", UserWarning, stacklevel=2)
        return outs

    def _run(self, reqs, use_tqdm: bool):
        core = self._core
        if not use_tqdm:
            core.run(reqs)
            return
        tqdm = _progress_bar_class()

        t0, tokens0 = time.perf_counter(), core.stats()["generation_tokens"]  # the engine's count runs on across calls
        with tqdm(total=len(reqs), desc="Processed prompts", unit="req", dynamic_ncols=True) as bar:
            own = {id(r) for r in reqs}  # this call's requests only: other threads may share the engine
            counted: set = set()

            def on_step(changed):
                el = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{(core.stats()['generation_tokens'] - tokens0) / el:.1f} tok/s", refresh=False)
                done = [id(r) for r in changed if r.finished and id(r) in own and id(r) not in counted]
                if done:
                    counted.update(done)
                    bar.update(len(done))

            core.run(reqs, on_step)
            bar.update(len(reqs) - bar.n)  # the last ones may have ended in another thread's step

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None, timeout: Optional[float] = None,
             lora_request=None) -> list[RequestOutput]:
        """Applies a chat template to one conversation (a list of {"role", "content"}
        dicts) or a list of conversations, then generates. The template is
        ``chat_template`` (a Jinja template string) if given, else the tokenizer's. A
        model without one (a base model, llama2.c) gets a plain "role: content" format
        it was never trained on: that works but warns, once per LLM. lora_request: as
        in generate(), one for every conversation or a list of one per conversation."""
        tok = self._core.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was given)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts")
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template.strip():
                raise ValueError("chat_template must be a non-empty Jinja template string")
            tok = copy.copy(tok)
            tok.chat_template = chat_template
        has_template = bool(getattr(tok, "chat_template", None))
        if not has_template and not getattr(self, "_warned_no_chat_template", False):
            self._warned_no_chat_template = True
            warnings.warn("this model has no chat template: LLM.chat formats the conversation as plain "
                          "'role: content' lines, which the model was not trained on; pass "
                          "chat_template=... or use generate() for a base model", UserWarning, stacklevel=2)
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [chat_prompt(tok, conv, add_generation_prompt, self.encode_prompt, warn=False) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, timeout=timeout,
                             lora_request=lora_request)


def chat_prompt(tok, conv, add_generation_prompt: bool = True, encode=None, warn: bool = True) -> dict:
    """One conversation (a list of {"role", "content"} dicts) as a prompt dict, through the
    tokenizer's chat template. encode(text, add_special_tokens): the tokenizing to use (an
    engine's encode_prompt, with its length bound); tok.encode by default. warn: the
    tokenizer's warning for a model without a template (LLM.chat gives its own)."""
    for msg in conv:
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError("each chat message must be a dict with 'role' and 'content'")
    text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt,
                                   warn_without_template=warn)
    encode = encode or tok.encode
    return {"prompt": text, "prompt_token_ids": encode(text, not getattr(tok, "chat_template", None))}

