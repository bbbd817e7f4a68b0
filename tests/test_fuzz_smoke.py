"""Fuzzing in CI: a short libFuzzer smoke run of every target, the regression
corpus replayed under ASan/UBSan, and a hypothesis fuzz of the llama2.c tokenizer
loader (which is Python, so it has no libFuzzer target).

tools/fuzz.sh does the building and running; see docs/reliability.md."""
from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor
from conveyor.testing import subprocess_env, unsanitized_env
from conveyor.tokenizer import Llama2cTokenizer

ROOT = Path(__file__).resolve().parents[1]
FUZZ_SH = ROOT / "tools" / "fuzz.sh"
CORPUS = ROOT / "tests" / "fuzz_corpus"
C_TARGETS = ["safetensors", "config", "llama2c", "gguf", "stop"]
C_SOURCES = ROOT / "csrc" / "fuzz"


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    """One build folder for the module, so the targets' objects are built once."""
    return tmp_path_factory.mktemp("fuzz")


def _env(fuzz_dir: Path) -> dict:
    env = subprocess_env()
    env.pop("LD_PRELOAD", None)  # a sanitizer runtime preloaded by tools/sanitize.sh
    env["CV_FUZZ_DIR"] = str(fuzz_dir)
    env["PYTHON"] = sys.executable
    return env


def _has_libfuzzer(tmp_path: Path) -> bool:
    cc = shutil.which(os.environ.get("CC", "clang")) or shutil.which("clang")
    if not cc:
        return False
    src = tmp_path / "probe.c"
    src.write_text("#include <stddef.h>\n#include <stdint.h>\n"
                   "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n")
    r = subprocess.run([cc, "-fsanitize=fuzzer,address,undefined", str(src), "-o", str(tmp_path / "probe")],
                       capture_output=True, env=unsanitized_env())
    return r.returncode == 0


def _has_asan_cc(tmp_path: Path) -> bool:
    for cc in ("gcc", "clang", "cc"):
        if not shutil.which(cc):
            continue
        src = tmp_path / "probe.c"
        src.write_text("int main(void) { return 0; }\n")
        r = subprocess.run([cc, "-fsanitize=address,undefined", str(src), "-o", str(tmp_path / "probe")],
                           capture_output=True, env=unsanitized_env())
        if r.returncode == 0:
            return True
    return False


needs_sources = pytest.mark.skipif(not (FUZZ_SH.is_file() and C_SOURCES.is_dir()),
                                   reason="tools/fuzz.sh or csrc/fuzz not in this tree")


@needs_sources
def test_fuzz_smoke_5s_per_target(tmp_path, fuzz_dir):
    """tools/fuzz.sh -t 5: every target builds, runs 5 s and does not crash."""
    if not _has_libfuzzer(tmp_path):
        pytest.skip("clang with libFuzzer (-fsanitize=fuzzer) is not available")
    r = subprocess.run(["bash", str(FUZZ_SH), "-t", "5"], cwd=ROOT, env=_env(fuzz_dir),
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr[-4000:])
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    for t in C_TARGETS + ["tokenizer"]:
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith(t + ":")), None)
        assert line is not None, r.stdout
        assert "execs" in line and "FAILED" not in line, line
        n = int(line.split(":")[1].split()[0])
        assert n > 100, line  # it really ran


@needs_sources
@pytest.mark.parametrize("target", C_TARGETS)
def test_fuzz_corpus_replays(target, tmp_path, fuzz_dir):
    """Every file of tests/fuzz_corpus/<target>/ (seeds, and inputs that once
    crashed) runs through its target under ASan/UBSan without a report."""
    files = sorted((CORPUS / target).iterdir())
    assert files, f"tests/fuzz_corpus/{target} is empty"
    if not _has_asan_cc(tmp_path):
        pytest.skip("no C compiler with AddressSanitizer")
    r = subprocess.run(["bash", str(FUZZ_SH), "--replay", target], cwd=ROOT, env=_env(fuzz_dir),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert f"{target}: replayed {len(files)} file(s)" in r.stdout, r.stdout


# ---------------------------------------------------------------------------- the tokenizer

TOK_CORPUS = CORPUS / "tokenizer"


def _load_checked(path: Path, vocab_size):
    """Loading may only fail with ModelFormatError (or another ValueError); a file
    that loads must encode and decode without error."""
    try:
        tok = Llama2cTokenizer(path, vocab_size)
    except conveyor.ModelFormatError:
        return None
    except ValueError as e:  # allowed, but should be the specific one
        pytest.fail(f"a ValueError that is not ModelFormatError: {e!r}")
    ids = tok.encode("Once upon a time, héllo \u2603!")
    assert all(0 <= i < tok.vocab_size for i in ids)
    tok.decode(ids)
    tok.decode(list(range(tok.vocab_size)), skip_special_tokens=False)
    assert len(tok.all_token_bytes()) == tok.vocab_size
    return tok


def test_tokenizer_corpus_replays(tmp_path):
    files = sorted(TOK_CORPUS.iterdir())
    assert files
    for f in files:
        _load_checked(f, None)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SEED = (TOK_CORPUS / "seed_259.bin").read_bytes() if (TOK_CORPUS / "seed_259.bin").is_file() else b""


@st.composite
def corrupted(draw):
    """The seed tokenizer.bin with random edits: flipped bytes, 4-byte fields
    overwritten with edge values, cuts and insertions."""
    b = bytearray(SEED)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.integers(0, 4))
        if not b:
            kind = 4
        if kind == 0:
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        elif kind == 1 and len(b) >= 4:
            at = draw(st.integers(0, len(b) - 4))
            v = draw(st.sampled_from([0, 1, -1, 2**31 - 1, -2**31, 259, 4096, 0x7F800000, 0x7FC00000]))
            struct.pack_into("<i" if v < 2**31 else "<I", b, at, v)
        elif kind == 2:
            del b[draw(st.integers(0, len(b))):]
        elif kind == 3:
            at = draw(st.integers(0, len(b) - 1))
            del b[at:at + draw(st.integers(1, 64))]
        else:
            at = draw(st.integers(0, len(b)))
            b[at:at] = draw(st.binary(min_size=1, max_size=32))
    return bytes(b)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(corrupted(), st.binary(max_size=600)),
       vocab=st.one_of(st.none(), st.integers(0, 2**31 - 1)))
def test_tokenizer_loader_fuzz(tmp_path, data, vocab):
    p = tmp_path / "tokenizer.bin"
    p.write_bytes(data)
    _load_checked(p, vocab)


def test_tokenizer_random_mutations_fixed_seed(tmp_path):
    """A deterministic batch of mutations (the same on every run)."""
    rnd = random.Random(1234)
    p = tmp_path / "tokenizer.bin"
    for _ in range(300):
        b = bytearray(SEED)
        for _ in range(rnd.randint(1, 4)):
            at = rnd.randrange(len(b))
            b[at] = rnd.randrange(256)
        p.write_bytes(bytes(b))
        _load_checked(p, rnd.choice([None, 259, 300, 512]))


# ---------------------------------------------------------------------------- model files

PY_TARGETS = ["gguf_tokenizer", "hf_tokenizer", "chat_template", "shard_index"]


@needs_sources
@pytest.mark.parametrize("target", PY_TARGETS)
def test_model_file_targets_replay_and_fuzz(target, tmp_path):
    """tools/fuzz_model_files.py: the corpus replays, then 3 s of mutations, every input
    under the 5 s / 512 MiB limits, with no error other than the clear ones."""
    import sys as _sys

    files = sorted((CORPUS / target).iterdir())
    assert files, f"tests/fuzz_corpus/{target} is empty"
    r = subprocess.run([_sys.executable, str(ROOT / "tools" / "fuzz_model_files.py"), target, "3",
                        str(tmp_path / "work"), str(tmp_path / "crashes"), str(CORPUS / target)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    # (the environment as it is: under tools/sanitize.sh the child needs the ASan runtime
    # preloaded to import the sanitized conveyor._core, and the driver then leaves out
    # its address-space limit)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    n = int(r.stdout.split("stat::number_of_executed_units:")[1].split()[0])
    assert n > len(files), r.stdout
