"""What the machine can do at best: the measured peak of each instruction
Conveyor's kernels compute with (register-only loops in C, per core and on all
threads) and the memory bandwidth its thread pool reaches, the ceilings that
bench kernels, bench roofline and bench bound hold their figures against."""
from __future__ import annotations

from typing import Any, Dict, List

PEAK_KINDS = ("fp32_fma", "bf16_dot", "int8_dot")
# the peak a GEMM with weights of this dtype is bounded by
PEAK_OF_DTYPE = {"float32": "fp32_fma", "float16": "fp32_fma", "bfloat16": "bf16_dot"}


def _testing():
    """The measuring hooks (peaks, bandwidths, kernel timing) live in conveyor._testing."""
    from conveyor import _testing
    return _testing


def compute_peaks(threads: int = 0, seconds: float = 0.3) -> Dict[str, Dict[str, Any]]:
    """{kind: {"instruction", "simd", "per_core_gops", "all_gops", "threads"}}
    for kind in fp32_fma, bf16_dot, int8_dot: the measured peak (GFLOP/s;
    int8 GOP/s, 2 per multiply-add) of the instruction Conveyor's kernels use
    for it, on one thread and on `threads` (0: all cores)."""
    hooks = _testing()
    out: Dict[str, Dict[str, Any]] = {}
    for kind in PEAK_KINDS:
        one = hooks.measure_peak(kind, 1, seconds)
        every = hooks.measure_peak(kind, threads, seconds)
        out[kind] = {"instruction": one["instruction"], "simd": one["simd"],
                     "per_core_gops": one["gops"], "all_gops": every["gops"],
                     "threads": every["threads"]}
    if "widened" in out["bf16_dot"]["instruction"]:  # the same loop as fp32_fma: one figure for both
        for key in ("per_core_gops", "all_gops"):
            out["bf16_dot"][key] = out["fp32_fma"][key] = max(out["bf16_dot"][key], out["fp32_fma"][key])
    return out


def merge_peaks(a: Dict[str, Dict[str, Any]], b: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The higher of two measurements of each peak (a peak measured while the
    machine was busy is too low; the better one is closer to the truth)."""
    out = {}
    for kind, ra in a.items():
        rb = b[kind]
        out[kind] = dict(ra, per_core_gops=max(ra["per_core_gops"], rb["per_core_gops"]),
                         all_gops=max(ra["all_gops"], rb["all_gops"]))
    return out


def format_peaks(peaks: Dict[str, Dict[str, Any]]) -> List[str]:
    unit = {"int8_dot": "GOP/s"}
    return [f"peak {kind:<9} {p['per_core_gops']:7.1f} per core, {p['all_gops']:7.1f} on {p['threads']} threads "
            f"{unit.get(kind, 'GFLOP/s')}  ({p['instruction']})" for kind, p in peaks.items()]


def fraction_text(value: float, bound: float) -> str:
    """value / bound, flagged when above 1 (only noise can put it there)."""
    f = value / bound if bound > 0 else float("nan")
    return f"{f:.2f}" + (" (above its peak: noisy measurement, rerun on a quiet machine)" if f > 1.0 else "")


def measure_triad(threads: int = 0, n_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """GB/s of a = b + s*c over three arrays of n_bytes each, with Conveyor's pool
    (STREAM's count: 3 x n_bytes per pass)."""
    return float(_testing().kernel_triad(n_bytes, repeats, threads))


def measure_read_bw(threads: int = 0, n_bytes: int = 128 << 20, repeats: int = 5) -> float:
    """GB/s of reading one array of n_bytes with Conveyor's pool: the access
    pattern of a GEMV over weights that do not fit the caches."""
    return float(_testing().kernel_read_bw(n_bytes, repeats, threads))
