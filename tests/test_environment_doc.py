"""docs/environment.md is the one table of CONVEYOR_* variables: every variable the
sources read is in it, and it lists none that nothing reads."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "environment.md"
SOURCES = ["python", "base", "csrc", "kernels", "build_support", "tools", "tests", "setup.py", ".ci"]
NAME = re.compile(rb"CONVEYOR_[A-Z0-9_]*[A-Z0-9]")


def names_in_sources() -> set:
    found = set()
    for top in SOURCES:
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            if f.suffix in (".so", ".o", ".pyc", ".png") or "__pycache__" in f.parts:
                continue
            found |= {m.decode() for m in NAME.findall(f.read_bytes())}
    return found


def test_every_variable_is_documented_once():
    if not DOC.is_file():
        pytest.skip("docs/ is not beside the tests (installed package)")
    rows = re.findall(r"^\| `(CONVEYOR_[A-Z0-9_]+)` \|", DOC.read_text(), re.M)
    assert len(rows) == len(set(rows)), "a variable has two rows"
    used = names_in_sources()
    assert sorted(used - set(rows)) == [], "read by the sources but not in docs/environment.md"
    assert sorted(set(rows) - used) == [], "in docs/environment.md but read by nothing"
