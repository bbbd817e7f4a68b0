"""The C sources keep their floors (base <- kernels <- model <- core <- binding
<- testing; the model and the core see a backend only through kernels/backend.h)
and the CPU backend's files call each other in one direction (cpu_internal.h):
backend -> operations -> shared pieces, with no circle and no call sideways
between operation families. tools/check_layers.py reads the sources."""
import importlib.util
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
    assert ("csrc/core/stop.c includes a backend's own header: kernels/cpu/cpu_features.h" in problems), problems
    assert "kernels/cpu/elementwise.c includes up a floor: csrc/core/engine.h (kernels -> core)" in problems
    assert "csrc/binding/py_gguf.c includes up a floor: csrc/testing/testing.h (binding -> testing)" in problems
    assert "base/common.c calls up a floor: kernels/cpu/backend_cpu.c (cv_cpu_backend_create)" in problems
    assert ("csrc/core/output.c calls a backend function kernels/backend.h does not declare: "
            "kernels/cpu/backend_cpu.c (cv_cpu_family_count)") in problems
    assert "python/conveyor/engine.py uses conveyor._testing" in problems
    assert "include circle: base/circle.h -> base/quant_format.h -> base/circle.h" in problems
