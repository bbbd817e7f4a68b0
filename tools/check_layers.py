#!/usr/bin/env python3
"""Checks that the C sources keep their floors and that the CPU backend's files
call each other in one direction.

The floors, bottom first: base/ (types, errors, conversions) <- kernels/ (the
backends) <- csrc/model/ <- csrc/core/ <- csrc/binding/ (conveyor._core) <-
csrc/testing/ (conveyor._testing) <- the harnesses (csrc/fuzz/, tools/*.c); the
Python package sits on the bindings. A file may include or call files of its own
floor and the floors below, never a higher one; the model and the core see a
backend only through kernels/backend.h (no include of kernels/cpu/ or
kernels/cuda/, no call of a backend function backend.h does not declare); the
package loads conveyor._testing only in conveyor bench. Inside the CPU backend
(kernels/cpu/cpu_internal.h describes the layers) a call goes down a layer,
never sideways between operation families or round a circle.

Reads the sources: the quoted #include lines, which file defines each
non-static cv_* function (or static inline one, for headers) and which cv_*
functions each file calls. Usage: python tools/check_layers.py [ROOT]; exit 1
with the offending includes and calls listed.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# rank: a file may call files of its own rank or lower; same-rank calls must not form a circle
BACKEND = {"kernels/cpu/backend_cpu.c": 3}
OPERATIONS = {  # family -> files; an operation calls only within its family (or below)
    "gemm": ["kernels/cpu/gemm.c", "kernels/cpu/gemm_avx512.c", "kernels/cpu/quant.c", "kernels/cpu/quant_avx2.c",
             "kernels/cpu/quant_vnni.c", "kernels/cpu/quant_vnni512.c", "kernels/cpu/quant_q2k.c"],
    "attention": ["kernels/cpu/attention.c", "kernels/cpu/attention_avx512.c"],
    "elementwise": ["kernels/cpu/elementwise.c"],
    "peak": ["kernels/cpu/peak.c"],
    "lora": ["kernels/cpu/lora.c"],
}
SHARED = ["kernels/cpu/kv_write.c", "kernels/cpu/row_kernels.c", "kernels/cpu/convert.c", "kernels/cpu/vec_math.c",
          "kernels/cpu/vec_math.h", "kernels/cpu/threadpool.c", "kernels/cpu/cpu_features.c"]
BOTTOM = ["base/common.c", "base/common.h", "base/quant_format.h"]

DEF = re.compile(r"^(?!static\b(?!\s+(?:inline|CV_ALWAYS_INLINE)))[A-Za-z_][\w \t\*]*?\b(cv_\w+)\s*\([^;{]*\)\s*\{",
                 re.M)
CALL = re.compile(r"\b(cv_\w+)\s*\(")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
PROTOTYPE = re.compile(r"^[A-Za-z_][\w \t\*]*?\bcv_\w+\s*\([^;{]*\)[^;{]*;", re.M)  # a declaration, not a call


# floor of each folder, bottom first (rank = position); the first prefix that matches wins
FLOORS = [("base/", "base"), ("build_support/", "build support"), ("kernels/", "kernels"),
          ("csrc/model/", "model"), ("csrc/core/", "core"), ("csrc/binding/", "binding"),
          ("csrc/testing/", "testing"), ("csrc/fuzz/", "harness"), ("tools/", "harness")]
RANK = {name: i for i, name in enumerate(dict.fromkeys(name for _, name in FLOORS))}
BACKEND_PRIVATE = ("kernels/cpu/", "kernels/cuda/")  # a backend's own files
BACKEND_API = "kernels/backend.h"  # what the model and the core may see of a backend
SEES_BACKEND_API_ONLY = {"model", "core"}
INCLUDE_DIRS = ["csrc", "kernels", "build_support/avx512_emu"]  # setup.py's -I, after the includer's own folder
C_FILES = ("*.c", "*.h", "*.cu")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
PY_TESTING = re.compile(r"^[^#\n]*\b_testing\b", re.M)


def floor_of(rel: str) -> str | None:
    return next((name for prefix, name in FLOORS if rel.startswith(prefix)), None)


def c_files(root: Path) -> list[str]:
    out = set()
    for prefix, _ in FLOORS:
        for pat in C_FILES:
            out.update(p.relative_to(root).as_posix() for p in (root / prefix).rglob(pat))
    return sorted(out)


def resolve_include(root: Path, rel: str, name: str) -> str | None:
    """The file a quoted #include names, as the compiler finds it; None for a
    header outside the tree (a system or generated one)."""
    for d in [Path(rel).parent.as_posix()] + INCLUDE_DIRS:
        p = (root / d / name).resolve()
        if p.is_file():
            try:
                return p.relative_to(root.resolve()).as_posix()
            except ValueError:
                return None
    return None


def check_floors(root: Path) -> list[str]:
    files = c_files(root)
    problems: list[str] = []
    raw = {f: (root / f).read_text(errors="replace") for f in files}
    # includes
    includes: dict[str, set[str]] = {f: set() for f in files}
    for f, text in raw.items():
        ff = floor_of(f)
        for m in INCLUDE.finditer(COMMENT.sub(lambda c: "\n" * c.group(0).count("\n"), text)):
            g = resolve_include(root, f, m.group(1))
            if g is None or g == f:
                continue
            includes[f].add(g)
            fg = floor_of(g)
            if fg is None:
                problems.append(f"{f} includes {g}, which is on no floor")
            elif RANK[fg] > RANK[ff]:
                problems.append(f"{f} includes up a floor: {g} ({ff} -> {fg})")
            elif ff in SEES_BACKEND_API_ONLY and g.startswith(BACKEND_PRIVATE):
                problems.append(f"{f} includes a backend's own header: {g} ({ff} sees {BACKEND_API} only)")
    problems += [f"include circle: {c}" for c in circles(includes)]
    # calls (C only: the CUDA sources are C++ behind the backend table)
    texts = {f: COMMENT.sub(" ", t) for f, t in raw.items() if not f.endswith(".cu")}
    owner: dict[str, str] = {}
    for f, t in texts.items():
        for m in DEF.finditer(t):
            owner.setdefault(m.group(1), f)
    api = {m.group(1) for m in re.finditer(r"\b(cv_\w+)\s*\(", texts.get(BACKEND_API, ""))}
    for f, t in texts.items():
        ff = floor_of(f)
        ups: dict[str, set[str]] = {}
        private: dict[str, set[str]] = {}
        for m in CALL.finditer(PROTOTYPE.sub(" ", t)):
            g = owner.get(m.group(1))
            if not g or g == f:
                continue
            fg = floor_of(g)
            if RANK[fg] > RANK[ff]:
                ups.setdefault(g, set()).add(m.group(1))
            elif ff in SEES_BACKEND_API_ONLY and fg == "kernels" and m.group(1) not in api:
                private.setdefault(g, set()).add(m.group(1))
        for g, names in sorted(ups.items()):
            problems.append(f"{f} calls up a floor: {g} ({', '.join(sorted(names))})")
        for g, names in sorted(private.items()):
            problems.append(f"{f} calls a backend function {BACKEND_API} does not declare: {g} "
                            f"({', '.join(sorted(names))})")
    # the Python package
    pkg = root / "python" / "conveyor"
    for p in sorted(pkg.rglob("*.py")) if pkg.is_dir() else []:
        rel = p.relative_to(root).as_posix()
        if not rel.startswith("python/conveyor/bench/") and PY_TESTING.search(p.read_text(errors="replace")):
            problems.append(f"{rel} uses conveyor._testing (the test hooks; only conveyor bench may)")
    return problems


def circles(edges: dict[str, set[str]]) -> list[str]:
    """Each circle of the graph once, as "a -> b -> a"."""
    found: list[str] = []
    state: dict[str, int] = {}

    def visit(f: str, path: list[str]) -> None:
        state[f] = 1
        for g in sorted(edges.get(f, ())):
            if state.get(g) == 1:
                found.append(" -> ".join(path[path.index(g):] + [g]))
            elif g not in state:
                visit(g, path + [g])
        state[f] = 2

    for f in sorted(edges):
        if f not in state:
            visit(f, [f])
    return found


def layers() -> dict[str, tuple[int, str]]:
    out = {f: (r, "backend") for f, r in BACKEND.items()}
    for fam, files in OPERATIONS.items():
        out.update({f: (2, fam) for f in files})
    out.update({f: (1, "shared") for f in SHARED})
    out.update({f: (0, "bottom") for f in BOTTOM})
    return out


def check(root: Path) -> list[str]:
    return check_floors(root) + check_cpu_layers(root)


def check_cpu_layers(root: Path) -> list[str]:
    lay = {f: v for f, v in layers().items() if (root / f).exists()}
    texts = {f: COMMENT.sub(" ", (root / f).read_text()) for f in lay}
    owner: dict[str, str] = {}
    for f, t in texts.items():
        for m in DEF.finditer(t):
            owner.setdefault(m.group(1), f)
    unknown = sorted(p.relative_to(root).as_posix() for p in (root / "kernels/cpu").glob("*.c")
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
