"""The CPU backend's files call each other in one direction (cpu_internal.h):
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


def test_cpu_kernel_files_call_in_one_direction():
    assert _checker().check(ROOT) == []


def test_the_checker_sees_a_call_up_and_a_circle(tmp_path):
    """The check is not vacuous: a copy of the tree where an operation calls the
    backend and two operations call each other fails with both named."""
    import shutil

    for d in ("kernels", "csrc"):
        shutil.copytree(ROOT / d, tmp_path / d)
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
