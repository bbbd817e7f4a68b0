"""Run-time SIMD dispatch: CPU feature detection, CONVEYOR_SIMD, kernel_info(),
and the same results on every kernel path this machine has."""
import os
import subprocess
import sys

import numpy as np
import pytest

import conveyor._core as _core
import conveyor._testing as core

INFO = _core.kernel_info()
LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
# the CPU flags each level needs, as /proc/cpuinfo names them
NEEDS = {"avx2": ["avx2", "fma", "f16c"],
         "avx512": ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"],
         "avx512_bf16": ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                         "avx512_bf16"]}


def cpuinfo_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def run_py(code, **env):
    full = dict(os.environ)
    for k in ("CONVEYOR_SIMD", "CONVEYOR_FORCE_SCALAR"):
        full.pop(k, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=300)


def test_kernel_info_reports_features_levels_and_paths():
    assert INFO["simd"] in LEVELS and INFO["best"] in LEVELS
    assert INFO["levels"][0] == "scalar" and INFO["levels"][-1] == INFO["best"]
    assert INFO["levels"] == LEVELS[:len(INFO["levels"])]
    assert _core.simd == INFO["simd"]
    for fam, path in INFO["paths"].items():
        assert path in INFO["levels"], (fam, path)
    assert {"gemm_f32", "gemm_bf16", "attention", "rmsnorm"} <= set(INFO["paths"])


# The level of the code each family has, from the kernels that exist (an independent list):
# nothing has code past AVX-512 but the bf16 GEMM and attention over a bf16 cache (vdpbf16ps), and
# attention over an int8 cache on VNNI's integer dots (with the AVX512_BF16 level, where the CPU has VNNI).
TOP = {"gemm_f32": "avx512", "gemm_f16": "avx512", "gemm_bf16": "avx512_bf16", "rmsnorm": "avx512",
       "rope": "avx512", "swiglu": "avx512", "attention": "avx512", "convert": "avx512",
       "attention_bf16": "avx512_bf16",
       "attention_int8": "avx512_bf16" if INFO["cpu_features"]["avx512vnni"] else "avx512"}


def test_paths_at_each_level_are_the_kernels_that_level_runs(monkeypatch):
    """kernel_info reads each family's path off the kernel table of the level asked for: the
    level itself up to the family's own top level, and that top level above it."""
    for level in INFO["levels"]:
        monkeypatch.setenv("CONVEYOR_SIMD", level)
        info = _core.kernel_info()
        assert info["simd"] == level
        assert set(info["paths"]) == set(TOP)
        for fam, path in info["paths"].items():
            want = min(LEVELS.index(level), LEVELS.index(TOP[fam]))
            assert path == LEVELS[want], (level, fam, path)


@pytest.mark.skipif(cpuinfo_flags() is None, reason="no /proc/cpuinfo flags")
@pytest.mark.skipif(INFO.get("emulated", False), reason="emulated intrinsics: every level reported")
def test_detected_levels_match_proc_cpuinfo():
    # an independent reference: the kernel's own CPU flags
    flags = cpuinfo_flags()
    for level, needs in NEEDS.items():
        assert (level in INFO["levels"]) == all(f in flags for f in needs), level
    f = INFO["cpu_features"]
    assert f["avx2"] == ("avx2" in flags) and f["fma"] == ("fma" in flags)
    assert f["avx512bf16"] == ("avx512_bf16" in flags)
    assert f["avx512vnni"] == ("avx512_vnni" in flags)
    assert f["avxvnni"] == ("avx_vnni" in flags)


@pytest.mark.parametrize("level", LEVELS)
def test_conveyor_simd_forces_a_level(level):
    if level not in INFO["levels"]:
        # a level the CPU lacks is refused with a clear message, in hooks and engines
        r = run_py("import numpy as np, conveyor._core as core, conveyor._testing as c\n"
                   "try:\n"
                   "    c.kernel_swiglu(np.ones((1, 8), np.float32))\n"
                   "except ValueError as e:\n"
                   "    print('refused:', e)\n", CONVEYOR_SIMD=level)
        assert r.returncode == 0 and "refused:" in r.stdout and level in r.stdout, r.stderr
        return
    code = ("import numpy as np, conveyor._core as core, conveyor._testing as c\n"
            f"assert core.kernel_info()['simd'] == {level!r} and core.simd == {level!r}\n"
            "r = np.random.default_rng(1)\n"
            "x = r.standard_normal((7, 45), dtype=np.float32)\n"
            "w = r.standard_normal((19, 45), dtype=np.float32)\n"
            "g = r.standard_normal((3, 2 * 37), dtype=np.float32)\n"
            f"assert np.array_equal(c.kernel_gemm(x, w, 'float16', impl='simd'),\n"
            f"                      c.kernel_gemm(x, w, 'float16', impl={level!r}))\n"
            f"assert np.array_equal(c.kernel_swiglu(g, impl='simd'), c.kernel_swiglu(g, impl={level!r}))\n"
            "print('ok')\n")
    r = run_py(code, CONVEYOR_SIMD=level)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_force_scalar_is_an_alias_of_scalar():
    r = run_py("import conveyor._core as core\nprint(core.kernel_info()['simd'])", CONVEYOR_FORCE_SCALAR="1")
    assert r.returncode == 0 and r.stdout.strip() == "scalar", r.stderr
    # CONVEYOR_SIMD wins over the alias
    if "avx2" in INFO["levels"]:
        r = run_py("import conveyor._core as core\nprint(core.kernel_info()['simd'])",
                   CONVEYOR_FORCE_SCALAR="1", CONVEYOR_SIMD="avx2")
        assert r.stdout.strip() == "avx2", r.stderr


@pytest.mark.parametrize("bad", ["avx3", "AVX2", "sse", "native"])
def test_bad_simd_values_raise_value_error(bad, tiny_llama2c_path):
    code = ("import numpy as np, conveyor, conveyor._core as core, conveyor._testing as c\n"
            "info = core.kernel_info()\n"
            "assert info['simd_error'] == 'unknown level', info\n"
            "for f in (lambda: c.kernel_rmsnorm(np.ones((2, 3), np.float32), np.ones(3, np.float32)),\n"
            f"          lambda: conveyor.LLM({str(tiny_llama2c_path)!r}, num_threads=1)):\n"
            "    try:\n"
            "        f()\n"
            "    except ValueError as e:\n"
            "        assert 'CONVEYOR_SIMD' in str(e) and 'scalar, avx2' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit('no error')\n"
            "print('ok')\n")
    r = run_py(code, CONVEYOR_SIMD=bad)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_impl_argument_names_levels():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="impl must be"):
        core.kernel_swiglu(x, impl="sse4")
    for level in LEVELS:
        if level in INFO["levels"]:
            core.kernel_swiglu(x, impl=level)
        else:
            with pytest.raises(ValueError, match="does not support"):
                core.kernel_swiglu(x, impl=level)


def test_greedy_stories_equal_on_every_level(stories_dir):
    # the whole model on each kernel path: the same greedy tokens
    code = ("import conveyor\n"
            f"llm = conveyor.LLM({str(stories_dir / 'stories260K.bin')!r}, num_threads=2)\n"
            "p = conveyor.SamplingParams(temperature=0.0, max_tokens=40)\n"
            "outs = llm.generate(['Once upon a time', 'Lily saw a big dog'], p, use_tqdm=False)\n"
            "print([o.outputs[0].token_ids for o in outs])\n")
    got = {}
    for level in INFO["levels"]:
        r = run_py(code, CONVEYOR_SIMD=level)
        assert r.returncode == 0, (level, r.stderr)
        got[level] = r.stdout.strip()
    assert len(set(got.values())) == 1, got
    assert len(got["scalar"]) > 20


def test_default_build_has_no_march_and_runs_avx2():
    # the default build (CONVEYOR_MARCH unset) is compiled for the x86-64
    # baseline; the AVX2 kernels still run, chosen at run time
    if INFO["build_march"] != "none":
        pytest.skip(f"this module was built with -march={INFO['build_march']}")
    assert not INFO["baseline_avx2"]
    if "avx2" not in INFO["levels"]:
        pytest.skip("CPU lacks avx2")
    r = run_py("import numpy as np, conveyor._core as core, conveyor._testing as c\n"
               "assert core.kernel_info()['paths']['gemm_f32'] == 'avx2'\n"
               "r = np.random.default_rng(2)\n"
               "x = r.standard_normal((13, 67), dtype=np.float32)\n"
               "w = r.standard_normal((35, 67), dtype=np.float32)\n"
               "ref = x.astype(np.float64) @ w.T.astype(np.float64)\n"
               "got = c.kernel_gemm(x, w, impl='simd')\n"
               "assert np.abs(got - ref).max() < 1e-4\n"
               "print('ok')\n", CONVEYOR_SIMD="avx2")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# --------------------------------------------------------------------------- compute peaks

def test_measure_peak_names_the_instruction_of_each_kind():
    want = {"scalar": "plain C", "avx2": "ymm", "avx512": "zmm", "avx512_bf16": "zmm"}
    for level in INFO["levels"]:
        for kind in ("fp32_fma", "bf16_dot", "int8_dot"):
            r = core.measure_peak(kind, 1, 0.02, impl=level)
            assert r["kind"] == kind and r["simd"] == level and r["threads"] == 1
            assert r["gops"] > 0.05, r
            assert want[level] in r["instruction"], r
        if level == "avx512_bf16":
            assert core.measure_peak("bf16_dot", 1, 0.02, impl=level)["instruction"].startswith("vdpbf16ps")
    if INFO["cpu_features"]["avx512vnni"] and "avx512" in INFO["levels"]:
        assert "vpdpbusd" in core.measure_peak("int8_dot", 1, 0.02, impl="avx512")["instruction"]


def test_measure_peak_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind must be"):
        core.measure_peak("fp64_fma")
    with pytest.raises(ValueError, match="seconds"):
        core.measure_peak("fp32_fma", 1, 0.0)
    with pytest.raises(ValueError, match="threads"):
        core.measure_peak("fp32_fma", -1)
