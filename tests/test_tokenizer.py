"""Tokenizers: llama2.c (stories260K's tok512.bin and written ones) and HF tokenizer.json."""
import json
import random
import re
import struct
import warnings

import pytest

import conveyor
from conveyor.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "Tom said: \"Héllo, wörld!\"\nThen   he left.\t(42 apples) ",
    "café naïve 日本語 😀🎉 end",
    "a",
    " leading and trailing spaces ",
]


def _first_ids(tok: Llama2cTokenizer) -> dict:
    """Each piece's first id."""
    lookup = {}
    for i, p in enumerate(tok.pieces):
        lookup.setdefault(p, i)
    return lookup


def _naive_merge(tok: Llama2cTokenizer, lookup: dict, ids: list[int]) -> list[int]:
    """llama2.c's merging: the best-scored adjacent pair, rescanning every step."""
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            j = lookup.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if j is not None and tok.scores[j] > best:
                best, best_i, best_id = tok.scores[j], i, j
        if best_i < 0:
            return ids
        ids[best_i:best_i + 2] = [best_id]


def naive_llama2c_encode(tok: Llama2cTokenizer, text: str, bos: bool = True) -> list[int]:
    """llama2.c's encoder written as plainly as the format describes it (rescans every step)."""
    lookup = _first_ids(tok)
    ids = [1] if bos else []
    if text:
        ids.append(lookup[b" "])
    for ch in text:
        b = ch.encode()
        ids += [lookup[b]] if b in lookup else [x + 3 for x in b]
    return _naive_merge(tok, lookup, ids)


# ---------------------------------------------------------------------------- llama2.c


@pytest.fixture(scope="module")
def tok512(stories_dir):
    return load_tokenizer(stories_dir / "stories260K.bin")


def test_llama2c_found_beside_model(tok512, stories_dir):
    assert isinstance(tok512, Llama2cTokenizer) and isinstance(tok512, Tokenizer)
    assert tok512.path.name == "tok512.bin"
    assert tok512.vocab_size == 512
    assert (tok512.bos_id, tok512.eos_id, tok512.eos_ids) == (1, 2, [2, 1])
    assert tok512.special_ids == {0, 1, 2}
    assert tok512.strip_leading_space_after_bos
    explicit = load_tokenizer(stories_dir / "stories260K.bin", tokenizer=stories_dir / "tok512.bin")
    assert explicit.encode("Once upon a time") == tok512.encode("Once upon a time")


def test_llama2c_once_upon_a_time(tok512):
    ids = tok512.encode("Once upon a time")
    assert ids[0] == 1
    assert len(ids) < len("Once upon a time")  # merges happened
    assert tok512.decode(ids) == "Once upon a time"
    assert tok512.encode("Once upon a time", add_special_tokens=False) == ids[1:]
    # the dummy prefix: the first piece carries the word's leading space
    assert tok512.pieces[ids[1]].startswith(b" ")


@pytest.mark.parametrize("text", TEXTS)
def test_llama2c_round_trip_and_matches_naive(tok512, text):
    ids = tok512.encode(text)
    assert ids == naive_llama2c_encode(tok512, text)
    assert tok512.decode(ids) == text
    assert all(0 <= i < 512 for i in ids)


def test_llama2c_random_strings_match_naive(tok512):
    rng = random.Random(5)
    alphabet = "abcdefghij klmnopqrstuvwxyz ,.!?'\"\nABCTéü日😀"
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        ids = tok512.encode(text)
        assert ids == naive_llama2c_encode(tok512, text), text
        assert tok512.decode(ids) == text


@pytest.mark.parametrize("text", ["é", "😀", "naïve ☃ 😀!", "Ωμέγα"])
def test_llama2c_byte_fallback(tok512, text):
    ids = tok512.encode(text, add_special_tokens=False)
    outside = [c for c in text if c.encode() not in tok512.pieces]
    byte_ids = [i for i in ids if 3 <= i < 259]
    # characters outside the vocabulary become their UTF-8 bytes as byte tokens
    assert len(byte_ids) >= sum(len(c.encode()) for c in outside)
    assert tok512.decode(ids) == " " + text  # no BOS, so the dummy prefix stays
    assert tok512.decode([1] + ids) == text
    assert b"".join(tok512.token_bytes(i) for i in ids) == (" " + text).encode()


def test_llama2c_token_bytes_concat_equals_decode(tok512):
    text = TEXTS[1] + " " + TEXTS[3]
    ids = tok512.encode(text, add_special_tokens=False)
    raw = b"".join(tok512.token_bytes(i) for i in ids)
    assert raw.decode() == tok512.decode(ids)
    table = tok512.all_token_bytes()
    assert len(table) == 512 and table[1] == b"" and table[2] == b"" and table[0] == b""
    assert table[3 + 0x41] == b"A" and table[3 + 0xF0] == b"\xf0"
    assert tok512.all_token_bytes(600)[512:] == [b""] * 88


def test_llama2c_specials_and_bos_space(tok512):
    ids = tok512.encode("Hello there")
    assert tok512.decode(ids + [2]) == "Hello there"
    assert "<s>" in tok512.decode(ids, skip_special_tokens=False)
    # only the piece right after BOS loses its space
    assert tok512.decode(ids[1:]) == " Hello there"
    assert tok512.encode("") == [1] and tok512.encode("", add_special_tokens=False) == []


def test_llama2c_long_prompt(tok512):
    text = " ".join(TEXTS) * 60  # ~13k characters
    ids = tok512.encode(text)
    assert tok512.decode(ids) == text
    assert len(ids) < 0.6 * len(text)
    part = text[:700]
    assert tok512.encode(part) == naive_llama2c_encode(tok512, part)


def test_llama2c_default_chat_format(tok512):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok512.chat_template is None
    with pytest.warns(UserWarning, match="no chat template"):  # stated, not silent
        assert tok512.apply_chat_template(msgs) == "system: Be brief.\nuser: Hi\nassistant: "
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per tokenizer
        assert tok512.apply_chat_template(msgs, add_generation_prompt=False) == "system: Be brief.\nuser: Hi\n"


def test_llama2c_errors(tok512, tmp_path, stories_dir):
    with pytest.raises(TypeError):
        tok512.encode(b"bytes")
    with pytest.raises(TypeError):
        tok512.encode(None)
    with pytest.raises(TypeError):
        tok512.decode(["a"])
    with pytest.raises(ValueError):
        tok512.decode([-1])
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        load_tokenizer(missing)
    # a model with no tokenizer beside it
    lonely = tmp_path / "lonely" / "model.bin"
    lonely.parent.mkdir()
    lonely.write_bytes((stories_dir / "stories260K.bin").read_bytes()[:28])
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(lonely)
    # truncated tokenizer.bin
    good = (stories_dir / "tok512.bin").read_bytes()
    (lonely.parent / "tokenizer.bin").write_bytes(good[:1000])
    with pytest.raises(conveyor.ModelFormatError, match="truncated"):
        load_tokenizer(lonely)
    # a negative piece length
    bad = bytearray(good)
    struct.pack_into("<i", bad, 4 + 4, -5)
    (lonely.parent / "tokenizer.bin").write_bytes(bytes(bad))
    with pytest.raises(conveyor.ModelFormatError):
        load_tokenizer(lonely)


def test_written_llama2c_tokenizer(tiny_llama2c_path):
    tok = load_tokenizer(tiny_llama2c_path)
    assert tok.vocab_size == 512 and tok.path.name == "tokenizer.bin"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == naive_llama2c_encode(tok, text)
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXTS[1])) < len(TEXTS[1]) / 2
    assert sorted(tok.all_token_bytes()[3:259]) == [bytes([b]) for b in range(256)]


def _write_llama2c_vocab(path, pieces, scores):
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(len(p) for p in pieces)))
        for p, s in zip(pieces, scores):
            f.write(struct.pack("<fi", s, len(p)) + p)


def test_llama2c_crafted_vocabularies_match_naive(tmp_path):
    """Duplicate pieces (the first id holds the text), tied scores (the leftmost pair
    merges), scores at or below -1e10 (never merged), an empty piece and raw non-UTF-8
    pieces: the encoder (in C) agrees with the naive rescanning one on every text."""
    rng = random.Random(7)
    specials = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    chars = [c.encode() for c in "abc \u00e9\u65e5"]
    for v in range(10):
        extra = [b"".join(rng.choice(chars) for _ in range(rng.randint(1, 4))) for _ in range(150)]
        pieces = specials + chars + extra + [rng.choice(extra) for _ in range(20)] + [b"\xff", b"\x80a", b""]
        scores = [0.0] * 259 + [rng.choice([-1.0, -2.0, -1e11, round(rng.uniform(-5, 0), 2)])
                                for _ in range(len(pieces) - 259)]
        path = tmp_path / f"vocab{v}.bin"
        _write_llama2c_vocab(path, pieces, scores)
        tok = Llama2cTokenizer(path, len(pieces))
        for _ in range(100):
            text = "".join(rng.choice("abc \u00e9\u65e5x") for _ in range(rng.choice([1, 3, 10, 60])))
            assert tok.encode(text) == naive_llama2c_encode(tok, text), (v, text)


def naive_llama2c_exact_bytes(tok: Llama2cTokenizer, data: bytes) -> list[int]:
    """Each character of data (a valid UTF-8 sequence, else one byte) as its piece or its
    byte tokens, then llama2.c's merging, rescanning every step: no BOS, no dummy prefix."""
    lookup = _first_ids(tok)
    ids = []
    for ch in data.decode("utf-8", "surrogateescape"):
        b = ch.encode("utf-8", "surrogateescape")
        ids += [lookup[b]] if b in lookup else [x + 3 for x in b]
    return _naive_merge(tok, lookup, ids)


def test_llama2c_exact_bytes_of_invalid_utf8(tok512):
    """encode_exact_bytes: a valid UTF-8 sequence is a character, any other byte its
    own byte token (an encoded surrogate, a truncated sequence, a stray continuation
    byte); the ids' bytes are the data, and the merging is llama2.c's."""
    rng = random.Random(3)
    for _ in range(300):
        data = bytes(rng.choice(b"ab \xff\x80\xe6\x97\xa5\xed\xa0\xf0\x9f") for _ in range(rng.choice([1, 5, 40])))
        ids = tok512.encode_exact_bytes(data)
        assert b"".join(tok512.token_bytes(i) for i in ids) == data
        assert ids == naive_llama2c_exact_bytes(tok512, data), data


def test_llama2c_encode_runs_without_the_gil(tok512):
    """With the interpreter's switch interval at 10 s, a thread in pure Python holds
    the GIL until it is done; the encoder releases it, so this thread, waking every
    millisecond, keeps running."""
    import sys
    import threading

    text = "Once upon a time, there was a little girl named Lily. " * 20000
    done = []
    worker = threading.Thread(target=lambda: done.append(len(tok512.encode(text))))
    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        worker.start()
        spins = 0
        while worker.is_alive():
            worker.join(0.001)
            spins += 1
    finally:
        sys.setswitchinterval(old)
    assert done and done[0] > 100_000
    assert spins >= 10, spins


# ---------------------------------------------------------------------------- HF


@pytest.fixture(scope="module")
def hf_tok(tiny_hf_dir):
    return load_tokenizer(tiny_hf_dir)


def test_hf_basics(hf_tok, tiny_hf_dir):
    assert isinstance(hf_tok, HFTokenizer) and hf_tok.kind == "hf"
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    assert hf_tok.vocab_size == cfg["vocab_size"] == 512
    assert hf_tok.bos_id == cfg["bos_token_id"] and hf_tok.eos_id == cfg["eos_token_id"]
    assert hf_tok.eos_ids == [cfg["eos_token_id"]]
    assert {hf_tok.bos_id, hf_tok.eos_id} <= hf_tok.special_ids
    assert not hf_tok.strip_leading_space_after_bos
    assert hf_tok.style == "bytelevel"


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip(hf_tok, text):
    ids = hf_tok.encode(text)
    assert ids[0] == hf_tok.bos_id
    assert hf_tok.encode(text, add_special_tokens=False) == ids[1:]
    assert hf_tok.decode(ids) == text
    raw = b"".join(hf_tok.token_bytes(i) for i in ids if i not in hf_tok.special_ids)
    assert raw.decode() == text


def test_hf_token_bytes(hf_tok):
    table = hf_tok.all_token_bytes()
    assert len(table) == 512
    singles = {b for b in table if len(b) == 1}
    assert singles == {bytes([i]) for i in range(256)}  # byte-complete
    ids = hf_tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and any(len(table[i]) == 1 for i in ids)  # a character split across ids
    assert b"".join(table[i] for i in ids) == "😀".encode()
    assert hf_tok.token_bytes(hf_tok.eos_id) == b"</s>"


def test_hf_special_tokens(hf_tok):
    ids = hf_tok.encode("hello")
    full = ids + [hf_tok.eos_id]
    assert hf_tok.decode(full) == "hello"
    assert hf_tok.decode(full, skip_special_tokens=False) == "<s>hello</s>"


def test_hf_chat_template(hf_tok):
    assert hf_tok.chat_template and "messages" in hf_tok.chat_template
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Thanks"}]
    out = hf_tok.apply_chat_template(msgs)
    # the written template renders the same text as the built-in format
    assert out == "user: What is 2+2?\nassistant: 4\nuser: Thanks\nassistant: "
    assert hf_tok.decode(hf_tok.encode(out)) == out
    with pytest.raises(ValueError):
        hf_tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(TypeError):
        hf_tok.apply_chat_template("hello")
    with pytest.raises(TypeError):
        hf_tok.apply_chat_template([{"role": "user", "content": 3}])


def test_hf_errors(hf_tok, tmp_path):
    with pytest.raises(TypeError):
        hf_tok.encode(123)
    empty = tmp_path / "empty_model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(empty)
    (empty / "tokenizer.json").write_text("{not json")
    with pytest.raises(conveyor.ModelFormatError):
        load_tokenizer(empty)


def _metaspace_tokenizer(folder):
    """A small SentencePiece-style tokenizer.json (Metaspace, byte fallback), like Llama-2's."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in ["\u2581", "a", "b", "c", "h", "e", "l", "o", "\u2581h", "\u2581he", "ll", "\u2581hell",
              "\u2581hello", "\u2581a", "\u2581c", "ab", "\u2581ab"]:
        vocab[p] = len(vocab)
    merges = ["\u2581 h", "\u2581h e", "l l", "\u2581he ll", "\u2581hell o", "\u2581 a", "\u2581 c", "a b",
              "\u2581 ab"]
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for c, i in list(vocab.items())[:3]],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                          "split": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "vocab": vocab, "merges": merges},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def test_hf_metaspace_byte_fallback(tmp_path):
    _metaspace_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.style == "metaspace" and tok.strip_leading_space_after_bos
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    text = "hello abc é"
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text
    body = ids[1:]
    assert any(3 <= i < 259 for i in body)  # "é" came as byte tokens
    raw = b"".join(tok.token_bytes(i) for i in body)
    assert raw == (" " + text).encode()  # the dummy-prefix space that decode strips after BOS
    assert tok.token_bytes(tok.encode("hello", add_special_tokens=False)[0]) == b" hello"


def test_chat_template_rendered_with_jinja(hf_tok, monkeypatch):
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    monkeypatch.setattr(hf_tok, "chat_template", chatml)
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf_tok.apply_chat_template(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    monkeypatch.setattr(hf_tok, "chat_template", "{% for m in messages %}{{ m.role }")
    with pytest.raises(conveyor.ModelFormatError, match="not valid Jinja"):
        hf_tok.apply_chat_template(msgs)
    monkeypatch.setattr(hf_tok, "chat_template", "{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="only user turns"):
        hf_tok.apply_chat_template(msgs)


def test_load_tokenizer_passes_instances_through(hf_tok, tiny_hf_dir):
    assert load_tokenizer(tiny_hf_dir, tokenizer=hf_tok) is hf_tok
    assert load_tokenizer(tiny_hf_dir, tokenizer=tiny_hf_dir / "tokenizer.json").encode("hi") == hf_tok.encode("hi")


# ---------------------------------------------------------------------------- GGUF

from conveyor.tokenizer import GGUFTokenizer, GGUF_PRE_TOKENIZERS  # noqa: E402

GGUF_TEXTS = [
    "Hello world! 12345  spaces\t\ttab\n\nnewline héllo 日本語 🙂",
    "   leading spaces and trailing   ",
    "snake_case_name = foo(bar, 42); x+=1 // it's what they've said",
    "Ça va? Größe, naïve café — “quotes” and 'single' ones.\r\n",
    "Once upon a time, there was a little girl named Lily.",
    "",
    " ",
    "\n\n\n",
]


def _gguf_meta(tmp_path, **kw):
    from conveyor.gguf import GGUFReader
    from conveyor.testing import write_gguf_checkpoint

    return GGUFReader(write_gguf_checkpoint(tmp_path / "m.gguf", **kw)).metadata


def test_gguf_gpt2_matches_hf_tokenizer(tmp_path, hf_tok):
    """The test vocabulary stored in GGUF metadata (pre-tokenizer "gpt2") encodes like the
    same vocabulary in tokenizer.json (HF's ByteLevel with the GPT-2 regex)."""
    tok = GGUFTokenizer(_gguf_meta(tmp_path, shape="tiny", tokenizer="gpt2"))
    assert tok.kind == "gguf" and tok.vocab_size == hf_tok.vocab_size
    assert (tok.bos_id, tok.eos_ids) == (hf_tok.bos_id, hf_tok.eos_ids)
    from conveyor.testing import CORPUS

    for text in GGUF_TEXTS + CORPUS.splitlines():
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.all_token_bytes() == hf_tok.all_token_bytes()
    assert tok.chat_template == hf_tok.chat_template


def test_gguf_llama_matches_llama2c_tokenizer(tmp_path, tiny_llama2c_path):
    """The SentencePiece-style test vocabulary in GGUF form ("▁" spaces, scores, <0xNN>
    bytes) encodes like the llama2.c tokenizer that holds the same pieces and scores."""
    ref = Llama2cTokenizer(tiny_llama2c_path.parent / "tokenizer.bin", 512)
    tok = GGUFTokenizer(_gguf_meta(tmp_path, shape="tiny", tokenizer="llama"))
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    from conveyor.testing import CORPUS

    texts = [t for t in GGUF_TEXTS if t.strip()] + CORPUS.splitlines()
    for text in texts:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text, text
    for i in range(3, 259):
        assert tok.token_bytes(i) == bytes([i - 3])  # <0xNN> byte tokens
    assert tok.strip_leading_space_after_bos
    assert tok.encode("<s>hi", add_special_tokens=False)[0] == 1  # control token matched whole


def test_gguf_pre_tokenizers(tmp_path):
    md = _gguf_meta(tmp_path, shape="tiny", tokenizer="gpt2")
    text = "Hello,world 12345 it's\n\n  x!?"

    def pieces(pre):
        tok = GGUFTokenizer(dict(md, **{"tokenizer.ggml.pre": pre}))
        return [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str(text)]

    assert pieces("gpt2") == ["Hello", ",", "world", "Ġ12345", "Ġit", "'s", "ĊĊĠ", "Ġx", "!?"]
    assert pieces("smollm") == ["Hello", ",", "world", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s", "ĊĊĠ", "Ġx", "!?"]
    assert pieces("llama-bpe") == ["Hello", ",world", "Ġ", "123", "45", "Ġit", "'s", "ĊĊ", "Ġ", "Ġx", "!?"]
    assert pieces("qwen2") == ["Hello", ",world", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s", "ĊĊ", "Ġ", "Ġx", "!?"]
    assert "".join(pieces("default")) == "".join(pieces("gpt2"))
    # Llama 3 vocabularies take a word that is a token whole, even with no merges to it
    from conveyor.testing import SHAPES

    big = _gguf_meta(tmp_path, shape=dict(SHAPES["tiny"], vocab_size=4000), tokenizer="gpt2")
    last = len(big["tokenizer.ggml.tokens"]) - 1  # a padding word no merge leads to
    word = GGUFTokenizer(big).token_bytes(last).decode()
    llama3 = GGUFTokenizer(dict(big, **{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.encode(word, add_special_tokens=False) == [last]
    assert len(GGUFTokenizer(big).encode(word, add_special_tokens=False)) > 1
    unsaid = {k: v for k, v in big.items() if k != "tokenizer.ggml.add_bos_token"}  # llama.cpp's defaults
    assert GGUFTokenizer(dict(unsaid, **{"tokenizer.ggml.pre": "llama-bpe"})).add_bos_token
    assert not GGUFTokenizer(unsaid).add_bos_token
    assert {"default", "smollm", "llama-bpe", "qwen2"} <= set(GGUF_PRE_TOKENIZERS)
    with pytest.raises(conveyor.UnsupportedError, match="pre-tokenizer 'nope'"):
        GGUFTokenizer(dict(md, **{"tokenizer.ggml.pre": "nope"}))


def test_gguf_tokenizer_bad_metadata(tmp_path):
    md = _gguf_meta(tmp_path, shape="tiny", tokenizer="gpt2")
    with pytest.raises(conveyor.ModelFormatError, match="no tokenizer"):
        GGUFTokenizer({})
    with pytest.raises(conveyor.UnsupportedError, match="'bert'"):
        GGUFTokenizer(dict(md, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(conveyor.ModelFormatError, match="tokens must be a list"):
        GGUFTokenizer(dict(md, **{"tokenizer.ggml.tokens": "abc"}))
    with pytest.raises(conveyor.ModelFormatError, match="token types for"):
        GGUFTokenizer(dict(md, **{"tokenizer.ggml.token_type": [1, 1]}))
    with pytest.raises(conveyor.ModelFormatError, match="eos_token_id"):
        GGUFTokenizer(dict(md, **{"tokenizer.ggml.eos_token_id": 10**6}))
    with pytest.raises(conveyor.ModelFormatError, match="merges is missing"):
        GGUFTokenizer({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TypeError):
        GGUFTokenizer([1, 2])


def test_gguf_without_template_warns_once(tmp_path):
    tok = GGUFTokenizer(_gguf_meta(tmp_path, shape="tiny", tokenizer="gpt2", chat_template=None))
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.warns(UserWarning, match="no chat template"):
        assert tok.apply_chat_template(msgs) == "user: Hi\nassistant: "
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok.apply_chat_template(msgs)


def test_load_tokenizer_reads_gguf(tmp_path):
    from conveyor.testing import write_gguf_checkpoint

    path = write_gguf_checkpoint(tmp_path / "m.gguf", shape="tiny", tokenizer="llama")
    tok = load_tokenizer(path)
    assert isinstance(tok, GGUFTokenizer) and tok.path == path and tok.model == "llama"
    bare = write_gguf_checkpoint(tmp_path / "bare.gguf", shape="tiny", tokenizer=None)
    with pytest.raises(conveyor.ModelFormatError, match="no tokenizer"):
        load_tokenizer(bare)


# The real SmolLM2 vocabulary, checked against an independent byte-level BPE written here
# from the definitions (SmolLM's pre-tokenizer: digits one by one, then the GPT-2 regex;
# Python's re stands in for \p{L}/\p{N} with [^\W\d_]/\d, exact for the texts used).

_L, _N, _P = r"[^\W\d_]", r"\d", r"(?:[^\s\w]|_)"
_GPT2_RE = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_L}+| ?{_N}+| ?{_P}+|\s+(?!\S)|\s+")


def _naive_smollm_encode(text, tokens, merges, specials):
    from conveyor.tokenizer import _bytes_to_unicode

    table = _bytes_to_unicode()
    ids = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    out = []
    split = re.split("(" + "|".join(re.escape(s) for s in specials) + ")", text)
    for k, part in enumerate(split):
        if k % 2:
            out.append(ids[part])
            continue
        for chunk in re.split(r"(\d)", part):
            for word in _GPT2_RE.findall(chunk):
                syms = [table[b] for b in word.encode("utf-8")]
                while len(syms) > 1:
                    best = min(range(len(syms) - 1), key=lambda i: rank.get((syms[i], syms[i + 1]), 1 << 30))
                    if (syms[best], syms[best + 1]) not in rank:
                        break
                    syms[best:best + 2] = [syms[best] + syms[best + 1]]
                out += [ids[s] for s in syms]
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from conveyor.gguf import GGUFReader

    md = GGUFReader(smollm2_gguf).metadata
    return GGUFTokenizer(md), md


SMOLLM_TEXTS = GGUF_TEXTS + [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The year 2024 had 366 days;   three   spaces, tabs\t\tand\u00a0nbsp.",
    "<|endoftext|><|im_end|>x<|im_start|>",
]


def test_smollm2_specials_are_single_ids(smollm2):
    tok, md = smollm2
    tokens = md["tokenizer.ggml.tokens"]
    assert tok.encode("<|im_start|>") == [1] and tokens[1] == "<|im_start|>"
    assert tok.encode("<|im_end|>") == [2] == tok.eos_ids
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.bos_id == 1 and tok.pad_id == 2 and tok.add_bos_token is False
    assert tok.encode("\n") == [tokens.index("Ċ")]
    assert tok.encode(" Paris") == [tokens.index("ĠParis")]
    assert tok.encode("x<|im_end|>y") == [tokens.index("x"), 2, tokens.index("y")]


@pytest.mark.parametrize("text", SMOLLM_TEXTS)
def test_smollm2_matches_independent_bpe(smollm2, text):
    tok, md = smollm2
    tokens = md["tokenizer.ggml.tokens"]
    specials = [t for t, ty in zip(tokens, md["tokenizer.ggml.token_type"]) if ty == 3]
    ids = tok.encode(text)
    assert ids == _naive_smollm_encode(text, tokens, md["tokenizer.ggml.merges"], specials)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_smollm2_chat_template_is_chatml(smollm2):
    tok, md = smollm2
    assert tok.chat_template == md["tokenizer.chat_template"]
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi there!<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs) == want
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want[:-len("<|im_start|>assistant\n")]
    # without a system message the template supplies SmolLM's own
    text = tok.apply_chat_template(msgs[1:])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = tok.encode(want)
    assert ids.count(1) == 3 and ids.count(2) == 2  # each marker one id


def test_gguf_llama_without_space_prefix(tmp_path):
    md = _gguf_meta(tmp_path, shape="tiny", tokenizer="llama",
                    extra_metadata={"tokenizer.ggml.add_space_prefix": False})
    tok = GGUFTokenizer(md)
    with_prefix = GGUFTokenizer(dict(md, **{"tokenizer.ggml.add_space_prefix": True}))
    assert not tok.strip_leading_space_after_bos
    assert tok.token_bytes(tok.encode("the", add_special_tokens=False)[0])[:1] != b" "
    assert with_prefix.token_bytes(with_prefix.encode("the", add_special_tokens=False)[0])[:1] == b" "
    assert tok.decode(tok.encode("the cat")) == "the cat" == with_prefix.decode(with_prefix.encode("the cat"))
