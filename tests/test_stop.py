"""Stop strings (csrc/core/stop.c) through conveyor._testing.stop_find / stop_holdback.

stop_find(stops, text, new_from): the match that starts first among those that
end after byte new_from (ties: the stop listed first), as (index, start), or None.
stop_holdback(stops, text): the longest suffix of text that is a proper prefix
of some stop string.
"""
import pytest
from hypothesis import given, settings, strategies as st

from conveyor import _testing


def ref_find(stops, text, new_from):
    for start in range(len(text)):
        for i, s in enumerate(stops):
            if text.startswith(s, start) and start + len(s) > new_from:
                return (i, start)
    return None


def ref_holdback(stops, text):
    for k in range(len(text), 0, -1):
        if any(len(s) > k and text.endswith(s[:k]) for s in stops):
            return k
    return 0


# ---- find -----------------------------------------------------------------

@pytest.mark.parametrize("text, start", [
    (b"STOP and more", 0),
    (b"before STOP after", 7),
    (b"ends with STOP", 10),
    (b"STOP", 0),
])
def test_match_at_start_middle_end(text, start):
    assert _testing.stop_find([b"STOP"], text, 0) == (0, start)


def test_no_match():
    assert _testing.stop_find([b"STOP"], b"STO P stop", 0) is None
    assert _testing.stop_find([b"STOP"], b"", 0) is None
    assert _testing.stop_find([], b"anything", 0) is None
    assert _testing.stop_find([b"longer than text"], b"short", 0) is None


def test_match_across_old_and_new_bytes():
    text = b"hello ST" + b"OP world"
    new_from = len(b"hello ST")
    assert _testing.stop_find([b"STOP"], text, new_from) == (0, 6)
    # ending exactly at the first new byte still counts
    assert _testing.stop_find([b"STOP"], b"xxSTO" + b"P", 5) == (0, 2)


def test_match_wholly_in_old_text_is_not_reported_again():
    text = b"a STOP b" + b" more"
    assert _testing.stop_find([b"STOP"], text, len(b"a STOP b")) is None
    # ...but a second occurrence in the new bytes is
    assert _testing.stop_find([b"STOP"], text + b" STOP", len(text)) == (0, len(text) + 1)
    # a match ending at the last old byte is old
    assert _testing.stop_find([b"STOP"], b"xSTOP" + b"y", 5) is None


def test_no_new_bytes_means_no_match():
    assert _testing.stop_find([b"ab"], b"xxab", 4) is None


def test_earliest_start_wins_across_stop_strings():
    stops = [b"world", b"lo w", b"o"]
    assert _testing.stop_find(stops, b"hello world", 0) == (1, 3)
    assert _testing.stop_find([b"world", b"o"], b"hello world", 0) == (1, 4)
    assert _testing.stop_find([b"world", b"hello"], b"hello world", 0) == (1, 0)
    # a longer string starting earlier beats a shorter one ending earlier
    assert _testing.stop_find([b"cd", b"abcdef"], b"xabcdef", 0) == (1, 1)


def test_same_start_first_listed_wins():
    assert _testing.stop_find([b"ab", b"abc"], b"xabc", 0) == (0, 1)
    assert _testing.stop_find([b"abc", b"ab"], b"xabc", 0) == (0, 1)
    assert _testing.stop_find([b"abc", b"ab"], b"xabd", 0) == (1, 1)


def test_utf8_multibyte_stop_strings():
    stop = "終了".encode()  # 6 bytes
    text = "これで終了です".encode()
    assert _testing.stop_find([stop], text, 0) == (0, len("これで".encode()))
    # split in the middle of a character by the old/new boundary
    cut = len("これで終".encode()) - 1
    assert _testing.stop_find([stop], text, cut) == (0, len("これで".encode()))
    # a byte prefix of a character is not a match of another character
    assert _testing.stop_find(["é".encode()], "e\u0301 è".encode(), 0) is None
    assert _testing.stop_find(["😀".encode(), b"x"], "a😀x".encode(), 0) == (0, 1)


def test_nul_bytes_are_ordinary():
    assert _testing.stop_find([b"\x00b"], b"a\x00\x00b", 0) == (0, 2)


# ---- holdback -------------------------------------------------------------

@pytest.mark.parametrize("stops, text, want", [
    ([b"STOP"], b"hello S", 1),
    ([b"STOP"], b"hello ST", 2),
    ([b"STOP"], b"hello STO", 3),
    ([b"STOP"], b"hello STOP", 0),   # a full match is found, not held back
    ([b"STOP"], b"hello", 0),
    ([b"STOP"], b"", 0),
    ([b"a"], b"aaaa", 0),            # one byte strings have no proper prefix
    ([b"abab"], b"xaba", 3),
    ([b"abab"], b"ababab", 2),       # the full match is earlier; "ab" may start another
    ([b"STOP", b"Tx"], b"ST", 2),
    ([b"STOP", b"Tx"], b"xT", 1),
    ([b"bz", b"qq", b"abz"], b"xab", 2),  # the longest over all strings, in any order
    ([b"<|im_end|>"], b"answer<|im", 4),
])
def test_holdback(stops, text, want):
    assert _testing.stop_holdback(stops, text) == want


def test_holdback_utf8():
    stop = "終了".encode()
    text = "これで".encode() + stop[:4]
    assert _testing.stop_holdback([stop], text) == 4
    assert _testing.stop_holdback([stop], "これで".encode()) == 0


# ---- against the brute-force reference -----------------------------------

small = st.lists(st.sampled_from([b"a", b"b", b"\xc3", b"\xa9"]), max_size=24).map(b"".join)
stop_s = st.lists(st.sampled_from([b"a", b"b", b"\xc3", b"\xa9"]), min_size=1, max_size=5).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(stop_s, min_size=1, max_size=4), text=small, data=st.data())
def test_find_matches_reference(stops, text, data):
    new_from = data.draw(st.integers(0, len(text)))
    assert _testing.stop_find(stops, text, new_from) == ref_find(stops, text, new_from)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(stop_s, min_size=1, max_size=4), text=small)
def test_holdback_matches_reference(stops, text):
    assert _testing.stop_holdback(stops, text) == ref_holdback(stops, text)


@settings(max_examples=100, deadline=None)
@given(stops=st.lists(stop_s, min_size=1, max_size=3),
       chunks=st.lists(small, min_size=1, max_size=6))
def test_streaming_finds_the_first_match(stops, chunks):
    """Feeding text chunk by chunk finds the same first match as one search."""
    text = b""
    found = None
    for c in chunks:
        new_from = len(text)
        text += c
        found = _testing.stop_find(stops, text, new_from)
        if found:
            break
    assert found == ref_find(stops, text, 0)


# ---- input checking -------------------------------------------------------

def test_bad_inputs():
    with pytest.raises(ValueError):
        _testing.stop_find([b""], b"abc", 0)
    with pytest.raises(ValueError):
        _testing.stop_find([b"a"], b"abc", 4)
    with pytest.raises(ValueError):
        _testing.stop_find([b"a"], b"abc", -1)
    with pytest.raises(TypeError):
        _testing.stop_find(["a"], b"abc", 0)
    with pytest.raises(TypeError):
        _testing.stop_find(b"abc", b"abc", 0)
    with pytest.raises(TypeError):
        _testing.stop_find([b"a"], "abc", 0)
    with pytest.raises(TypeError):
        _testing.stop_holdback([b"a", 3], b"abc")
    with pytest.raises(ValueError):
        _testing.stop_holdback([b""], b"abc")
