"""GGUF tokenizers built from C tables: the same ids as the Python builder they replace
(recorded in tests/data/gguf_tokenizer_ids.json), the C SentencePiece encoder equal to HF
`tokenizers` running the merge list, merges from scores equal to their definition, and
crafted vocabularies loaded, or refused with a clear error, within bounded memory and time."""
import hashlib
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import conveyor
from conveyor import _core, _testing
from conveyor.gguf_tokenizer import MERGE_MAX_TOKEN_CHARS, GGUFTokenizer
from conveyor.gguf_tokenizer_reference import MERGE_BUDGET_BYTES, build_hf_tokenizer, merge_budget, score_merges

DATA = Path(__file__).parent / "data" / "gguf_tokenizer_ids.json"


# ---------------------------------------------------------------------------- merges from scores


def _reference_merges(tokens, scores, types):
    """The definition, spelled out: every split (a, b) of every normal or user-defined
    token t of 2..MERGE_MAX_TOKEN_CHARS characters with a and b in the vocabulary (a text
    known by its first id), sorted by t's score (best first), then the ids of t, a, b."""
    first = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    found = []
    for i, t in enumerate(tokens):
        if (types is not None and types[i] not in (1, 4)) or not 2 <= len(t) <= MERGE_MAX_TOKEN_CHARS:
            continue
        for k in range(1, len(t)):
            if t[:k] in first and t[k:] in first:
                found.append((-scores[i], i, first[t[:k]], first[t[k:]]))
    return [(tokens[a], tokens[b]) for _, _, a, b in sorted(found)]


def _vocab(rng, n):
    alphabet = "ab▁cé日🙂 \n"
    tokens = list(alphabet)
    while len(tokens) < n:
        tokens.append("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7))))
    return tokens


@pytest.mark.parametrize("seed", range(6))
def test_score_merges_equal_the_definition(seed):
    rng = random.Random(seed)
    tokens = _vocab(rng, 400)  # duplicates included: a text keeps its first id
    scores = [rng.choice([-1.5, 0.0, 2.0, float(rng.randint(-50, 50))]) for _ in tokens]
    types = [rng.choice([1, 1, 1, 1, 2, 3, 4, 5, 6]) for _ in tokens]
    assert score_merges(tokens, scores, types) == _reference_merges(tokens, scores, types)
    assert score_merges(tokens, scores, None) == _reference_merges(tokens, scores, None)
    # the hash seed changes nothing
    for s in (0, 1, 2**64 - 1):
        assert _testing.gguf_score_merges(tokens, scores, types, max_token_chars=MERGE_MAX_TOKEN_CHARS,
                                          max_merges=10**6, seed=s) == _reference_merges(tokens, scores, types)


def test_score_merges_skip_long_tokens_and_share_strings():
    tokens = ["a", "aa", "a" * 128, "a" * 129, "a" * 127]
    merges = score_merges(tokens, [0.0, 1.0, 3.0, 4.0, 2.0], None)
    assert merges == _reference_merges(tokens, [0.0, 1.0, 3.0, 4.0, 2.0], None)
    assert ("a", "a" * 128) not in merges and ("a", "a" * 127) in merges  # 129 characters: not split
    assert all(a is tokens[tokens.index(a)] for a, _ in merges)  # the pairs reuse the token strings


_FROM_LISTS = {  # the two C builders that read a vocabulary from Python lists
    "merge list": lambda t, s, ty: _testing.gguf_score_merges(t, s, ty, max_token_chars=128, max_merges=10, seed=0),
    "encoder": lambda t, s, ty: _core.SpmTokenizer(t, s, ty, unk_id=-1, add_space_prefix=True, max_token_chars=128,
                                                   seed=0),
}


@pytest.mark.parametrize("build", _FROM_LISTS)
def test_vocabulary_lists_bad_input(build):
    build = _FROM_LISTS[build]
    with pytest.raises(conveyor.ModelFormatError, match="score of token 1 is NaN"):
        build(["a", "b"], [0.0, float("nan")], None)
    with pytest.raises(conveyor.ModelFormatError, match="1 scores for 2 tokens"):
        build(["a", "b"], [0.0], None)
    with pytest.raises(conveyor.ModelFormatError, match="2 token types for 1 tokens"):
        build(["a"], [0.0], [1, 1])
    with pytest.raises(conveyor.ModelFormatError, match="token 1 is a bytes"):
        build(["a", b"b"], [0.0, 0.0], None)
    with pytest.raises(conveyor.ModelFormatError, match="score 0 is a str"):
        build(["a"], ["x"], None)
    with pytest.raises(TypeError, match="tokens must be a list"):
        build(("a",), [0.0], None)


def test_score_merges_bad_input():
    with pytest.raises(conveyor.ModelFormatError, match="more than 1 merges"):
        _testing.gguf_score_merges(["a", "b", "ab", "ba"], [0.0] * 4, None, max_token_chars=128, max_merges=1, seed=0)
    with pytest.raises(ValueError, match="max_token_chars"):
        _testing.gguf_score_merges(["a"], [0.0], None, max_token_chars=1, max_merges=1, seed=0)


# ---------------------------------------------------------------------------- the budget


def _dense_gguf(path, length, max_chars, filler=0, seed=0):
    """A tokenizer-only GGUF whose tokens are every substring of up to max_chars characters
    of one random string of ``length`` characters, so every split of every token is a
    merge; ``filler`` more random tokens of 120 characters add bytes but no merges."""
    from conveyor.gguf import GGUFValueType as VT, GGUFWriter

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    s = "".join(rng.choice(alphabet) for _ in range(length))
    tokens = ["<unk>", "<s>", "</s>"] + sorted({s[i:i + n] for n in range(1, max_chars + 1)
                                                for i in range(length - n + 1)}, key=lambda t: (len(t), t))
    tokens += ["".join(rng.choice(alphabet) for _ in range(120)) for _ in range(filler)]
    w = GGUFWriter(path)
    w.add("general.architecture", "llama")
    w.add("tokenizer.ggml.model", "llama")
    w.add("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING)
    w.add("tokenizer.ggml.scores", [0.0] * 3 + [-float(len(t)) for t in tokens[3:]], VT.ARRAY, VT.FLOAT32)
    w.add("tokenizer.ggml.token_type", [2, 3, 3] + [1] * (len(tokens) - 3), VT.ARRAY, VT.INT32)
    w.add("tokenizer.ggml.unknown_token_id", 0, VT.UINT32)
    w.add("tokenizer.ggml.add_space_prefix", False, VT.BOOL)
    return w.write(), tokens


def _peak_child(code: str) -> tuple[str, float, float]:
    """Runs code in a child after importing conveyor and tokenizers: (its stdout, the
    seconds code took, how far it raised the peak RSS in MiB)."""
    prelude = ("import resource, time\nimport conveyor, conveyor.gguf_tokenizer, conveyor.gguf_tokenizer_reference, "
               "tokenizers\n"
               "rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\nt0 = time.monotonic()\n")
    tail = ("\nprint('PEAK', time.monotonic() - t0, "
            "(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)")
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code) + tail],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    took, mib = r.stdout.rsplit("PEAK", 1)[1].split()
    return r.stdout, float(took), float(mib)


def test_dense_vocabulary_loads_within_bounds(tmp_path):
    """A crafted file: 1.95 MB of tokens, every substring of up to 128
    characters of one random string, so every split of every token is a merge (~1.5 M,
    +879 MiB before). The C encoder builds no merge list: it loads and encodes within
    512 MiB and 5 s."""
    path, tokens = _dense_gguf(tmp_path / "dense.gguf", length=270, max_chars=128)
    size = path.stat().st_size
    assert 1_800_000 < size <= 2_000_000, size
    whole = "".join(t for t in tokens[3:] if len(t) == 1)  # not the string, but its characters
    longest = tokens[-1]
    out, took, mib = _peak_child(f"""
        tok = conveyor.gguf_tokenizer.GGUFTokenizer.from_file({str(path)!r})
        print("LONGEST", tok.encode({longest!r}, add_special_tokens=False))
        print("MIXED", len(tok.encode({whole!r} * 20)))
    """)
    print(f"took {took:.2f} s, peak RSS +{mib:.0f} MiB")
    assert f"LONGEST [{len(tokens) - 1}]" in out, out
    assert "MIXED " in out
    assert took < 5.0, f"{took:.1f} s"
    assert mib < 512, f"peak RSS grew by {mib:.0f} MiB"


def test_dense_merge_list_is_a_clear_error_within_bounds(tmp_path):
    """The same file as a merge list for HF `tokenizers` (the reference): more merges than
    the budget of its size, a ModelFormatError naming them, within 512 MiB and 5 s."""
    path, tokens = _dense_gguf(tmp_path / "dense.gguf", length=270, max_chars=128)
    assert sum(len(t) - 1 for t in tokens[3:]) > 3 * merge_budget(tokens)
    out, took, mib = _peak_child(f"""
        md = conveyor._core.gguf_metadata({str(path)!r})
        try:
            conveyor.gguf_tokenizer_reference.build_hf_tokenizer(md)
        except conveyor.ModelFormatError as e:
            print("ERROR", e)
    """)
    print(f"took {took:.2f} s, peak RSS +{mib:.0f} MiB")
    assert "ERROR GGUF tokenizer: the scores give more than" in out, out
    assert f"one merge per {MERGE_BUDGET_BYTES} bytes" in out
    assert took < 5.0, f"{took:.1f} s"
    assert mib < 512, f"peak RSS grew by {mib:.0f} MiB"


def test_merges_just_inside_the_budget_load_within_bounds(tmp_path):
    """A <= 2 MB file whose scores give nearly as many merges as its budget allows: its
    merge list loads within 512 MiB and 5 s, and the C encoder gives its ids."""
    path, tokens = _dense_gguf(tmp_path / "near.gguf", length=130, max_chars=128, filler=8200)
    assert path.stat().st_size <= 2_000_000
    n_merges = len(score_merges(tokens, [0.0] * len(tokens), None))
    assert 300_000 < n_merges <= merge_budget(tokens) < 1.2 * n_merges
    rng = random.Random(1)
    texts = [tokens[-8201], tokens[-1]] + ["".join(rng.choice(tokens[3:300]) for _ in range(30)) for _ in range(20)]
    out, took, mib = _peak_child(f"""
        md = conveyor._core.gguf_metadata({str(path)!r})
        hf = conveyor.gguf_tokenizer_reference.build_hf_tokenizer(md)
        tok = conveyor.gguf_tokenizer.GGUFTokenizer(md)
        for text in {texts!r}:
            assert tok.encode(text) == hf.encode(text).ids, text
        print("IDS", tok.encode({texts[0]!r}, add_special_tokens=False))
    """)
    print(f"took {took:.2f} s, peak RSS +{mib:.0f} MiB")
    assert f"IDS [{len(tokens) - 8201}]" in out, out
    assert took < 5.0, f"{took:.1f} s"
    assert mib < 512, f"peak RSS grew by {mib:.0f} MiB"


# ---------------------------------------------------------------------------- C encoder = HF BPE


def _check_against_hf(tok, hf, texts):
    """tok (the C encoder) against hf (`tokenizers` with the merge list): ids, and decodes
    with and without special tokens."""
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
        plain = [i for i in ids if i not in tok.special_ids]
        assert tok.decode(ids) == hf.decode(plain, skip_special_tokens=True), text


def _random_texts(rng, pieces, n, length=40):
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, length))) for _ in range(n)]


def test_encoder_matches_hf_on_the_test_vocabulary(tmp_path):
    from conveyor.gguf import GGUFReader
    from conveyor.testing import write_gguf_checkpoint

    for prefix in (True, False):
        md = GGUFReader(write_gguf_checkpoint(tmp_path / f"m{prefix}.gguf", shape="tiny", tokenizer="llama",
                                              extra_metadata={"tokenizer.ggml.add_space_prefix": prefix})).metadata
        tok, hf = GGUFTokenizer(md), build_hf_tokenizer(md)
        pieces = list("abcdefghij klmnop  \t\n.,!?'") + ["the", " cat", "<s>", "</s>", "<unk>", "▁", "é", "日本", "🙂",
                                                       "\u0301", "<0x41>", "\x00", "  "]
        _check_against_hf(tok, hf, _random_texts(random.Random(prefix), pieces, 300))


def test_encoder_matches_hf_on_crafted_vocabularies():
    """Duplicated texts, an unknown token without byte tokens (runs fused), user-defined
    and control tokens inside words, an empty token, equal scores, tokens that are never
    split (unused, byte): the C encoder and the merge list agree."""
    for seed in range(8):
        rng = random.Random(seed)
        alphabet = list("ab▁c日")
        tokens = ["<unk>", "<s>", "", "<ctl>", "b▁", "ab", "<0x41>"] + alphabet
        while len(tokens) < 200:
            tokens.append("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
        tokens += tokens[20:40]  # duplicates
        types = [2, 3, 3, 3, 4, 4, 6] + [rng.choice([1, 1, 1, 1, 4, 5, 6]) for _ in tokens[7:]]
        scores = [float(rng.randint(-3, 3)) for _ in tokens]
        md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
              "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
              "tokenizer.ggml.add_space_prefix": bool(seed % 2)}
        tok, hf = GGUFTokenizer(md), build_hf_tokenizer(md)
        pieces = alphabet + [" ", "x", "yz", "<s>", "<ctl>", "b ", "ab", "A", "é", "🙂"]
        _check_against_hf(tok, hf, _random_texts(rng, pieces, 150))


def test_overlong_special_token_is_a_clear_error():
    """Tokens cut out of the text whole are matched at every position of every prompt; one
    longer than 256 bytes (real ones: 31 at most) is refused when the file is read."""
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "<" + "x" * 300 + ">"],
          "tokenizer.ggml.scores": [0.0, 0.0, 0.0], "tokenizer.ggml.token_type": [2, 1, 4]}
    with pytest.raises(conveyor.ModelFormatError, match="token 2 .* is 302 bytes long; such tokens may have at most 256"):
        GGUFTokenizer(md)
    md["tokenizer.ggml.token_type"] = [2, 1, 1]  # a normal token of that length is fine
    assert GGUFTokenizer(md).encode("a", add_special_tokens=False) == [1]


def test_encoder_matches_hf_on_gemma3(gemma3_file):
    md = _core.gguf_metadata(str(gemma3_file), array_limit=1 << 16)
    tok, hf = GGUFTokenizer(md), build_hf_tokenizer(md)
    rng = random.Random(3)
    words = [t.replace("▁", " ") for t in rng.sample(md["tokenizer.ggml.tokens"], 3000)]
    pieces = words + list(" \n\t.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`0123456789") + ["  ", "\n\n", "🙂", "👍🏽", "\u200d"]
    _check_against_hf(tok, hf, _random_texts(rng, pieces, 400, length=25))


# ---------------------------------------------------------------------------- real vocabularies


def _attributes(tok):
    h = hashlib.sha256()
    for b in tok.all_token_bytes():
        h.update(len(b).to_bytes(4, "little") + b)
    return {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_ids": tok.eos_ids,
            "special_ids": sorted(tok.special_ids), "add_bos_token": tok.add_bos_token,
            "add_eos_token": tok.add_eos_token, "style": tok.style, "byte_fallback": tok.byte_fallback,
            "strip_leading_space_after_bos": tok.strip_leading_space_after_bos,
            "token_bytes_sha256": h.hexdigest(),
            "chat_template_sha256": hashlib.sha256((tok.chat_template or "").encode()).hexdigest()}


def _check_recorded(tok, name):
    data = json.loads(DATA.read_text())
    texts, want = data["texts"], data[name]
    assert len(texts) >= 300
    for text, ids, decoded in zip(texts, want["ids"], want["decoded"]):
        got = tok.encode(text)
        assert got == ids, text
        assert tok.decode(got) == decoded, text
    assert _attributes(tok) == want["attributes"]


def test_gemma3_tokenizer_equals_recorded(gemma3_file):
    """Gemma 3's 262k SentencePiece vocabulary (514,847 merges from scores): the ids,
    decodes and per-id bytes the Python builder gave on a corpus of English, code,
    Unicode, whitespace runs, emoji and control tokens."""
    tok = GGUFTokenizer.from_file(gemma3_file)
    assert tok.vocab_size == 262144 and tok.model == "llama"
    _check_recorded(tok, "gemma3")


def test_smollm2_tokenizer_equals_recorded(smollm2_gguf):
    tok = GGUFTokenizer.from_file(smollm2_gguf)
    assert tok.model == "gpt2"
    _check_recorded(tok, "smollm2")
