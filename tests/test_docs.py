"""The user documentation under docs/ stays true to the code it describes: every relative
link and anchor resolves, every benchmark and every `conveyor generate` / `chat` / `serve`
option is in docs/cli.md with its numeric default, every SamplingParams field and engine
argument is in docs/python-api.md, and no claim is left marked unchecked."""
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


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
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


def _parser(command: str):
    if command == "serve":
        from conveyor.server.app import make_parser

        return make_parser()
    from importlib import import_module

    return import_module(f"conveyor.{command}").build_parser()


def _table_rows(section: str) -> list:
    """The rows of a section's tables, as (first cell, second cell)."""
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2:
            rows.append((cells[0], cells[1]))
    return rows


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_documented_numeric_defaults_are_the_parsers(command):
    """docs/cli.md's default for an option with a number for a default says that number."""
    text = (DOCS / "cli.md").read_text()
    rows = _table_rows(text.split(f"## conveyor {command}", 1)[1].split("\n## ", 1)[0])
    wrong = []
    for action in _parser(command)._actions:
        d = action.default
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            continue
        names = [o for o in action.option_strings if o.startswith("--")]
        for first, default in rows:
            if any(re.search(rf"`{re.escape(n)}(?![\w-])", first) for n in names):
                shown = {str(d)} | ({str(int(d))} if float(d).is_integer() else set())
                if not shown & set(re.findall(r"-?\d+(?:\.\d+)?", default)):
                    wrong.append(f"{names[0]}: documented {default!r}, parser {d!r}")
    assert wrong == []


def test_user_docs_hold_no_unchecked_claims():
    """`<!-- verify: ... -->` marks a claim written ahead of the code; none stays once it is checked."""
    pages = [ROOT / "README.md"] + sorted(p for p in DOCS.glob("*.md"))
    assert [f"{p.relative_to(ROOT)}:{i}" for p in pages for i, line in enumerate(p.read_text().splitlines(), 1)
            if "<!-- verify:" in line] == []
