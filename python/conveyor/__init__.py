"""Conveyor: an LLM inference engine with a C core.

Continuous batching (iteration-level scheduling) over a paged KV cache.

    from conveyor import LLM, SamplingParams
    llm = LLM("model_dir_or_llama2c.bin")
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))

The names below load on first use (PEP 562), so `import conveyor` and the `conveyor`
command start without NumPy and the C extension: a Ctrl-C while a command starts up
lands inside the command's own handler instead of in an import.
"""
from __future__ import annotations

import importlib

from ._version import __version__  # noqa: F401

_EXPORTS = {
    "LLM": "llm", "AsyncLLM": "async_llm", "SamplingParams": "sampling_params",
    "GuidedDecodingParams": "guided", "RequestOutput": "outputs", "CompletionOutput": "outputs",
    "RequestMetrics": "outputs", "Logprob": "outputs", "ConveyorError": "_core",
    "EngineClosedError": "_core", "EngineOverloadedError": "_core", "EngineBusyError": "_core",
    "ModelFormatError": "_core",
    "UnsupportedError": "_core",
    "LoRARequest": "lora", "LoRAError": "lora",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):  # a submodule (conveyor._core, conveyor.testing, ...)
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
