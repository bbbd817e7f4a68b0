"""Optional dependencies and the extra that installs each: a missing one is named with
the command that brings it (pip install "conveyor[bench]"), never a ModuleNotFoundError.
The extras themselves are defined in pyproject.toml."""
from __future__ import annotations

import importlib
from typing import Optional

from ._core import ConveyorError

# top-level module -> the extra that installs it
EXTRA_OF = {
    "matplotlib": "bench", "aiohttp": "bench", "httpx": "bench",
    "starlette": "server", "uvicorn": "server", "httptools": "server",
    "ray": "ray", "fastapi": "ray",
    "torch": "peers", "transformers": "peers", "gguf": "peers", "accelerate": "peers",
}


class MissingDependency(ConveyorError, RuntimeError):
    """An optional module that is not installed; the message says how to install it."""


def missing(module: str, purpose: str) -> MissingDependency:
    top = module.partition(".")[0]
    extra = EXTRA_OF.get(top)
    how = f'pip install "conveyor[{extra}]"' if extra else f"pip install {top}"
    return MissingDependency(f"{purpose} needs {top}, which is not installed: {how}")


def require(module: str, purpose: str):
    """The module, imported; MissingDependency when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if getattr(e, "name", None) and module.startswith(e.name.partition(".")[0]):
            raise missing(module, purpose) from None
        raise


def explain(e: ImportError, purpose: str) -> Optional[MissingDependency]:
    """The MissingDependency an ImportError of an optional module stands for, else None."""
    name = getattr(e, "name", None)
    if isinstance(e, ModuleNotFoundError) and name and name.partition(".")[0] in EXTRA_OF:
        return missing(name, purpose)
    return None
