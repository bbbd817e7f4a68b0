"""README.md's code runs as written, taken from the README itself, on a fresh model cache
(a new $CONVEYOR_CACHE holding only the default model's file).

- Every fenced python block runs as its own script (as a reader pastes it into a .py
  file), from the repository root. A block preceded by `<!-- readme-test: needs conveyor
  serve -->` runs against the server that the README's `conveyor serve` line starts (on a
  free port, whose address replaces the README's 127.0.0.1:8000).
- Every `conveyor ...` command of the bash blocks runs (the pip, pytest and jupyter
  commands around them install and test, and are not run here).
- The showcase: the README's `conveyor generate --prompt "What is the capital of Japan?"`,
  greedy on the default model, answers Tokyo, and so does the client snippet through the
  server.

The default model is not downloaded here: the tests that need it skip when it is not
already on this machine (`conveyor fetch-model` brings it)."""
import queue
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conveyor.testing import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<what>[^>]*?)\s*-->\s*$")
NEEDS_SERVER = "needs conveyor serve"
FENCE = re.compile(r"^```(?P<lang>\w*)\s*\n(?P<code>.*?)^```\s*$", re.S | re.M)
SHOWCASE = "What is the capital of Japan?"
README_ADDRESS = "127.0.0.1:8000"


def _blocks(lang: str) -> list:
    """(line number, code, marker text or None) for each fenced block of `lang`."""
    out = []
    for m in FENCE.finditer(TEXT):
        if m.group("lang") != lang:
            continue
        before = TEXT[:m.start()].rstrip("\n").splitlines()
        marker = MARKER.search(before[-1]) if before else None
        out.append((TEXT.count("\n", 0, m.start()) + 1, m.group("code"), marker.group("what") if marker else None))
    return out


def _commands() -> list:
    """(line number, argv after `conveyor`) of each `conveyor ...` command in the bash blocks,
    comments dropped and `a && b` split."""
    out = []
    for line, code, _ in _blocks("bash"):
        for i, text in enumerate(code.splitlines()):
            argv: list = []
            for word in shlex.split(text, comments=True) + ["&&"]:
                if word != "&&":
                    argv.append(word)
                    continue
                if argv[:1] == ["conveyor"]:
                    out.append((line + 1 + i, argv[1:]))
                argv = []
    return out


PYTHON_BLOCKS = _blocks("python")
COMMANDS = _commands()
SERVE = [c for c in COMMANDS if c[1][:1] == ["serve"]]


def _default_model() -> Path:
    from conveyor.models import DEFAULT_MODEL, find_model

    path = find_model(DEFAULT_MODEL)
    if path is None:
        pytest.skip(f"{DEFAULT_MODEL} is not fetched here (run 'conveyor fetch-model')")
    return path


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> dict:
    """The environment of a reader with a fresh cache: it holds only the default model's
    file, when this machine has it."""
    from conveyor.models import DEFAULT_MODEL, find_model

    cache = tmp_path_factory.mktemp("conveyor_cache")
    model = find_model(DEFAULT_MODEL)
    if model is not None:
        (cache / model.name).symlink_to(model.resolve())
    return subprocess_env(CONVEYOR_CACHE=str(cache))


def _conveyor(argv: list, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_readme_has_what_the_tests_run():
    assert len([b for b in PYTHON_BLOCKS if b[2] is None]) >= 2
    # every marker sits just above a python block and is one this test knows
    assert TEXT.count("readme-test:") == len([b for b in PYTHON_BLOCKS if b[2]])
    assert {b[2] for b in PYTHON_BLOCKS if b[2]} <= {NEEDS_SERVER}
    assert len(SERVE) == 1, SERVE
    assert [c for c in COMMANDS if SHOWCASE in c[1]], "the README shows no `conveyor generate --prompt` showcase"


def test_command_extraction_reads_the_readme_shape():
    """The extraction itself: `a && b`, quoted prompts and comments (it would otherwise run
    nothing and pass)."""
    assert ["generate"] in [c[1] for c in COMMANDS]
    assert any(c[1][:3] == ["generate", "--prompt", SHOWCASE] for c in COMMANDS)


@pytest.mark.parametrize("line, code, marker", [b for b in PYTHON_BLOCKS if b[2] is None],
                         ids=[f"line{b[0]}" for b in PYTHON_BLOCKS if b[2] is None])
def test_readme_python_block_runs(line, code, marker, tmp_path, fresh_cache):
    if "stories260K" not in code:
        _default_model()
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=fresh_cache, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"README line {line} failed:\n{r.stderr}"
    assert r.stdout.strip(), f"README line {line} printed nothing"
    assert "Traceback" not in r.stderr
    if "output_kind=\"delta\"" in code:
        # deltas: the story is printed once, not once per token
        assert len(r.stdout.splitlines()) < 20, r.stdout  # cumulative outputs would print ~64 lines


@pytest.mark.parametrize("line, argv", [c for c in COMMANDS if c[1][:1] != ["serve"]],
                         ids=[f"line{c[0]}" for c in COMMANDS if c[1][:1] != ["serve"]])
def test_readme_command_runs(line, argv, fresh_cache):
    if "stories260K" not in argv:
        _default_model()
    r = _conveyor(argv, fresh_cache)
    assert r.returncode == 0, f"README line {line}: conveyor {shlex.join(argv)} failed:\n{r.stderr}"
    assert r.stdout.strip()
    assert "random-weight" not in r.stderr  # the real default model ran, not the offline stand-in
    if argv[:1] == ["generate"] and SHOWCASE in argv:
        # greedy (generate's default temperature is 0) on the default model
        answer = r.stdout.split(SHOWCASE, 1)[1]
        assert "Tokyo" in answer, r.stdout


def test_readme_server_and_client_blocks(tmp_path, fresh_cache):
    """The README's `conveyor serve` (on a free port) and the client blocks that need it."""
    pytest.importorskip("uvicorn", reason="needs the server extra")
    pytest.importorskip("openai", reason="the README's client block uses the official client")
    _default_model()
    blocks = [b for b in PYTHON_BLOCKS if b[2] == NEEDS_SERVER]
    assert blocks
    line, argv = SERVE[0]
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", *argv, "--port", "0", "--no-access-log"], cwd=ROOT,
                            env=fresh_cache, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    # read stderr to its end (a full pipe would stall the server); the start line names the port
    threading.Thread(target=lambda: [lines.put(s) for s in proc.stderr] + [lines.put(None)], daemon=True).start()
    try:
        address = None
        while address is None:
            out = lines.get(timeout=300)
            assert out is not None, f"README line {line}: conveyor {shlex.join(argv)} ended before serving"
            m = re.search(r"serving (\S+) at http://([\d.]+:\d+)/v1", out)
            if m:
                assert m.group(1) == "SmolLM2-135M-Instruct"  # the name the README's client sends
                address = m.group(2)
        for block_line, code, _ in blocks:
            assert README_ADDRESS in code
            script = tmp_path / f"client{block_line}.py"
            script.write_text(code.replace(README_ADDRESS, address), encoding="utf-8")
            r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=fresh_cache, capture_output=True,
                               text=True, timeout=300)
            assert r.returncode == 0, f"README line {block_line} failed:\n{r.stderr}"
            if SHOWCASE in code:
                assert "Tokyo" in r.stdout, r.stdout
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
