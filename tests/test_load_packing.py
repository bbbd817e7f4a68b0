"""Weights packed at load on several threads are the weights packed on one.

On the AVX512-VNNI level, quantized matrices are packed into panels of 16 rows at load,
straight from the file's blocks and split by panels across the pool's threads when the
matrix is large (a Gemma 3 lm_head is 262,144 rows). A matrix large enough to be split, with
a partial last panel, must give the same GEMM bits with 1, 2 and 3 threads (the kernels are
batch- and thread-invariant, so any difference is a packing error), and agree with NumPy's
dequantized weights to the activation-rounding bound (an error common to every thread count
would show there)."""
from __future__ import annotations

import numpy as np
import pytest

from conveyor import _testing
from conveyor.gguf import dequantize, quantize

# 130 panels of 16 rows, the last with 5; rows x cols above the 2^21 elements a second
# packing thread waits for
ROWS, COLS = 16 * 129 + 5, 1024


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_a_large_matrix_packed_on_several_threads_equals_one_thread(qtype):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    wb = quantize(w, qtype).reshape(ROWS, -1)
    x = rng.standard_normal((3, COLS)).astype(np.float32)
    one = _testing.kernel_qgemm(x, wb, qtype, threads=1)
    for threads in (2, 3):
        np.testing.assert_array_equal(_testing.kernel_qgemm(x, wb, qtype, threads=threads), one)
    # against dequantize-then-multiply: only the kernel's int8 rounding of the activations
    # (at most amax/254 per element of each block of 32) separates them
    wd = dequantize(wb, qtype, (ROWS, COLS)).astype(np.float64)
    ref = x.astype(np.float64) @ wd.T
    amax = np.abs(x).reshape(3, -1, 32).max(axis=2)                   # [tokens][blocks]
    wsum = np.abs(wd).reshape(ROWS, -1, 32).sum(axis=2)               # [rows][blocks]
    bound = (amax / 254.0) @ wsum.T + 1e-5 * (np.abs(x) @ np.abs(wd).T)
    assert np.all(np.abs(one - ref) <= bound)
