"""One request or one model file must never crash, stall or exhaust the engine.
Each test reproduces one hostile input and fails without the guard against it.

Crashes (use after close, inputs that change while read, aborts) run in a child
process where a segfault or a heap overflow would take the test runner down with it."""
from __future__ import annotations

import json
from pathlib import Path
import re
import subprocess
import sys
import textwrap
import time

import pytest

import conveyor
from conveyor import LLM, SamplingParams


def run_child(code: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (same sys.path); returns the finished process."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ,
                                                "PYTHONPATH": ":".join(p for p in sys.path if p)})


# A SamplingParams' attributes as a plain object, so that a test can put objects
# with callbacks where the C reader converts values.
PARAMS_AS_OBJECT = """
import types
from conveyor import SamplingParams
def params_object(**over):
    sp = SamplingParams(max_tokens=4)
    names = ["n", "max_tokens", "min_tokens", "top_k", "logprobs", "temperature", "top_p", "min_p",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
             "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "stop_token_ids",
             "stop_strings", "prompt_logprobs", "best_of", "logit_bias", "allowed_token_ids",
             "guided_decoding"]
    d = {k: getattr(sp, k) for k in names}
    d["_bad_words_token_ids"] = None
    d.update(over)
    return types.SimpleNamespace(**d)
"""


# ---------------------------------------------------------------- use after close


def test_close_from_a_callback_during_check_request(stories_dir):
    """A value whose __float__ closes the engine while check_request reads the
    params: EngineClosedError, not a NULL engine dereferenced."""
    r = run_child(PARAMS_AS_OBJECT + f"""
import conveyor
class Closer:  # not a float: the reader calls __float__
    def __float__(self):
        eng.close()
        return 0.5
for method in ("check_request", "add_request"):
    llm = conveyor.LLM({str(stories_dir / "stories260K.bin")!r})
    eng = llm._core._engine
    args = ([1, 2, 3], params_object(temperature=Closer()))
    try:
        if method == "add_request":
            eng.add_request(7, *args)
        else:
            eng.check_request(*args)
    except conveyor.EngineClosedError as e:
        print(method, "closed:", e)
    else:
        print(method, "no error")
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "check_request closed: the engine is closed" in r.stdout
    assert "add_request closed: the engine is closed" in r.stdout


def test_check_request_racing_close(stories_dir):
    """One thread calls LLM.check_request in a loop while
    another closes the LLM. Every call either passes or raises EngineClosedError."""
    r = run_child(f"""
import threading, conveyor
from conveyor import SamplingParams
for round_ in range(20):
    llm = conveyor.LLM({str(stories_dir / "stories260K.bin")!r})
    sp = SamplingParams(max_tokens=4, logit_bias={{i: 1.0 for i in range(200)}})
    go = threading.Event()
    errors = []
    def hammer():
        go.set()
        for _ in range(2000):
            try:
                llm.check_request([1, 2, 3], sp)
            except conveyor.EngineClosedError:
                return
            except Exception as e:
                errors.append(repr(e))
                return
    t = threading.Thread(target=hammer)
    t.start()
    go.wait()
    llm.close()
    t.join()
    assert not errors, errors
print("ok")
""", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("ok")


# ---------------------------------------------------------------- inputs that change while read


def test_logit_bias_dict_growing_during_read():
    """An int subclass whose __float__ adds keys to the logit_bias dict being read:
    the C reader sizes its arrays from a copy (no heap overflow), and the engine
    checks exactly the entries it copied."""
    r = run_child(PARAMS_AS_OBJECT + """
from conveyor import _core
bias = {}
class Grower(int):
    def __float__(self):
        for k in range(1000, 60000):
            bias[k] = 1.0
        return 1.0
bias[1] = Grower(1)
bias[2] = 3.0
_core.check_sampling_params(params_object(logit_bias=bias))
print("read", len(bias))
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "read 59002" in r.stdout


def test_bad_words_lists_changing_during_read():
    """bad_words token lists whose __len__ and iteration change the outer list: read
    from snapshots, no out-of-bounds read or write."""
    r = run_child(PARAMS_AS_OBJECT + """
from conveyor import _core
outer = []
class Sneaky(list):
    def __len__(self):
        outer.clear()          # the outer list shrinks under the reader
        return 1
    def __iter__(self):
        outer.extend([[1] * 50000] * 100)
        return iter([5, 6])
outer.extend([Sneaky([5, 6]), [7, 8, 9]])
_core.check_sampling_params(params_object(_bad_words_token_ids=outer))
print("ok")
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok" in r.stdout


# ---------------------------------------------------------------- aborts


def test_many_aborts_cost_one_pass(stories_dir):
    """N aborts of N active requests are applied in one pass (sorted ids), not N scans
    of the active list: 30k aborts take one short step."""
    eng = LLM(str(stories_dir / "stories260K.bin"), max_num_seqs=8)
    try:
        core = eng._core._engine
        sp = SamplingParams(max_tokens=2)
        n = 30000
        for i in range(n):
            core.add_request(i, [1, 2, 3], sp)
        core.step()  # every request is active now
        for i in range(n):
            core.abort(i)
        t0 = time.perf_counter()
        core.step()
        took = time.perf_counter() - t0
        core.take_outputs()
        assert core.num_unfinished() == 0
        assert took < 0.5, f"applying {n} aborts took {took:.2f} s"
    finally:
        eng.close()


# ---------------------------------------------------------------- guided decoding


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    pytest.importorskip("llguidance")
    with LLM(str(stories_dir / "stories260K.bin")) as llm:
        yield llm


@pytest.mark.parametrize("kind,value,check", [
    ("grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    ("grammar", 'root ::= "(" [1-9] ("+" [1-9])* ")"', lambda t: __import__("re").fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/', lambda t: __import__("re").fullmatch(r"x[0-9]{2}", t)),
    ("grammar", 'start: "a::=" /[0-9]/', lambda t: __import__("re").fullmatch(r"a::=[0-9]", t)),
    ("regex", r"[a-c]{3}-\d", lambda t: __import__("re").fullmatch(r"[a-c]{3}-\d", t)),
    ("choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("json", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False},
     lambda t: json.loads(t).keys() == {"a"}),
], ids=["gbnf-alt", "gbnf-repeat", "lark", "lark-literal-gbnf-sign", "regex", "choice", "schema"])
def test_every_grammar_kind(stories_llm, kind, value, check):
    from conveyor.guided import GuidedDecodingParams

    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=60, guided_decoding=GuidedDecodingParams(**{kind: value}))
    (out,) = stories_llm.generate(["Once"], sp, use_tqdm=False)
    o = out.outputs[0]
    assert o.finish_reason == "stop", (o.finish_reason, o.text)
    assert check(o.text), o.text


@pytest.mark.parametrize("kw,what", [
    (dict(json=False), "the schema false, which no output satisfies"),
    (dict(json={"type": "object", "properties": {"a": {"type": "frobnicate"}}}), "frobnicate"),
    (dict(grammar="start: x"), "guided_decoding.grammar"),
])
def test_a_guided_request_no_output_can_meet_is_refused(kw, what):
    pytest.importorskip("llguidance")
    from conveyor.guided import GuidedDecodingParams

    with pytest.raises(ValueError, match=re.escape(what)) as e:
        GuidedDecodingParams(**kw)
    assert e.value.field == "guided_decoding"


def test_guided_with_best_of(stories_llm):
    """best_of > n under a grammar: every candidate is masked; the answer is a real
    completion of the grammar (it was an empty aborted one)."""
    from conveyor.guided import GuidedDecodingParams

    sp = SamplingParams(n=1, best_of=4, temperature=1.0, seed=1, max_tokens=20,
                        guided_decoding=GuidedDecodingParams(choice=["alpha", "beta", "gamma"]))
    (out,) = stories_llm.generate(["Pick"], sp, use_tqdm=False)
    (o,) = out.outputs
    assert o.finish_reason == "stop" and o.text in ("alpha", "beta", "gamma"), o
    assert len(o.token_ids) > 0


# ---------------------------------------------------------------- GGUF alignment


@pytest.mark.parametrize("alignment", [1, 2, 4, 24])
def test_gguf_alignment_below_8_or_not_a_power_of_two(tmp_path, alignment):
    """general.alignment must be a power of two >= 8 (the spec: a multiple of 8): the
    C reader and the Python GGUFReader refuse 1, 2, 4 and 24 alike."""
    import numpy as np

    from conveyor.gguf import GGUFError, GGUFReader, GGUFValueType, GGUFWriter

    with pytest.raises(GGUFError, match="power of two in \\[8, "):
        GGUFWriter(tmp_path / "w.gguf", alignment=alignment)
    w = GGUFWriter(tmp_path / "m.gguf", alignment=32)
    w.add("general.architecture", "llama")
    w.add_tensor("t", np.ones(32, np.float32), "Q8_0")
    path = w.write()
    data = bytearray(path.read_bytes())
    # rewrite the header with general.alignment (a u32 KV) added
    key = b"general.alignment"
    kv = len(key).to_bytes(8, "little") + key + int(GGUFValueType.UINT32).to_bytes(4, "little") + \
        alignment.to_bytes(4, "little")
    n_kv = int.from_bytes(data[16:24], "little")
    bad = data[:16] + (n_kv + 1).to_bytes(8, "little") + kv + data[24:]
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(bad))
    with pytest.raises(GGUFError, match="general.alignment"):
        GGUFReader(p)
    with pytest.raises(conveyor.ModelFormatError, match="general.alignment must be a uint32 power of two in \\[8,"):
        conveyor._core.gguf_metadata(str(p))


# ---------------------------------------------------------------- model files


def _peak_child(code: str) -> tuple[str, float, float]:
    """Runs code in a child after importing conveyor; (its stdout, seconds code took, how
    far code raised the peak RSS, in MiB)."""
    r = run_child("import resource, time\nimport conveyor, conveyor.tokenizer\n"
                  "_rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n_t0 = time.monotonic()\n"
                  + code + "\nprint('RSS', time.monotonic() - _t0, "
                  "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _rss0)")
    assert r.returncode == 0, r.stderr[-2000:]
    took, rss = r.stdout.rsplit("RSS", 1)[1].split()
    return r.stdout, float(took), float(rss) / 1024


def test_gguf_merges_from_scores_bounded(tmp_path):
    """A merge bomb: a ~2 MB GGUF whose tokens are "a" * 1..2000, so that every split
    of every token is a merge (37 s and 11.4 GB before). It loads within 5 s and 512 MiB
    (tokens past MERGE_MAX_TOKEN_CHARS get no merges)."""
    from conveyor.gguf import GGUFValueType as VT, GGUFWriter

    w = GGUFWriter(tmp_path / "bomb.gguf")
    w.add("general.architecture", "llama")
    w.add("tokenizer.ggml.model", "llama")
    toks = ["<unk>", "<s>", "</s>"] + ["a" * k for k in range(1, 2001)]
    w.add("tokenizer.ggml.tokens", toks, VT.ARRAY, VT.STRING)
    w.add("tokenizer.ggml.scores", [0.0] * 3 + [float(k) for k in range(1, 2001)], VT.ARRAY, VT.FLOAT32)
    w.add("tokenizer.ggml.token_type", [2, 3, 3] + [1] * 2000, VT.ARRAY, VT.INT32)
    path = w.write()
    assert path.stat().st_size < 2_100_000
    out, took, rss = _peak_child(f"""
from conveyor.tokenizer import GGUFTokenizer
tok = GGUFTokenizer.from_file({str(path)!r})
print("ids", tok.encode("aaaaaaaaaa", add_special_tokens=False))
""")
    assert "ids [" in out
    assert took < 5.0, f"{took:.1f} s"
    assert rss < 512, f"peak RSS grew by {rss:.0f} MiB"


def test_gguf_unused_metadata_array_not_listed(tmp_path):
    """A big metadata array the tokenizer does not read is left out of the tokenizer's
    metadata (array_limit), while the tokenizer's own arrays are read whole."""
    from conveyor import _core
    from conveyor.gguf import GGUFValueType as VT, GGUFWriter

    w = GGUFWriter(tmp_path / "junk.gguf")
    w.add("general.architecture", "llama")
    w.add("tokenizer.ggml.model", "gpt2")
    toks = [f"t{i}" for i in range(70000)]
    w.add("tokenizer.ggml.tokens", toks, VT.ARRAY, VT.STRING)
    w.add("junk.array", [0] * 4_000_000, VT.ARRAY, VT.UINT8)
    path = w.write()
    md = _core.gguf_metadata(str(path), array_limit=1 << 16)
    assert "junk.array" not in md and len(md["tokenizer.ggml.tokens"]) == 70000
    assert len(_core.gguf_metadata(str(path))["junk.array"]) == 4_000_000  # the default reads all


def _tokenizer_json(vocab: dict) -> str:
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                       "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}})


@pytest.mark.parametrize("big_id", [200_000_000, 4_000_000_000])
def test_tokenizer_json_huge_token_id(tmp_path, big_id):
    """A ~300-byte tokenizer.json naming token id 200,000,000 (3 GB of tables before) or
    4e9 (a MemoryError traceback): ModelFormatError naming the id, at once."""
    from conveyor.tokenizer import HFTokenizer

    p = tmp_path / "tokenizer.json"
    p.write_text(_tokenizer_json({"a": 0, "b": 1, "c": big_id}))
    t0 = time.monotonic()
    with pytest.raises((conveyor.ModelFormatError, ValueError)) as ei:
        HFTokenizer(p)
    assert time.monotonic() - t0 < 2.0
    if isinstance(ei.value, conveyor.ModelFormatError):
        assert str(big_id) in str(ei.value)


def test_deep_tokenizer_config(tmp_path):
    """A tokenizer_config.json nested 100,000 deep: ModelFormatError, not RecursionError."""
    from conveyor.tokenizer import HFTokenizer

    (tmp_path / "tokenizer.json").write_text(_tokenizer_json({"a": 0, "b": 1}))
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(conveyor.ModelFormatError, match="nested too deeply"):
        HFTokenizer(tmp_path / "tokenizer.json", tmp_path)


def test_json_size_caps(tmp_path, tiny_hf_dir):
    """config.json (C reader) and tokenizer_config.json (Python) past their caps: a
    ModelFormatError naming the file and its size, before parsing."""
    import shutil

    from conveyor.tokenizer import HFTokenizer

    d = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["padding"] = "x" * (2 << 20)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(conveyor.ModelFormatError, match="config.json: \\d+ bytes, more than the 1048576"):
        conveyor._core.Checkpoint(str(d))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["padding"] = "x" * (5 << 20)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(conveyor.ModelFormatError, match="tokenizer_config.json: \\d+ bytes, more than"):
        HFTokenizer(d / "tokenizer.json", d)


def test_chat_template_symlink_out_of_the_folder(tmp_path, tiny_hf_dir):
    """chat_template.jinja linking out of the model folder is refused; the Hugging Face
    cache's snapshots/REV -> ../../blobs link is followed."""
    import shutil

    from conveyor.tokenizer import HFTokenizer

    secret = tmp_path / "secret.txt"
    secret.write_text("host secret {{ messages }}")
    d = tmp_path / "m"
    shutil.copytree(tiny_hf_dir, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(conveyor.ModelFormatError, match="outside the model folder"):
        HFTokenizer(d / "tokenizer.json", d)
    # the HF cache layout
    repo = tmp_path / "models--x--y"
    snap = repo / "snapshots" / "abc123"
    shutil.copytree(d, snap, symlinks=True)
    (snap / "chat_template.jinja").unlink()
    (repo / "blobs").mkdir()
    (repo / "blobs" / "h1").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (snap / "chat_template.jinja").symlink_to(Path("../../blobs/h1"))
    tok = HFTokenizer(snap / "tokenizer.json", snap)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_ray_deployment_name_and_key_warning(stories_dir):
    """A Ray Serve deployment serves the model's name, not its full path, and warns when
    it answers without an API key (as `conveyor serve` does)."""
    from conveyor.ray import serve as ray_serve

    path = str(stories_dir / "stories260K.bin")
    assert ray_serve._served_name(path) == "stories260K"
    assert ray_serve._served_name("/only/on/the/replica/model-dir/") == "model-dir"
    with pytest.warns(UserWarning, match="without an API key"):
        try:
            ray_serve.build(path)
        except Exception:  # noqa: BLE001 - without ray installed, build stops after the warning
            pass


def test_grammar_given_up_midway_is_said(stories_llm):
    """A grammar llguidance gives up on after the first token: LLM.generate warns and
    RequestOutput.guided_error says why (AsyncLLM's stream raises it: the server's 400)."""
    from conveyor.guided import GuidedDecodingParams

    sp = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="((a{100}){100}){100}"))
    try:
        with pytest.warns(UserWarning, match="grammar engine gave up"):
            (out,) = stories_llm.generate(["Once"], sp, use_tqdm=False)
    except ValueError as e:  # or it is refused at the first token already
        assert getattr(e, "field", None) == "guided_decoding" and "gave up" in str(e)
        return
    assert out.outputs[0].finish_reason == "abort" and "gave up" in out.guided_error


def test_internal_error_is_counted_and_not_echoed(stories_dir):
    """A 500 (here: a bug stand-in raised while the request is read) says only its type,
    the details go to the log, and it is counted in conveyor_http_errors_total."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    import asyncio

    from conveyor import AsyncLLM
    from conveyor.serve import build_app

    engine = AsyncLLM(str(stories_dir / "stories260K.bin"), num_threads=1)
    try:
        app = build_app(engine, model_name="stories260K")

        def broken(body):
            raise RuntimeError("secret detail /home/someone/.keys")

        app.state.server.validator.completion = broken

        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                r = await c.post("/v1/completions", json={"prompt": "hi"})
                m = await c.get("/metrics")
            return r, m

        r, m = asyncio.run(go())
        assert r.status_code == 500
        assert "RuntimeError" in r.json()["error"]["message"] and "secret" not in r.text
        assert 'status="500"} 1' in m.text
    finally:
        engine.close()


def test_chat_template_nested_past_the_parsers_depth_is_a_clear_error():
    """Found by the chat_template fuzz target: a template nesting { past Python's recursion
    limit made jinja's parser raise RecursionError, which escaped as a crash."""
    from conveyor import ModelFormatError
    from conveyor.tokenizer import _render_template

    source = "{% for m in messages %}{{ m['content'] }}: {{ " + "{ " * 2000 + "}}{% endfor %}"
    with pytest.raises(ModelFormatError, match="cannot be compiled"):
        _render_template(source, [{"role": "user", "content": "hi"}], True, "<s>", "</s>")


@pytest.mark.parametrize("source,what", [
    ("{{ 'ab' * 1000000000 }}", "'*'"),             # jinja folded this while compiling: 24 s, 7.6 GB
    ("{{ [1] * 1000000000 }}", "'*'"),
    ("{{ 7 ** 1000000000 }}", "'**'"),
    ("{{ '%999999999d' % 1 }}", "'%' format width"),
    ("{{ '%*d' % (5, 1) }}", "'%' format width"),
    ("{{ 'a'.ljust(1000000000) }}", "str.ljust"),
    ("{{ 'a\t'.expandtabs(1000000000) }}", "str.expandtabs"),
    ("{{ messages[0].content.replace('a', 'b' * 10000000) }}", "replace"),
    ("{{ messages[0]['content']" + " | replace('a', 'aaaaaaaa')" * 10 + " }}", "replace"),
    ("{{ 'x' | center(1000000000) }}", "center"),
    ("{{ ('a\n' * 1000) | indent(1000000) }}", "indent"),
])
def test_chat_template_that_would_build_a_huge_value_is_refused_at_once(source, what):
    """Found by the chat_template fuzz target (under CI's sanitizers): a template whose
    operators or string methods turn small literals into gigabytes is refused before the
    value is built, whether jinja would fold it at compile time or make it while rendering."""
    from conveyor.tokenizer import _render_template

    t = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(what)):
        _render_template(source, [{"role": "user", "content": "a banana"}], True, "<s>", "</s>")
    assert time.perf_counter() - t < 1.0  # refused before the work, not cut off by the 2 s render cap


def test_chat_template_operators_and_methods_still_work_within_the_limits():
    from conveyor.tokenizer import _render_template

    source = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] * 2 }}{% endfor %}|{{ 3 * 4 }} {{ 2 ** 10 }} "
              "{{ '%5.2f' % 3.14159 }} {{ 'ab' | replace('a', 'xy') }} {{ 'q' | center(5) }}|{{ 'l\nm' | indent(2) }}"
              "|{{ 'x'.ljust(3) }}|{{ 'ab'.replace('b', 'cd') }}")
    out = _render_template(source, [{"role": "user", "content": "hi"}], True, "<s>", "</s>")
    assert out == "user: hihi|12 1024  3.14 xyb   q  |l\n  m|x  |acd"
