"""Builds the CUDA backend (kernels/cuda/*.cu) into conveyor/_conveyor_cuda.so.

setup.py calls extend(cmdclass, ext_modules). The returned build_ext first
builds the C extension as usual, then, when nvcc is found, compiles the .cu
files and links the shared library next to conveyor._core in the build output
(build_ext --inplace, --build-lib and editable installs are respected).
conveyor._core never links against CUDA: kernels/cuda_loader.c dlopen()s the
library when a CUDA backend is first asked for.

Environment:
  CONVEYOR_CUDA=0          never build the CUDA backend
  CONVEYOR_CUDA=1          the CUDA backend is required: fail the build without it
  (unset)                  build it when nvcc is found; warn and go on otherwise
  CONVEYOR_CUDA_ARCHS      compute capabilities, default "80;90" (SASS for each,
                           plus PTX for the last so newer GPUs can JIT it)
  CONVEYOR_NVCC            path to nvcc (default: PATH, then $CUDA_HOME/bin,
                           then /usr/local/cuda/bin)
"""
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB_NAME = "_conveyor_cuda.so"
CUDA_DIR = os.path.join(ROOT, "kernels", "cuda")


def _log(msg):
    sys.stderr.write(f"conveyor cuda: {msg}\n")
    sys.stderr.flush()


def find_nvcc():
    """Path of nvcc, or None."""
    env = os.environ.get("CONVEYOR_NVCC")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cand = os.path.join(home, "bin", "nvcc")
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    return None


def _cuda_lib_dirs(nvcc):
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    dirs = []
    for d in [os.path.join(home, "lib64"), os.path.join(home, "lib")] + glob.glob(
        os.path.join(home, "targets", "*", "lib")
    ):
        if os.path.isdir(d) and glob.glob(os.path.join(d, "libcublas.so*")) and d not in dirs:
            dirs.append(d)
    return dirs


def _archs():
    raw = os.environ.get("CONVEYOR_CUDA_ARCHS", "80;90")
    archs = [a.strip() for a in raw.replace(",", ";").split(";") if a.strip()]
    for a in archs:
        if not a.isdigit():
            raise ValueError(f"CONVEYOR_CUDA_ARCHS: bad compute capability {a!r} (want e.g. 80;90)")
    return archs


def _nvcc_flags():
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden,-Wall,-Wextra",
             "-I" + CUDA_DIR, "-I" + os.path.join(ROOT, "kernels"), "-I" + os.path.join(ROOT, "csrc")]
    archs = _archs()
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


def _deps():
    """Files every object depends on besides its own .cu."""
    return ([h for h in glob.glob(os.path.join(CUDA_DIR, "*.h")) if not h.endswith("cuda_emu.h")] +
            [os.path.join(ROOT, "kernels", "backend.h"), os.path.join(ROOT, "base", "quant_format.h"),
             os.path.join(ROOT, "base", "common.h")])


def _newer(target, sources):
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.exists(s) and os.path.getmtime(s) > t for s in sources)


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stdout[-4000:]}{r.stderr[-4000:]}")
    return r


def build_cuda_library(out_path, temp_dir, nvcc=None):
    """Compiles kernels/cuda/*.cu and links out_path. Raises RuntimeError on failure."""
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        raise RuntimeError("nvcc not found")
    sources = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))
    if not sources:
        raise RuntimeError(f"no .cu files in {CUDA_DIR}")
    os.makedirs(temp_dir, exist_ok=True)
    flags = _nvcc_flags()
    # Flags are part of every object's inputs: a change of archs rebuilds all.
    stamp = os.path.join(temp_dir, "flags.txt")
    old = open(stamp).read() if os.path.exists(stamp) else None
    if old != " ".join(flags):
        for o in glob.glob(os.path.join(temp_dir, "*.o")):
            os.remove(o)
        with open(stamp, "w") as f:
            f.write(" ".join(flags))
    deps = _deps()
    jobs = []
    objects = []
    for src in sources:
        obj = os.path.join(temp_dir, os.path.splitext(os.path.basename(src))[0] + ".o")
        objects.append(obj)
        if _newer(obj, [src] + deps):
            jobs.append([nvcc] + flags + ["-c", src, "-o", obj])
    if jobs:
        _log(f"compiling {len(jobs)} CUDA file(s) for sm_{', sm_'.join(_archs())} with {nvcc}")
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(_run, jobs):
                pass
    if jobs or _newer(out_path, objects):
        libdirs = _cuda_lib_dirs(nvcc)
        link = [nvcc, "-shared", "-o", out_path] + objects
        for d in libdirs:
            link += ["-L" + d, "-Xlinker", "-rpath," + d]
        link += ["-lcublas", "-Xlinker", "-z,defs"]
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        _run(link)
        _log(f"linked {out_path}")
    return out_path


def _emu_rewrite(text):
    """CUDA source -> C++ for the emulator (kernels/cuda/cuda_emu.h)."""
    text = re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]\s*;",
                  r"\1 *\2 = (\1 *)cvemu::dyn_smem();", text)
    text = re.sub(r"([A-Za-z_]\w*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(",
                  r"cvemu::launch(\1, cvemu::cfg(\2), ", text, flags=re.S)
    return re.sub(r",\s*\)", ")", text) if "cvemu::launch" in text and ", )" in text else text


def build_emulated_library(out_path, temp_dir, cxx=None, extra_flags=()):
    """Builds the CUDA backend against the CPU emulator (kernels/cuda/cuda_emu.h)
    with a host C++ compiler, for testing the kernels without a GPU: load it with
    CONVEYOR_CUDA_LIB=out_path. Slow by design (every GPU thread is a fiber)."""
    cxx = cxx or os.environ.get("CXX") or "g++"
    inc = os.path.join(temp_dir, "include")
    src_dir = os.path.join(temp_dir, "src")
    os.makedirs(inc, exist_ok=True)
    os.makedirs(src_dir, exist_ok=True)
    for h in ("cuda_runtime.h", "cublas_v2.h", "cuda_fp16.h", "cuda_bf16.h"):
        with open(os.path.join(inc, h), "w") as f:
            f.write('#include "cuda_emu.h"\n')
    flags = ["-std=c++20", "-O1", "-g", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden", "-w",
             "-I" + inc, "-I" + CUDA_DIR, "-I" + os.path.join(ROOT, "kernels"),
             "-I" + os.path.join(ROOT, "csrc")] + list(extra_flags)
    objects, jobs = [], []
    deps = glob.glob(os.path.join(CUDA_DIR, "*.h")) + [os.path.join(ROOT, "kernels", "backend.h"),
                                                       os.path.join(ROOT, "base", "quant_format.h")]
    for cu in sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu"))):
        base = os.path.splitext(os.path.basename(cu))[0]
        cpp = os.path.join(src_dir, base + ".cpp")
        obj = os.path.join(src_dir, base + ".o")
        with open(cu) as f:
            text = _emu_rewrite(f.read())
        old = open(cpp).read() if os.path.exists(cpp) else None
        if old != text:
            with open(cpp, "w") as f:
                f.write(text)
        objects.append(obj)
        if _newer(obj, [cpp] + deps):
            jobs.append([cxx] + flags + ["-c", cpp, "-o", obj])
    if jobs:
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(_run, jobs):
                pass
    if jobs or _newer(out_path, objects):
        _run([cxx, "-shared", "-o", out_path] + objects + list(extra_flags))
    return out_path


def extend(cmdclass, ext_modules):
    """Returns cmdclass with a build_ext that also builds the CUDA library."""
    from setuptools.command.build_ext import build_ext as _setuptools_build_ext

    base = cmdclass.get("build_ext", _setuptools_build_ext)
    core = next((e for e in ext_modules if e.name.endswith("._core")), None)
    package = core.name.rpartition(".")[0] if core else "conveyor"

    class BuildExtCuda(base):
        def _cuda_regular_path(self):
            return os.path.join(self.build_lib, *package.split("."), LIB_NAME)

        def _cuda_inplace_path(self):
            build_py = self.get_finalized_command("build_py")
            return os.path.join(build_py.get_package_dir(package), LIB_NAME)

        def run(self):
            super().run()
            self._build_cuda()

        def _build_cuda(self):
            mode = os.environ.get("CONVEYOR_CUDA", "").strip()
            if mode == "0":
                _log("CONVEYOR_CUDA=0: not building the CUDA backend")
                return
            nvcc = find_nvcc()
            out = self._cuda_regular_path()
            if not nvcc:
                msg = "nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): building without the CUDA backend"
                if mode == "1":
                    raise RuntimeError("CONVEYOR_CUDA=1 but " + msg)
                _log(msg)
                return
            temp = os.path.join(self.build_temp, "cuda")
            try:
                build_cuda_library(out, temp, nvcc)
            except (RuntimeError, OSError, ValueError) as e:
                if os.path.exists(out):
                    os.remove(out)  # never leave a stale library behind a failed build
                if mode == "1":
                    raise
                _log(f"WARNING: the CUDA backend failed to build; conveyor will run on the CPU only.\n{e}")
                return
            if self.inplace:
                dst = self._cuda_inplace_path()
                if os.path.abspath(dst) != os.path.abspath(out):
                    shutil.copy2(out, dst)

        def get_outputs(self):
            outs = list(super().get_outputs())
            if os.path.exists(self._cuda_regular_path()) and self._cuda_regular_path() not in outs:
                outs.append(self._cuda_regular_path())
            return outs

        def get_output_mapping(self):
            mapping = dict(super().get_output_mapping())
            if self.inplace and os.path.exists(self._cuda_regular_path()):
                mapping[self._cuda_regular_path()] = self._cuda_inplace_path()
            return mapping

    cmdclass = dict(cmdclass)
    cmdclass["build_ext"] = BuildExtCuda
    return cmdclass
