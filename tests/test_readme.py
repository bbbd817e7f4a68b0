"""README.md's Python snippets run exactly as written, each as its own script (as a
reader pastes it into a .py file), from the repository root. A block preceded by the
comment `<!-- readme-test: skip (REASON) -->` is not run (one needing a running server
or the network); the test checks that every skip gives its reason."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.testing import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
FENCE = re.compile(r"^```python\s*\n(?P<code>.*?)^```\s*$", re.S | re.M)


def python_blocks():
    """(line number, code, skip reason or None) for each fenced python block."""
    text = README.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        skip = SKIP.search(before[-1]) if before else None
        out.append((text.count("\n", 0, m.start()) + 1, m.group("code"), skip.group("reason") if skip else None))
    return out


BLOCKS = python_blocks()


def test_readme_has_runnable_python_blocks():
    assert len([b for b in BLOCKS if b[2] is None]) >= 2
    # every skip marker sits just above a python block and says why
    assert README.read_text().count("readme-test: skip") == len([b for b in BLOCKS if b[2]])


@pytest.mark.parametrize("line, code, skip", BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_readme_python_block_runs(line, code, skip, tmp_path, stories_dir):
    if skip:
        pytest.skip(f"README line {line}: {skip}")
    if "../shared/models/stories260K" in code and not (ROOT.parent / "shared" / "models" / "stories260K").is_dir():
        pytest.skip("the README's ../shared/models/stories260K is not beside this checkout")
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = subprocess_env()
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"README line {line} failed:\n{r.stderr}"
    assert r.stdout.strip(), f"README line {line} printed nothing"
    assert "Traceback" not in r.stderr
    if "output_kind=\"delta\"" in code:
        # deltas: the story is printed once, not once per token
        assert len(r.stdout.splitlines()) < 20, r.stdout  # cumulative outputs would print ~64 lines
