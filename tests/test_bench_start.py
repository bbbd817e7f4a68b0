"""`conveyor bench start --llama-cpp PATH`: Conveyor's start beside llama.cpp's, in one run.
The llama.cpp side is a stand-in executable that records its arguments, takes a known time
and prints llama.cpp's load-time line, so the test checks what is measured and how the
ratios are formed, not this machine's speed; the Conveyor side is a real process on a
small GGUF file."""
from __future__ import annotations

import json
import os
import stat

import pytest

from conveyor.bench import start
from conveyor.testing import write_gguf_checkpoint

FAKE = """#!/bin/sh
printf '%s\\n' "$@" > "{args}"
sleep 0.3
echo "common_perf_print:        load time =     250.00 ms" >&2
echo "Hello world"
"""


@pytest.fixture
def fake_llama(tmp_path):
    path = tmp_path / "llama-completion"
    path.write_text(FAKE.format(args=tmp_path / "args.txt"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_conveyor_and_llama_cpp_back_to_back(tmp_path, fake_llama, capsys):
    model = write_gguf_checkpoint(tmp_path / "m.gguf", ggml_type="Q8_0")
    out_json = tmp_path / "start.json"
    assert start.main(["--model", str(model), "--llama-cpp", str(fake_llama), "--pairs", "2",
                       "--num-threads", "1", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["pair"] for r in runs] == [0, 1]
    # llama.cpp ran as a user runs it: this model, these threads, one token
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert args[args.index("-m") + 1] == str(model)
    assert args[args.index("-t") + 1] == "1"
    assert args[args.index("-n") + 1] == "1"
    for r in runs:
        c, ll = r["conveyor"], r["llama_cpp"]
        assert ll["load_s"] == pytest.approx(0.25)
        assert ll["wall_s"] >= 0.3
        # the process includes LLM() and the first token
        assert 0 < c["start_s"] < c["wall_s"] and c["first_token_s"] > 0 and c["cpu_s"] > 0
    best_c = min(r["conveyor"]["wall_s"] for r in runs)
    best_l = min(r["llama_cpp"]["wall_s"] for r in runs)
    assert f"start-time ratio {best_c / best_l:.2f}x wall" in text
    best_start = min(r["conveyor"]["start_s"] for r in runs)
    assert f"llama.cpp load time 0.250 s: {best_start / 0.25:.2f}x" in text
    assert "load average at start" in text and "load average at end" in text


def test_llama_cpp_path_and_model_are_checked(tmp_path, fake_llama, capsys):
    model = write_gguf_checkpoint(tmp_path / "m.gguf", ggml_type="Q8_0")
    missing = tmp_path / "no-such-binary"
    with pytest.raises(SystemExit) as e:
        start.main(["--model", str(model), "--llama-cpp", str(missing)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not an executable file" in err and str(missing) in err

    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\0" * 64)
    with pytest.raises(SystemExit) as e:
        start.main(["--model", str(not_gguf), "--llama-cpp", str(fake_llama)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a GGUF model" in err
    assert not os.path.exists(tmp_path / "args.txt")  # nothing was run
