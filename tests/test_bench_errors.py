"""Every benchmark's errors are one line a user can act on: a missing optional dependency
names the extra that installs it (before the run, not after), a server that is not there
is named with its URL, and no benchmark writes a file it was not asked to write. Real
subprocesses, with the optional modules made unimportable (None in sys.modules)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from conveyor.cli import BENCHMARKS
from conveyor.testing import subprocess_env

OPTIONAL = ("matplotlib", "httpx", "aiohttp", "torch", "transformers")
RUN = ("import sys\n"
       "for m in sys.argv[1].split(','):\n"
       "    if m: sys.modules[m] = None  # import m now raises ModuleNotFoundError\n"
       "from conveyor.cli import main\n"
       "sys.exit(main(sys.argv[2:]))\n")


def bench(tmp_path, *args, blocked=OPTIONAL, timeout=120):
    return subprocess.run([sys.executable, "-c", RUN, ",".join(blocked), "bench", *map(str, args)],
                          cwd=tmp_path, env=subprocess_env(CONVEYOR_CACHE=tmp_path / "cache"),
                          capture_output=True, text=True, timeout=timeout)


def one_line(r, status, *words):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == status, (r.returncode, r.stderr)
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_needs_no_optional_dependency(tmp_path, name):
    r = bench(tmp_path, name, "--help")
    assert r.returncode == 0 and "usage: conveyor bench " + name in r.stdout, r.stderr


@pytest.mark.parametrize("name", ["latency", "timeline", "variance", "study", "serve"])
def test_plot_without_matplotlib_names_the_extra(tmp_path, name):
    extra = ["--url", "http://127.0.0.1:9"] if name == "serve" else []
    line = one_line(bench(tmp_path, name, *extra, "--plot", "out.png", blocked=("matplotlib",)), 1,
                    f"conveyor bench {name}", "matplotlib", 'pip install "conveyor[bench]"')
    assert "--plot" in line
    assert list(tmp_path.iterdir()) == []  # refused before anything ran or was written


def test_serve_without_httpx_names_the_extra(tmp_path):
    one_line(bench(tmp_path, "serve", "--url", "http://127.0.0.1:9"), 1, "conveyor bench serve", "httpx",
             'pip install "conveyor[bench]"')


def test_serve_with_no_server_names_the_url(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    one_line(bench(tmp_path, "serve", "--url", url, blocked=()), 1, "conveyor bench serve: error:", url,
             "is the server running?")
    assert list(tmp_path.iterdir()) == []


def test_usage_errors_are_one_line(tmp_path):
    for name in BENCHMARKS:
        required = ["--url", "http://127.0.0.1:9"] if name == "serve" else []
        one_line(bench(tmp_path, name, *required, "--no-such-option"), 2, f"conveyor bench {name}: error:",
                 "--no-such-option")


@pytest.mark.parametrize("args, flag", [
    (["throughput", "--block-size", "0"], "--block-size"),
    (["throughput", "--num-requests", "-3"], "--num-requests"),
    (["throughput", "--input-len", "0"], "--input-len"),
    (["latency", "--rates", "0"], "--rates"),
    (["latency", "--rates", "nan"], "--rates"),
    (["latency", "--fractions", "abc"], "--fractions"),
    (["latency", "--prompt-len", "0"], "--prompt-len"),
    (["scheduler", "--steps", "0"], "--steps"),
])
def test_bad_numbers_are_named_before_the_run(tmp_path, args, flag):
    one_line(bench(tmp_path, *args), 2, f"conveyor bench {args[0]}: error:", flag)


def test_timeline_writes_only_what_it_is_asked(tmp_path, stories_dir):
    """No default files in the working directory; --json writes exactly there."""
    args = ["timeline", "--model", stories_dir / "stories260K.bin", "--slots", "2", "--output-lens", "3,2,4"]
    r = bench(tmp_path, *args, blocked=())
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []
    r = bench(tmp_path, *args, "--json", "t.json", blocked=())
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]
