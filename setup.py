"""Builds conveyor._core (C11) from csrc/ and kernels/cpu/.

Environment knobs:
  CONVEYOR_MARCH=none|native   -march for the whole build (default none: every SIMD path is
                               compiled with per-function target attributes and chosen at run
                               time, so the module runs on any x86-64; native is opt-in)
  CONVEYOR_SANITIZE=1          AddressSanitizer + UndefinedBehaviorSanitizer build (tests under ASan)
  CONVEYOR_DEBUG=1             -O0 -g
  CONVEYOR_EMULATE_AVX512=1    development: AVX-512 intrinsics in portable C (SIMDe), so the
                               AVX-512 kernels run and are tested on any CPU (slowly)
At run time CONVEYOR_SIMD=scalar|avx2|avx512|avx512_bf16 forces one kernel path
(CONVEYOR_FORCE_SCALAR=1 is an alias of scalar); conveyor._core.kernel_info() says which runs.
"""
import os
import glob
import itertools
import subprocess
import sys
import tempfile

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def c_sources():
    files = []
    for pattern in ("base/*.c", "csrc/**/*.c", "kernels/*.c", "kernels/cpu/**/*.c"):
        files += glob.glob(pattern, recursive=True, root_dir=ROOT)
    return sorted(f for f in files if "/fuzz/" not in f)


def c_headers():
    # a changed header rebuilds the extension (setuptools compares sources only)
    files = []
    for pattern in ("base/*.h", "csrc/**/*.h", "kernels/*.h", "kernels/cpu/**/*.h"):
        files += glob.glob(pattern, recursive=True, root_dir=ROOT)
    return sorted(files)


def compiler_accepts(cc, flag):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("int main(void){return 0;}\n")
        try:
            r = subprocess.run(cc + [flag, "-c", src, "-o", os.path.join(d, "t.o")],
                               capture_output=True)
        except OSError:
            return False
        return r.returncode == 0


class BuildExt(build_ext):
    def build_extensions(self):
        # the compiler command's leading words ("ccache gcc" is two), before its flags
        words = getattr(self.compiler, "compiler_so", None) or ["cc"]
        cc = list(itertools.takewhile(lambda w: not w.startswith("-"), words)) or ["cc"]
        flags = ["-std=c11", "-Wall", "-Wextra", "-pthread", "-fvisibility=hidden",
                 "-D_GNU_SOURCE"]
        debug = os.environ.get("CONVEYOR_DEBUG") == "1"
        sanitize = os.environ.get("CONVEYOR_SANITIZE") == "1"
        flags += ["-O0", "-g"] if debug else ["-O3"]
        # No code here reads floating-point exception flags; without this, GCC keeps loops
        # with float compares in them scalar (the sampler's exp over the vocabulary was).
        # Values are unchanged: no contraction or reassociation comes with it.
        flags.append("-fno-trapping-math")
        if sanitize:
            flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                      "-fno-sanitize-recover=undefined", "-g"]
        march = os.environ.get("CONVEYOR_MARCH", "none")
        if march != "none" and compiler_accepts(cc, f"-march={march}"):
            flags.append(f"-march={march}")
        else:
            march = "none"
        flags.append(f'-DCV_BUILD_MARCH="{march}"')
        if os.environ.get("CONVEYOR_EMULATE_AVX512") == "1":  # development: tools/avx512_emulated.sh
            flags += ["-DCV_EMULATE_AVX512", "-Wno-psabi", "-I" + os.path.join(ROOT, "build_support", "avx512_emu")]
        link = ["-pthread", "-lm", "-ldl"]
        if sanitize:
            link += ["-fsanitize=address,undefined"]
        for ext in self.extensions:
            ext.extra_compile_args = flags
            ext.extra_link_args = link
        super().build_extensions()


core = Extension(
    "conveyor._core",
    sources=c_sources(),
    depends=c_headers(),
    include_dirs=[numpy.get_include(), "csrc", "kernels"],
    language="c",
)

ext_modules = [core]
cmdclass = {"build_ext": BuildExt}

# The CUDA backend (kernels/cuda) is added by build_support/cuda_build.py when nvcc is found.
try:
    sys.path.insert(0, os.path.join(ROOT, "build_support"))
    import cuda_build  # noqa: E402

    cmdclass = cuda_build.extend(cmdclass, ext_modules)
except ImportError:
    pass

setup(ext_modules=ext_modules, cmdclass=cmdclass)
