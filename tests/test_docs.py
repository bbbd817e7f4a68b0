"""The user documentation under docs/ stays true to the code it describes: every relative
link and anchor resolves, every benchmark and every `conveyor serve` / `conveyor generate`
option is in docs/cli.md, and every SamplingParams field and engine argument is in
docs/python-api.md."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.testing import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ is not beside the tests (installed package)")


def _without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _markdown_files() -> list:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def test_relative_links_and_anchors_resolve():
    anchors = {}
    for f in _markdown_files():
        anchors[f.resolve()] = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", _without_code(f.read_text()), re.M)}
    broken = []
    for f in _markdown_files():
        for link in re.findall(r"\]\(([^)\s]+)\)", _without_code(f.read_text())):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (f.parent / path).resolve() if path else f.resolve()
            if not target.exists():
                broken.append(f"{f.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.is_file() and anchor not in anchors[target]:
                broken.append(f"{f.relative_to(ROOT)}: {link} (no such heading)")
    assert broken == []


def test_every_benchmark_is_documented():
    from conveyor.cli import BENCHMARKS

    text = (DOCS / "cli.md").read_text()
    assert [b for b in BENCHMARKS if f"`conveyor bench {b}`" not in text] == []


def _options(command: str) -> set:
    r = subprocess.run([sys.executable, "-m", "conveyor", command, "--help"], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", r.stdout)) - {"--help"}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_cli_option_is_documented(command):
    text = (DOCS / "cli.md").read_text()
    section = text.split(f"## conveyor {command}", 1)[1].split("\n## ", 1)[0]
    # a BooleanOptionalAction's --no-X is written as --(no-)X
    missing = [o for o in sorted(_options(command))
               if o not in section and o.replace("--no-", "--(no-)") not in section
               and o.replace("--", "--(no-)", 1) not in section]
    assert missing == []


def test_every_sampling_field_and_engine_argument_is_documented():
    from conveyor.engine import EngineArgs
    from conveyor.sampling_params import SamplingParams

    text = (DOCS / "python-api.md").read_text()
    names = [f.name for f in dataclasses.fields(SamplingParams) if f.init and not f.name.startswith("_")]
    names += [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    assert [n for n in names if f"| `{n}` |" not in text] == []
