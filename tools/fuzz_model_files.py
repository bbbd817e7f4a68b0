"""Fuzzes what a model file (or a request's chat template) feeds the Python side, with a
memory and a time limit per input so that a blow-up counts as a failure:

    gguf_tokenizer  a .gguf file -> conveyor._core.gguf_metadata (py_gguf.c, the
                    tokenizer's array_limit) -> GGUFTokenizer -> encode/decode; and the
                    same bytes to the Python GGUFReader
    hf_tokenizer    a tokenizer.json (+ tokenizer_config.json) -> HFTokenizer -> encode/decode
    chat_template   a Jinja template assembled from pieces (loops, ranges, filters,
                    string arithmetic) -> the chat template renderer
    shard_index     a model.safetensors.index.json beside a real shard -> the C checkpoint
                    reader (checkpoint_hf.c, json.c)

python tools/fuzz_model_files.py TARGET SECS WORKDIR CRASHDIR [CORPUSDIR...]
    (run by tools/fuzz.sh; SECS 0 replays the corpus once). Each target starts from seeds
    it writes itself (conveyor.testing) plus the files in the corpus folders, mutates
    them at random for SECS seconds and saves any input that raises something other than
    the clear errors (ModelFormatError, UnsupportedError, ValueError...), takes more
    than PER_INPUT_SECONDS, or needs more than MEMORY_LIMIT_MIB over the interpreter.
    Exit status 1 on a failure.
"""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

# Under tools/sanitize.sh (ASan, PYTHONMALLOC=malloc) the interpreter runs several
# times slower, so the limit scales with it.
PER_INPUT_SECONDS = 20.0 if os.environ.get("CONVEYOR_SANITIZED") == "1" else 5.0
MEMORY_LIMIT_MIB = 512


class InputTooSlow(Exception):
    pass


def _alarm(signum, frame):
    raise InputTooSlow(f"an input took more than {PER_INPUT_SECONDS} s")


# ---------------------------------------------------------------- mutations


def mutate_bytes(b: bytearray, rnd: random.Random) -> bytearray:
    for _ in range(rnd.randint(1, 8)):
        k = rnd.randrange(7)
        if k == 0 and b:
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        elif k == 1 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif k == 2 and len(b) >= 8:
            at = rnd.randrange(len(b) - 7)
            v = rnd.choice([0, 1, 3, 7, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1])
            b[at:at + 8] = v.to_bytes(8, "little")
        elif k == 3 and b:
            del b[rnd.randrange(len(b)):]
        elif k == 4 and b:
            at = rnd.randrange(len(b))
            del b[at:at + rnd.randint(1, 32)]
        elif k == 5 and len(b) > 16:  # repeat a slice: long strings, many entries
            at = rnd.randrange(len(b) - 8)
            piece = bytes(b[at:at + rnd.randint(1, 64)])
            b[at:at] = piece * rnd.randint(2, 200)
        else:
            at = rnd.randrange(len(b) + 1)
            b[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 16)))
    return b


def mutate_json(text: str, rnd: random.Random) -> str:
    """Structure-aware edits of a JSON document: numbers to extremes, strings grown,
    arrays and objects repeated or nested; otherwise byte mutations."""
    try:
        doc = json.loads(text)
    except ValueError:
        return bytes(mutate_bytes(bytearray(text.encode()), rnd)).decode("utf-8", "replace")

    # Growing edits compound (a list repeated inside a list repeated...), and a document
    # grown past the driver's memory limit fails the driver, not the target: at most
    # two of them a document.
    grow = [2]

    def may_grow() -> bool:
        grow[0] -= 1
        return grow[0] >= 0

    def walk(v, depth=0):
        r = rnd.random()
        if isinstance(v, bool) or v is None:
            return rnd.choice([True, False, None, 0, "x", [], {}]) if r < 0.05 else v
        if isinstance(v, (int, float)):
            return rnd.choice([0, -1, 1, 2**31, 2**32 + 5, 10**12, 4_000_000_000, -2**40, 1e308, 0.5]) \
                if r < 0.15 else v
        if isinstance(v, str):
            if r < 0.05 and may_grow():
                return v * rnd.randint(2, 2000)
            if r < 0.08:
                return rnd.choice(["", "\u2581", "<0xFF>", "a b", "{{ x }}", "\ud800"[:0] + "\u00ff"])
            return v
        if isinstance(v, list):
            out = [walk(x, depth + 1) for x in v]
            if r < 0.05 and out and may_grow():
                out = out * rnd.randint(2, 50)
            elif 0.05 <= r < 0.08 and may_grow():
                out = [out] * 3
            return out
        if isinstance(v, dict):
            out = {k: walk(x, depth + 1) for k, x in v.items()}
            if r < 0.05 and out:
                k = rnd.choice(list(out))
                out[k + "_" + str(rnd.randrange(1000))] = out[k]
            elif r < 0.07 and out:
                del out[rnd.choice(list(out))]
            return out
        return v

    return json.dumps(walk(doc), ensure_ascii=rnd.random() < 0.5)


TEMPLATE_PIECES = [
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{% for i in range(N) %}x{% endfor %}",
    "{% for i in range(N) %}{% for j in range(N) %}{% endfor %}{% endfor %}",
    "{{ messages[0]['content'] * N }}",
    "{{ 'ab' * N }}",
    "{{ (messages | length) ** N }}",
    "{{ messages | tojson }}",
    "{% set ns = namespace(s='') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s ~ 'x' %}{% endfor %}{{ ns.s }}",
    "{{ raise_exception('nope') }}",
    "{% if add_generation_prompt %}assistant:{% endif %}",
    "{{ messages[N]['content'] }}",
    "{{ bos_token }}{{ eos_token }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(N) }}",
    "{{ range(N) | list | length }}",
    "{{ messages[0]['content'] | replace('a', 'aaaaaaaa') | replace('a', 'aaaaaaaa') }}",
    "{{ '%s' % N }}",
    "{{ N // 0 }}",
    "{{ 1e308 * N }}",
    "{% for",
    "{{ messages.__class__ }}",
]


def make_template(rnd: random.Random) -> str:
    parts = []
    for _ in range(rnd.randint(1, 4)):
        p = rnd.choice(TEMPLATE_PIECES)
        parts.append(p.replace("N", str(rnd.choice([0, 1, 3, 50, 1000, 100000, 10**9, 10**30]))))
    return "".join(parts)


# ---------------------------------------------------------------- targets


class Target:
    name = ""
    allowed: tuple = ()

    def __init__(self, work: Path):
        self.work = work

    def seeds(self) -> list[bytes]:
        return []

    def mutate(self, data: bytes, rnd: random.Random) -> bytes:
        return bytes(mutate_bytes(bytearray(data), rnd))

    def run(self, data: bytes) -> None:
        raise NotImplementedError


def _clear_errors():
    from conveyor import ModelFormatError, UnsupportedError
    from conveyor.gguf import GGUFError

    return (ModelFormatError, UnsupportedError, GGUFError, ValueError, FileNotFoundError)


def _exercise(tok) -> None:
    ids = tok.encode("Hello world, the \u00e9t\u00e9 was 42 degrees.", add_special_tokens=True)
    assert all(0 <= i < tok.vocab_size for i in ids), ids
    tok.decode(ids)
    tok.decode(list(range(min(tok.vocab_size, 64))), skip_special_tokens=False)


class GGUFTokenizerTarget(Target):
    name = "gguf_tokenizer"

    def seeds(self):
        from conveyor.gguf import GGUFValueType as VT, GGUFWriter

        out = []
        for model in ("llama", "gpt2"):
            w = GGUFWriter(self.work / f"seed_{model}.gguf")
            w.add("general.architecture", "llama")
            w.add("tokenizer.ggml.model", model)
            if model == "llama":
                toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
                    ["\u2581", "a", "b", "ab", "\u2581a", "\u2581ab", "he", "llo", "hello"]
                w.add("tokenizer.ggml.scores", [0.0] * len(toks), VT.ARRAY, VT.FLOAT32)
                w.add("tokenizer.ggml.token_type", [2, 3, 3] + [6] * 256 + [1] * 9, VT.ARRAY, VT.INT32)
            else:
                toks = [chr(c) for c in range(33, 127)] + ["Ġ", "Ġa", "ab", "<|endoftext|>"]
                w.add("tokenizer.ggml.merges", ["Ġ a", "a b"], VT.ARRAY, VT.STRING)
                w.add("tokenizer.ggml.pre", "gpt2")
            w.add("tokenizer.ggml.tokens", toks, VT.ARRAY, VT.STRING)
            w.add("tokenizer.ggml.bos_token_id", 1, VT.UINT32)
            w.add("tokenizer.ggml.eos_token_id", 2, VT.UINT32)
            out.append(w.write().read_bytes())
        return out

    def run(self, data):
        from conveyor import _core
        from conveyor.gguf import GGUFReader
        from conveyor.tokenizer import GGUF_METADATA_ARRAY_LIMIT, GGUFTokenizer

        path = self.work / "input.gguf"
        path.write_bytes(data)
        try:
            GGUFReader(path)
        except _clear_errors():
            pass
        try:
            md = _core.gguf_metadata(str(path), array_limit=GGUF_METADATA_ARRAY_LIMIT)
            tok = GGUFTokenizer(md)
        except _clear_errors():
            return
        _exercise(tok)


class HFTokenizerTarget(Target):
    name = "hf_tokenizer"

    def seeds(self):
        from conveyor.testing import write_hf_checkpoint

        d = write_hf_checkpoint(self.work / "seed_hf", shape="tiny")
        return [json.dumps({"tokenizer.json": json.loads((d / "tokenizer.json").read_text()),
                            "tokenizer_config.json": json.loads((d / "tokenizer_config.json").read_text())}).encode()]

    def mutate(self, data, rnd):
        try:
            both = json.loads(data)
            key = rnd.choice(["tokenizer.json", "tokenizer_config.json"])
            both[key] = json.loads(mutate_json(json.dumps(both[key]), rnd))
            return json.dumps(both).encode()
        except (ValueError, KeyError, TypeError):
            return bytes(mutate_bytes(bytearray(data), rnd))

    def run(self, data):
        from conveyor.tokenizer import HFTokenizer

        d = self.work / "hf"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        try:
            both = json.loads(data)
            (d / "tokenizer.json").write_text(json.dumps(both["tokenizer.json"]))
            (d / "tokenizer_config.json").write_text(json.dumps(both["tokenizer_config.json"]))
        except (ValueError, KeyError, TypeError):
            (d / "tokenizer.json").write_bytes(data)
        try:
            tok = HFTokenizer(d / "tokenizer.json", d)
        except _clear_errors():
            return
        _exercise(tok)
        if tok.chat_template:
            try:
                tok.apply_chat_template([{"role": "user", "content": "hi"}])
            except ValueError:
                pass


class ChatTemplateTarget(Target):
    name = "chat_template"

    def seeds(self):
        return [TEMPLATE_PIECES[0].encode(), (TEMPLATE_PIECES[0] + TEMPLATE_PIECES[9]).encode()]

    def mutate(self, data, rnd):
        if rnd.random() < 0.8:
            return make_template(rnd).encode()
        return bytes(mutate_bytes(bytearray(data), rnd))

    def run(self, data):
        from conveyor.tokenizer import _render_template

        source = data.decode("utf-8", "replace")
        msgs = [{"role": "user", "content": "abc " * 50}, {"role": "assistant", "content": "ok"}]
        try:
            _render_template(source, msgs, True, "<s>", "</s>")
        except _clear_errors():
            pass


class ShardIndexTarget(Target):
    name = "shard_index"

    def seeds(self):
        from conveyor.testing import write_hf_checkpoint

        self.model = write_hf_checkpoint(self.work / "model", shape="tiny", tokenizer=False, shards=2)
        return [(self.model / "model.safetensors.index.json").read_bytes()]

    def mutate(self, data, rnd):
        return mutate_json(data.decode("utf-8", "replace"), rnd).encode("utf-8", "surrogatepass")

    def run(self, data):
        from conveyor import _core

        if not hasattr(self, "model"):
            self.seeds()
        (self.model / "model.safetensors.index.json").write_bytes(data)
        try:
            _core.Checkpoint(str(self.model)).close()
        except _clear_errors():
            pass


TARGETS = {t.name: t for t in (GGUFTokenizerTarget, HFTokenizerTarget, ChatTemplateTarget, ShardIndexTarget)}


def main(argv) -> int:
    if len(argv) < 4 or argv[0] not in TARGETS:
        print(__doc__, file=sys.stderr)
        print(f"targets: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    name, secs, work, crashes, corpora = argv[0], float(argv[1]), Path(argv[2]), Path(argv[3]), argv[4:]
    work.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"cv_fuzz_{name}_", dir=work))
    target = TARGETS[name](scratch)
    inputs = list(target.seeds())
    for d in corpora:
        if os.path.isdir(d):
            for f in sorted(os.listdir(d)):
                inputs.append(Path(d, f).read_bytes())
    # the memory limit: what the interpreter holds now, plus MEMORY_LIMIT_MIB
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm + (MEMORY_LIMIT_MIB << 20)
    if not os.environ.get("LD_PRELOAD"):  # under ASan the shadow memory makes it meaningless
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _alarm)
    rnd = random.Random()

    def one(data: bytes) -> bool:
        signal.setitimer(signal.ITIMER_REAL, PER_INPUT_SECONDS)
        try:
            target.run(data)
            return True
        except BaseException as e:  # noqa: BLE001 - every other outcome is a finding
            path = crashes / f"crash-{name}-{int(time.time() * 1000)}"
            path.write_bytes(data)
            print(f"fuzz_model_files: {name}: {type(e).__name__}: {str(e)[:300]}; input saved as {path}",
                  file=sys.stderr)
            import traceback

            traceback.print_exc()
            return False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    n = 0
    for data in inputs:
        n += 1
        if not one(data):
            return 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < secs:
        data = target.mutate(rnd.choice(inputs), rnd)
        n += 1
        if not one(data):
            return 1
    el = max(time.monotonic() - t0, 1e-9)
    print(f"stat::number_of_executed_units: {n}")
    print(f"stat::average_exec_per_sec: {int(n / el) if secs else 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
