"""The sources keep the floors docs/architecture.json describes (base <- kernels
<- model <- core <- binding <- testing; the model and the core see a backend only
through kernels/backend.h; the package loads conveyor._testing only in bench) and
the CPU backend's files call each other in one direction (cpu_internal.h):
backend -> operations -> shared pieces, with no circle and no call sideways
between operation families. tools/check_layers.py reads the sources and the
parts file."""
import importlib.util
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_tree_keeps_its_floors_and_layers():
    assert _checker().check(ROOT) == []


def _copy_tree(dst):
    import shutil

    for d in ("base", "build_support", "kernels", "csrc", "tools", "python/conveyor"):
        shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (dst / "docs").mkdir()
    shutil.copy(ROOT / "docs/architecture.json", dst / "docs/architecture.json")


def test_the_checker_sees_a_call_up_and_a_circle(tmp_path):
    """The check is not vacuous: a copy of the tree where an operation calls the
    backend and two operations call each other fails with both named."""
    _copy_tree(tmp_path)
    att = tmp_path / "kernels/cpu/attention.c"
    att.write_text(att.read_text() + "\nstatic void cv_probe(void) { cv_cpu_rmsnorm(0, 0, 0, 0, 0, 0, 0); }\n")
    ew = tmp_path / "kernels/cpu/elementwise.c"
    ew.write_text(ew.read_text() + "\nstatic void cv_probe2(void) { cv_cpu_paged_attention(0, 0, 0, 0, 0, 0); }\n")
    be = tmp_path / "kernels/cpu/gemm.c"
    be.write_text(be.read_text() + "\nvoid cv_probe3(void) { cv_cpu_family_count(); }\n")
    problems = "\n".join(_checker().check(tmp_path))
    assert "attention.c calls sideways from attention into elementwise" in problems
    assert "elementwise.c calls sideways from elementwise into attention" in problems
    assert "gemm.c calls up a layer: kernels/cpu/backend_cpu.c" in problems
    assert "circle:" in problems


def _append(path, text):
    path.write_text(path.read_text() + text)


def test_the_checker_sees_each_kind_of_broken_floor(tmp_path):
    """Not vacuous: a copy of the tree with one breach of each rule fails with
    each one named, and the unbroken copy passes."""
    _copy_tree(tmp_path)
    check = _checker().check
    assert check(tmp_path) == []
    _append(tmp_path / "csrc/core/stop.c", '\n#include "../../kernels/cpu/cpu_features.h"\n')
    _append(tmp_path / "kernels/cpu/elementwise.c", '\n#include "../../csrc/core/engine.h"\n')
    _append(tmp_path / "csrc/binding/py_gguf.c", '\n#include "../testing/testing.h"\n')
    _append(tmp_path / "base/common.c", "\nstatic void cv_probe(void) { cv_cpu_backend_create(0, 0, 0); }\n")
    _append(tmp_path / "csrc/core/output.c", "\nstatic void cv_probe(void) { cv_cpu_family_count(); }\n")
    _append(tmp_path / "python/conveyor/engine.py", "\nfrom . import _testing  # noqa\n")
    (tmp_path / "base/quant_format.h").write_text('#include "circle.h"\n' + (tmp_path / "base/quant_format.h").read_text())
    (tmp_path / "base/circle.h").write_text('#include "quant_format.h"\n')
    problems = "\n".join(check(tmp_path))
    assert "csrc/core/stop.c includes kernels/cpu/cpu_features.h: never core -> kernels_cpu" in problems, problems
    assert "kernels/cpu/elementwise.c includes csrc/core/engine.h: never kernels -> core" in problems
    assert "csrc/binding/py_gguf.c includes csrc/testing/testing.h: never binding -> testing" in problems
    assert "base/common.c calls cv_cpu_backend_create of kernels/backend.h: never base -> kernels" in problems
    assert ("csrc/core/output.c calls cv_cpu_family_count of kernels/cpu/backend_cpu.c: "
            "never core -> kernels_cpu") in problems
    assert "python/conveyor/engine.py imports conveyor._testing: never package -> testing" in problems
    assert "include circle: base/circle.h -> base/quant_format.h -> base/circle.h" in problems


def _files_of(doc, part, suffixes):
    out = []
    for p in doc["parts"][part]["is"]:
        if p.endswith("/"):
            out += sorted(f.relative_to(ROOT).as_posix() for f in (ROOT / p).rglob("*") if f.suffix in suffixes)
        elif Path(p).suffix in suffixes:
            out.append(p)
    return out


def _allowed_by_arrow(doc, rel, b):
    """rel lies in a part other than the rule's own that an arrow lets reach b."""
    return any(a2 == b and any(rel == p or (p.endswith("/") and rel.startswith(p))
                               for p in doc["parts"][c]["is"]) for c, a2 in doc["arrows"])


def _module_name(doc, part):
    if "module" in doc["parts"][part]:
        return doc["parts"][part]["module"]
    path = doc["parts"][part]["is"][0]
    return path[len("python/"):].rstrip("/").removesuffix(".py").replace("/", ".")


def test_each_never_rule_is_checked(tmp_path):
    """For every never rule in docs/architecture.json, a copy of the tree with one
    file of the first part reaching into the second (an #include for C, an import
    for Python) fails with that rule named; the untouched copy passes."""
    doc = json.loads((ROOT / "docs/architecture.json").read_text())
    assert doc["never"], "the parts file has never rules"
    _copy_tree(tmp_path)
    check = _checker().check
    assert check(tmp_path) == []
    expected = []
    for a, b, _why in doc["never"]:
        py_sources = [f for f in _files_of(doc, a, {".py"})
                      if f.startswith("python/") and not _allowed_by_arrow(doc, f, b)]
        c_sources = [f for f in _files_of(doc, a, {".c"}) + _files_of(doc, a, {".h"})
                     if not _allowed_by_arrow(doc, f, b)]
        if py_sources:
            src, module = py_sources[0], _module_name(doc, b)
            _append(tmp_path / src, f"\nimport {module}  # noqa\n")
            expected.append(f"{src} imports {module}: never {a} -> {b}")
        else:
            assert c_sources, f"never [{a}, {b}]: no source file in {a}"
            targets = _files_of(doc, b, {".h"}) or _files_of(doc, b, {".c"})
            src, dst = c_sources[0], targets[0]
            _append(tmp_path / src, f'\n#include "{os.path.relpath(dst, Path(src).parent)}"\n')
            expected.append(f"{src} includes {dst}: never {a} -> {b}")
    problems = "\n".join(check(tmp_path))
    missing = [e for e in expected if e not in problems]
    assert not missing, (missing, problems)


def test_the_parts_file_names_known_parts_and_real_paths():
    doc = json.loads((ROOT / "docs/architecture.json").read_text())
    for name, part in doc["parts"].items():
        assert part["says"] and part["is"], name
        for p in part["is"]:
            assert (ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file(), (name, p)
    for rule in doc["arrows"] + doc["never"]:
        assert set(rule[:2]) <= set(doc["parts"]), rule
