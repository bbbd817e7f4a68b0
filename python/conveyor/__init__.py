"""Conveyor: an LLM inference engine with a C core.

Continuous batching (iteration-level scheduling) over a paged KV cache.

    from conveyor import LLM, SamplingParams
    llm = LLM("model_dir_or_llama2c.bin")
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
"""
from ._core import (  # noqa: F401
    ConveyorError,
    EngineClosedError,
    EngineOverloadedError,
    ModelFormatError,
    UnsupportedError,
)
from .async_llm import AsyncLLM  # noqa: F401
from .llm import LLM  # noqa: F401
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: F401
from .sampling_params import SamplingParams  # noqa: F401

from ._version import __version__  # noqa: F401

__all__ = [
    "LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
    "Logprob", "ConveyorError", "EngineClosedError", "EngineOverloadedError", "ModelFormatError", "UnsupportedError",
]
