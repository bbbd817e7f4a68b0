#!/usr/bin/env python3
"""Checks that the CPU backend's files call each other in one direction
(kernels/cpu/cpu_internal.h describes the layers).

Reads the C sources, finds which file defines each non-static cv_* function (or
static inline one, for headers) and which cv_* functions each file calls, and
fails when a call goes up a layer, sideways between operation families, or
round a circle. Usage: python tools/check_layers.py [ROOT]; exit 1 with the
offending calls listed.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# rank: a file may call files of its own rank or lower; same-rank calls must not form a circle
BACKEND = {"kernels/cpu/backend_cpu.c": 3, "kernels/cpu/kernel_table.c": 3}
OPERATIONS = {  # family -> files; an operation calls only within its family (or below)
    "gemm": ["kernels/cpu/gemm.c", "kernels/cpu/quant.c", "kernels/cpu/x86/avx2_quant.c",
             "kernels/cpu/x86/avxvnni_quant.c", "kernels/cpu/x86/vnni512_quant.c", "kernels/cpu/x86/avx2_q2k.c"],
    "attention": ["kernels/cpu/attention.c"],
    "elementwise": ["kernels/cpu/elementwise.c"],
    "measure": ["kernels/cpu/measure.c"],
}
SHARED = ["kernels/cpu/kv_write.c", "kernels/cpu/row_kernels.c", "kernels/cpu/convert.c", "kernels/cpu/threadpool.c",
          "kernels/cpu/cpu_features.c",
          # the SIMD kernels of each level, reached through the kernel table (kernel_table.c)
          "kernels/cpu/x86/avx2_gemm.c", "kernels/cpu/x86/avx512_gemm.c", "kernels/cpu/x86/avx2_attention.c",
          "kernels/cpu/x86/avx512_attention.c", "kernels/cpu/x86/avx2_rows.c", "kernels/cpu/x86/avx512_rows.c",
          "kernels/cpu/x86/vec_math.c", "kernels/cpu/x86/vec_math.h"]
BOTTOM = ["csrc/common.c", "kernels/common.h", "kernels/quant_format.h"]

DEF = re.compile(r"^(?!static\b(?!\s+(?:inline|CV_ALWAYS_INLINE)))[A-Za-z_][\w \t\*]*?\b(cv_\w+)\s*\([^;{]*\)\s*\{",
                 re.M)
CALL = re.compile(r"\b(cv_\w+)\s*\(")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
PROTOTYPE = re.compile(r"^[A-Za-z_][\w \t\*]*?\bcv_\w+\s*\([^;{]*\)[^;{]*;", re.M)  # a declaration, not a call


def layers() -> dict[str, tuple[int, str]]:
    out = {f: (r, "backend") for f, r in BACKEND.items()}
    for fam, files in OPERATIONS.items():
        out.update({f: (2, fam) for f in files})
    out.update({f: (1, "shared") for f in SHARED})
    out.update({f: (0, "bottom") for f in BOTTOM})
    return out


def check(root: Path) -> list[str]:
    lay = {f: v for f, v in layers().items() if (root / f).exists()}
    texts = {f: COMMENT.sub(" ", (root / f).read_text()) for f in lay}
    owner: dict[str, str] = {}
    for f, t in texts.items():
        for m in DEF.finditer(t):
            owner.setdefault(m.group(1), f)
    unknown = sorted(p.relative_to(root).as_posix() for p in (root / "kernels/cpu").rglob("*.c")
                     if p.relative_to(root).as_posix() not in lay)
    problems = [f"{f}: not placed in a layer (tools/check_layers.py)" for f in unknown]
    edges: dict[str, dict[str, set[str]]] = {f: {} for f in lay}
    for f, t in texts.items():
        for m in CALL.finditer(PROTOTYPE.sub(" ", t)):
            g = owner.get(m.group(1))
            if g and g != f:
                edges[f].setdefault(g, set()).add(m.group(1))
    for f, outs in edges.items():
        (rf, ff) = lay[f]
        for g, names in sorted(outs.items()):
            (rg, fg) = lay[g]
            why = None
            if rg > rf:
                why = "calls up a layer"
            elif rf == rg == 2 and ff != fg:
                why = f"calls sideways from {ff} into {fg}"
            if why:
                problems.append(f"{f} {why}: {g} ({', '.join(sorted(names))})")
    # circles among same-rank files
    seen: dict[str, int] = {}

    def visit(f: str, path: list[str]) -> None:
        seen[f] = 1
        for g in edges[f]:
            if lay[g][0] != lay[f][0]:
                continue
            if seen.get(g) == 1:  # on the current path: a circle back to g
                problems.append("circle: " + " -> ".join(path[path.index(g):] + [g]))
            elif g not in seen:
                visit(g, path + [g])
        seen[f] = 2

    for f in edges:
        if f not in seen:
            visit(f, [f])
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    problems = check(root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
