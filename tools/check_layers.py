#!/usr/bin/env python3
"""Checks that the sources keep the floors docs/architecture.json describes and
that the CPU backend's files call each other in one direction.

docs/architecture.json names the parts of the tree (each a list of paths) and
the "never" rules between them: [A, B, why] means no file of A includes a file
of B, calls a cv_* function that only B defines or declares, or imports a
Python module of B. An arrow [C, D] from a part C nested inside A allows what a
never [A, D] forbids (bench inside the package may load conveyor._testing). A
C include circle is a breach too. Inside the CPU backend (kernels/cpu/
cpu_internal.h describes the layers) a call goes down a layer, never sideways
between operation families or round a circle; the lists below place its files.

Reads the sources: the quoted #include lines, which file defines each
non-static cv_* function (or static inline one, for headers) and which headers
declare it, which cv_* functions each file calls, and each Python file's
imports. Usage: python tools/check_layers.py [ROOT]; exit 1 with the offending
includes, calls and imports listed.
"""
from __future__ import annotations

import ast
import json
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
    "lora": ["kernels/cpu/lora.c"],
}
SHARED = ["kernels/cpu/kv_write.c", "kernels/cpu/row_kernels.c", "kernels/cpu/convert.c", "kernels/cpu/threadpool.c",
          "kernels/cpu/cpu_features.c", "kernels/cpu/weight_arena.c",
          # the SIMD kernels of each level, reached through the kernel table (kernel_table.c)
          "kernels/cpu/x86/avx2_gemm.c", "kernels/cpu/x86/avx512_gemm.c", "kernels/cpu/x86/avx2_attention.c",
          "kernels/cpu/x86/avx512_attention.c", "kernels/cpu/x86/avx512_attention_i8.c",
          "kernels/cpu/x86/avx512_attention_parts.h", "kernels/cpu/x86/avx2_rows.c", "kernels/cpu/x86/avx512_rows.c",
          "kernels/cpu/x86/avx2_lora.c", "kernels/cpu/x86/avx512_lora.c",
          "kernels/cpu/x86/vec_math.c", "kernels/cpu/x86/vec_math.h"]
BOTTOM = ["base/common.c", "base/common.h", "base/quant_format.c", "base/quant_format.h"]

DEF = re.compile(r"^(?!static\b(?!\s+(?:inline|CV_ALWAYS_INLINE)))[A-Za-z_][\w \t\*]*?\b(cv_\w+)\s*\([^;{]*\)\s*\{",
                 re.M)
CALL = re.compile(r"\b(cv_\w+)\s*\(")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
PROTOTYPE = re.compile(r"^[A-Za-z_][\w \t\*]*?\bcv_\w+\s*\([^;{]*\)[^;{]*;", re.M)  # a declaration, not a call


PARTS_FILE = "docs/architecture.json"
INCLUDE_DIRS = ["csrc", "kernels", "build_support/avx512_emu"]  # setup.py's -I, after the includer's own folder
C_FILES = ("*.c", "*.h", "*.cu")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


class Parts:
    """docs/architecture.json read: which parts hold a path, and the never rules."""

    def __init__(self, root: Path):
        doc = json.loads((root / PARTS_FILE).read_text())
        self.paths = {name: part["is"] for name, part in doc["parts"].items()}
        self.modules = {part["module"]: name for name, part in doc["parts"].items() if "module" in part}
        self.never = [tuple(rule) for rule in doc["never"]]
        self.arrows = [tuple(a) for a in doc["arrows"]]
        self.problems = [f"{PARTS_FILE}: {kind} {rule[:2]} names an unknown part"
                         for kind, rules in (("never", self.never), ("arrow", self.arrows))
                         for rule in rules if not set(rule[:2]) <= set(self.paths)]

    def of(self, rel: str) -> set[str]:
        return {name for name, paths in self.paths.items()
                if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in paths)}

    def inside(self, inner: str, outer: str) -> bool:
        """Every path of inner lies within outer."""
        return all(self.of(p.rstrip("/")) >= {outer} or p in self.paths[outer] for p in self.paths[inner])

    def breaches(self, src: str, targets: list[str]) -> list[tuple[str, str, str]]:
        """The never rules src reaching targets breaks: a rule counts when src is in A and
        every target is in B (a function reached through a header of another part is
        fine), unless an arrow from a part nested in A allows it."""
        mine = self.of(src)
        theirs = [self.of(t) for t in targets]
        out = []
        for a, b, why in self.never:
            if a not in mine or not all(b in t for t in theirs):
                continue
            if any(c in mine and c != a and self.inside(c, a) and all(d in t for t in theirs)
                   for c, d in self.arrows):
                continue
            out.append((a, b, why))
        return out

    def c_files(self, root: Path) -> list[str]:
        out = set()
        for paths in self.paths.values():
            for prefix in paths:
                if not prefix.endswith("/"):
                    continue
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


def _rule(a: str, b: str, why: str) -> str:
    return f"never {a} -> {b} ({why})"


def check_floors(root: Path) -> list[str]:
    parts = Parts(root)
    files = parts.c_files(root)
    problems: list[str] = list(parts.problems)
    raw = {f: (root / f).read_text(errors="replace") for f in files}
    # includes
    includes: dict[str, set[str]] = {f: set() for f in files}
    for f, text in raw.items():
        for m in INCLUDE.finditer(COMMENT.sub(lambda c: "\n" * c.group(0).count("\n"), text)):
            g = resolve_include(root, f, m.group(1))
            if g is None or g == f:
                continue
            includes[f].add(g)
            if not parts.of(g):
                problems.append(f"{f} includes {g}, which is in no part of {PARTS_FILE}")
            for rule in parts.breaches(f, [g]):
                problems.append(f"{f} includes {g}: {_rule(*rule)}")
    problems += [f"include circle: {c}" for c in circles(includes)]
    # calls (C only: the CUDA sources are C++ behind the backend table); a function is
    # reached through its definition or any header that declares it
    texts = {f: COMMENT.sub(" ", t) for f, t in raw.items() if not f.endswith(".cu")}
    where: dict[str, set[str]] = {}
    for f, t in texts.items():
        for m in DEF.finditer(t):
            where.setdefault(m.group(1), set()).add(f)
        if f.endswith(".h"):
            for m in PROTOTYPE.finditer(t):
                name = re.search(r"\b(cv_\w+)\s*\(", m.group(0))
                if name:
                    where.setdefault(name.group(1), set()).add(f)
    for f, t in texts.items():
        found: dict[tuple[str, str, str], dict[str, set[str]]] = {}
        for m in CALL.finditer(PROTOTYPE.sub(" ", t)):
            homes = sorted(where.get(m.group(1), set()) - {f})
            if not homes or f in where.get(m.group(1), set()):
                continue
            for rule in parts.breaches(f, homes):
                found.setdefault(rule, {}).setdefault(homes[0], set()).add(m.group(1))
        for rule, by_file in sorted(found.items()):
            for g, names in sorted(by_file.items()):
                problems.append(f"{f} calls {', '.join(sorted(names))} of {g}: {_rule(*rule)}")
    return problems + check_imports(root, parts)


def _imported(tree: ast.AST, package: str) -> set[str]:
    """Module names a Python file imports anywhere (function-local imports too, and
    importlib.import_module with a constant name), relative names resolved."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
    return out


def _module_file(root: Path, parts: Parts, module: str) -> str | None:
    """The tree path of a conveyor module: its .py file, its package folder, or the
    part that builds it (conveyor._core, conveyor._testing)."""
    if module in parts.modules:
        return parts.paths[parts.modules[module]][0]
    if module != "conveyor" and not module.startswith("conveyor."):
        return None
    rel = "python/" + module.replace(".", "/")
    if (root / (rel + ".py")).is_file():
        return rel + ".py"
    if (root / rel).is_dir():
        return rel + "/"
    return None


def check_imports(root: Path, parts: Parts) -> list[str]:
    problems: list[str] = []
    pkg = root / "python" / "conveyor"
    for p in sorted(pkg.rglob("*.py")) if pkg.is_dir() else []:
        rel = p.relative_to(root).as_posix()
        package = ".".join(Path(rel[len("python/"):]).with_suffix("").parts)
        if p.name != "__init__.py":
            package = package.rsplit(".", 1)[0]
        try:
            tree = ast.parse(p.read_text(errors="replace"))
        except SyntaxError as exc:
            problems.append(f"{rel} does not parse: {exc.msg}")
            continue
        for module in sorted(_imported(tree, package)):
            g = _module_file(root, parts, module)
            if g is None:
                continue
            for rule in parts.breaches(rel, [g]):
                problems.append(f"{rel} imports {module}: {_rule(*rule)}")
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
