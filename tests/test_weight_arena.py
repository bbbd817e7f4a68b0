"""The CPU backend's weight arena (kernels/cpu/weight_arena.c): prepared
matrices carved out of 2 MiB-aligned chunks so that small ones sit in huge
pages too. The hook fills every allocation with its own byte and checks it at
its free and at the end, so any two allocations that overlap raise."""
from __future__ import annotations

import random

import pytest

from conveyor import _testing

MIB = 1 << 20
CHUNK = 64 * MIB


def trace(ops, separate=False):
    return _testing.weight_arena_trace(ops, separate=separate)


def test_small_matrices_share_one_huge_page_aligned_chunk():
    sizes = [1_327_104, 663_552, 3_538_944, 100, 1]  # QKV, output, gate-up of SmolLM-135M bf16, odd sizes
    out = trace(sizes)
    addrs = [a for a, _ in out]
    assert addrs[0] % (2 * MIB) == 0
    assert all(a % 64 == 0 for a in addrs)
    # packed one after the other, each rounded up to 64 bytes
    for a, b, n in zip(addrs, addrs[1:], sizes):
        assert b - a == (n + 63) // 64 * 64
    assert [r for _, r in out] == [CHUNK] * len(sizes)


def test_freed_space_is_used_again_and_empty_chunks_go_back():
    m = MIB
    out = trace([m, m, m, -2, m, 2 * m, -1, -3, -4, -5])
    a0, a1, a2, _, a3, a4 = (a for a, _ in out[:6])
    assert a3 == a1  # the freed middle matrix's place, first fit
    assert a4 == a2 + m  # too large for the gap: after the last one
    assert [r for _, r in out[:-1]] == [CHUNK] * 9
    assert out[-1][1] == 0  # the last free empties the chunk: it goes back to the system


def test_a_matrix_larger_than_a_chunk_gets_its_own_rounded_to_huge_pages():
    big = 100 * MIB + 12345
    out = trace([MIB, big, MIB, -2, -1, -3])
    rounded = (big + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
    assert out[1][1] == CHUNK + rounded
    assert out[1][0] % (2 * MIB) == 0
    assert out[2][0] == out[0][0] + MIB  # the small one after it goes back to the first chunk's gap
    assert out[3][1] == CHUNK  # the large chunk freed with its matrix
    assert out[-1][1] == 0


def test_random_traces_never_overlap_and_end_empty():
    rng = random.Random(7)
    for _ in range(20):
        ops, live, n = [], [], 0
        for _ in range(120):
            if live and rng.random() < 0.45:
                ops.append(-(live.pop(rng.randrange(len(live))) + 1))
            else:
                ops.append(rng.choice([64, 4096, 300_000, 1_800_000, rng.randrange(1, 9 * MIB)]))
                live.append(n)
                n += 1
        ops += [-(k + 1) for k in live]
        out = trace(ops)  # raises if any allocation was overwritten
        assert out[-1][1] == 0
        assert all(a % 64 == 0 for a, _ in out)


def test_separate_buffers_when_asked():
    out = trace([MIB, 100, -1, -2], separate=True)
    assert all(r == 0 for _, r in out)
    assert out[0][0] % 64 == 0 and out[1][0] % 64 == 0


@pytest.mark.parametrize("ops, match", [([-1], "not live"), ([10, -1, -1], "not live"), ([1 << 40], "more than")])
def test_bad_ops_raise(ops, match):
    with pytest.raises(ValueError, match=match):
        trace(ops)
    with pytest.raises(TypeError):
        trace([1.5])
