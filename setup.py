"""Builds Conveyor's two C11 extensions from one set of C core objects:

  conveyor._core      the product module (csrc/binding/): engine, checkpoints, errors,
                      request and sampling params, GGUF metadata, kernel_info
  conveyor._testing   the test and benchmark hooks (csrc/testing/), shipped beside it as
                      CPython ships _testcapi; it uses conveyor._core's exception types
Both link the same objects of the floors below them: base/, kernels/, csrc/model/, csrc/core/.

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
from setuptools.modified import newer_group

ROOT = os.path.dirname(os.path.abspath(__file__))


def _glob(*patterns):
    files = []
    for pattern in patterns:
        files += glob.glob(pattern, recursive=True, root_dir=ROOT)
    return sorted(files)


def core_sources():
    """The C core both extensions link: every floor below the bindings."""
    return _glob("base/*.c", "kernels/*.c", "kernels/cpu/**/*.c", "csrc/model/*.c", "csrc/core/*.c")


def binding_helpers():
    """The binding's shared helpers (arrays, errors, vocabulary lists), compiled into each extension."""
    return ["csrc/binding/arrays.c", "csrc/binding/errors.c", "csrc/binding/vocab_lists.c"]


def c_headers():
    # a changed header rebuilds the extensions (setuptools compares sources only)
    return _glob("base/*.h", "csrc/**/*.h", "kernels/*.h", "kernels/cpu/**/*.h")


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
        emulate = os.environ.get("CONVEYOR_EMULATE_AVX512") == "1"
        # emulated intrinsics (development) at -O1: GCC takes tens of minutes a kernel file at -O3 over SIMDe
        flags += ["-O0", "-g"] if debug else ["-O1"] if emulate else ["-O3"]
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
        if emulate:  # development: tools/avx512_emulated.sh
            flags += ["-DCV_EMULATE_AVX512", "-Wno-psabi", "-I" + os.path.join(ROOT, "build_support", "avx512_emu")]
        link = ["-pthread", "-lm", "-ldl"]
        if sanitize:
            link += ["-fsanitize=address,undefined"]
        for ext in self.extensions:
            ext.extra_compile_args = flags
            ext.extra_link_args = link
        if self.force or any(newer_group(ext.sources + ext.depends, self.get_ext_fullpath(ext.name), "newer")
                             for ext in self.extensions):
            # the core objects once, for every extension that links them
            objects = self.compiler.compile(core_sources(), output_dir=self.build_temp,
                                            include_dirs=INCLUDE_DIRS, extra_postargs=flags,
                                            depends=c_headers())
            for ext in self.extensions:
                ext.extra_objects = list(objects)
        super().build_extensions()


INCLUDE_DIRS = [numpy.get_include(), "csrc", "kernels"]
core = Extension(
    "conveyor._core",
    sources=_glob("csrc/binding/*.c"),
    depends=core_sources() + c_headers(),
    include_dirs=INCLUDE_DIRS,
    language="c",
)
testing = Extension(
    "conveyor._testing",
    sources=_glob("csrc/testing/*.c") + binding_helpers(),
    depends=core_sources() + c_headers(),
    include_dirs=INCLUDE_DIRS,
    language="c",
)

ext_modules = [core, testing]
cmdclass = {"build_ext": BuildExt}

# The CUDA backend (kernels/cuda) is added by build_support/cuda_build.py when nvcc is found.
try:
    sys.path.insert(0, os.path.join(ROOT, "build_support"))
    import cuda_build  # noqa: E402

    cmdclass = cuda_build.extend(cmdclass, ext_modules)
except ImportError:
    pass

setup(ext_modules=ext_modules, cmdclass=cmdclass)
