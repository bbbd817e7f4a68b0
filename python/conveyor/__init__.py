"""Conveyor: an LLM inference engine with a C core.

Continuous batching (iteration-level scheduling) over a paged KV cache.
"""
from ._core import (  # noqa: F401
    ConveyorError,
    EngineClosedError,
    ModelFormatError,
    UnsupportedError,
)

__version__ = "0.1.0"
