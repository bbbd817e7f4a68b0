"""`conveyor bench start`: how long `LLM(model)` takes and how much memory it leaves
resident, against the size of the KV cache.

The KV pool and the step scratch are anonymous mappings committed as they are used, so
engine start should not grow with kv_cache_memory, and the resident memory after start
should be about the weights. Each run is a fresh process (so RSS is that
engine's alone); the sizes alternate within each pair, and the ratio of every size's start
time to the first size's is printed pair by pair (the machine is noisy: compare ratios, not
seconds across runs). RSS comes from /proc/self/statm.

With --llama-cpp PATH (llama.cpp's llama-completion; tools/llamacpp_load_time.sh builds
one), each pair is instead one Conveyor process and one llama.cpp process back to back,
both loading the model and generating one token with the same threads: the wall and CPU
time of each whole process (as a user waits for it), Conveyor's own `LLM(model)` time,
llama.cpp's printed load time, and their ratios, pair by pair and best against best.
The model must then be a GGUF file (or the built-in name of one).
"""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import common

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import conveyor
t1 = time.perf_counter()
kw = json.loads(sys.argv[2])
llm = conveyor.LLM(sys.argv[1], **kw)
t2 = time.perf_counter()
page = os.sysconf("SC_PAGE_SIZE")
rss = int(open("/proc/self/statm").read().split()[1]) * page
stats = llm.stats()
first = None
if sys.argv[3] == "1":  # as llama.cpp is timed: one token of a short prompt
    llm.generate(["Hello"], conveyor.SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    first = time.perf_counter() - t2
llm.close()
print(json.dumps({"import_s": t1 - t0, "start_s": t2 - t1, "rss_bytes": rss,
                  "kv_cache_bytes": stats.get("kv_cache_bytes"), "first_token_s": first}))
"""
# llama.cpp's own figure: "common_perf_print: load time = 640.12 ms" (older builds: llama_perf_context_print)
LLAMA_LOAD_TIME = re.compile(r"load time\s*=\s*([0-9.]+)\s*ms")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(cmd: List[str], what: str) -> Tuple[subprocess.CompletedProcess, float, float]:
    """Runs cmd (what: its name in an error) to its end; it, its wall time and the CPU
    time it used."""
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if out.returncode != 0:
        raise RuntimeError(f"{what} exited with status {out.returncode}:\n{out.stderr[-2000:]}")
    return out, wall, cpu


def _child(model: str, kw: Dict[str, Any], first_token: bool, what: str) -> Tuple[Dict[str, Any], float, float]:
    out, wall, cpu = _run([sys.executable, "-c", CHILD, model, json.dumps(kw), "1" if first_token else "0"], what)
    return json.loads(out.stdout.strip().splitlines()[-1]), wall, cpu


def run_conveyor_process(model: str, kw: Dict[str, Any]) -> Dict[str, Any]:
    """One fresh Python process: import, LLM(model, **kw), one token; its wall and CPU time."""
    r, wall, cpu = _child(model, kw, True, f"LLM({model!r})")
    r.update(wall_s=wall, cpu_s=cpu)
    return r


def run_llama_cpp(binary: str, model: str, threads: int) -> Dict[str, Any]:
    """One llama.cpp process loading the model and generating one token."""
    cmd = [binary, "-m", model, "-t", str(threads), "-n", "1", "-p", "Hello", "-no-cnv"]
    out, wall, cpu = _run(cmd, " ".join(cmd))
    m = LLAMA_LOAD_TIME.search(out.stderr + out.stdout)
    return {"wall_s": wall, "cpu_s": cpu, "load_s": float(m.group(1)) / 1000 if m else None}


def run_one(model: str, kv: str, threads: Optional[int]) -> Dict[str, Any]:
    kw: Dict[str, Any] = {"kv_cache_memory": kv}
    if threads:
        kw["num_threads"] = threads
    return _child(model, kw, False, f"LLM({model!r}, kv_cache_memory={kv})")[0]


def print_load_average(when: str = "start") -> None:
    try:
        print(f"load average at {when}: {os.getloadavg()[0]:.2f}")
    except OSError:
        pass


def compare_llama_cpp(model: str, binary: str, pairs: int, threads: int, kv: Optional[str],
                      json_path: Optional[str]) -> int:
    """Conveyor and llama.cpp, one process each per pair, alternating; the ratios of their
    times pair by pair and of the best of each."""
    kw: Dict[str, Any] = {"num_threads": threads}
    if kv:
        kw["kv_cache_memory"] = kv
    with open(model, "rb") as f:  # a warm page cache for both
        while f.read(1 << 24):
            pass
    print(f"model: {model}\nllama.cpp: {binary}\nthreads: {threads}")
    print_load_average()
    runs: List[Dict[str, Any]] = []
    for p in range(pairs):
        c = run_conveyor_process(model, kw)
        ll = run_llama_cpp(binary, model, threads)
        runs.append({"pair": p, "conveyor": c, "llama_cpp": ll})
        load = "?" if ll["load_s"] is None else f"{ll['load_s']:.3f} s"
        print(f"pair {p}  Conveyor: process {c['wall_s']:.3f} s wall, {c['cpu_s']:.3f} s CPU, "
              f"LLM() {c['start_s']:.3f} s  |  llama.cpp: process {ll['wall_s']:.3f} s wall, "
              f"{ll['cpu_s']:.3f} s CPU, load time {load}  |  ratio wall {c['wall_s'] / ll['wall_s']:.2f}x, "
              f"CPU {c['cpu_s'] / ll['cpu_s']:.2f}x")
    best = {k: min(r[k]["wall_s"] for r in runs) for k in ("conveyor", "llama_cpp")}
    best_cpu = {k: min(r[k]["cpu_s"] for r in runs) for k in ("conveyor", "llama_cpp")}
    best_start = min(r["conveyor"]["start_s"] for r in runs)
    loads = [r["llama_cpp"]["load_s"] for r in runs if r["llama_cpp"]["load_s"] is not None]
    print(f"best of {pairs}: Conveyor process {best['conveyor']:.3f} s, llama.cpp process "
          f"{best['llama_cpp']:.3f} s: start-time ratio {best['conveyor'] / best['llama_cpp']:.2f}x wall, "
          f"{best_cpu['conveyor'] / best_cpu['llama_cpp']:.2f}x CPU")
    if loads:
        print(f"best of {pairs}: Conveyor LLM() {best_start:.3f} s, llama.cpp load time {min(loads):.3f} s: "
              f"{best_start / min(loads):.2f}x")
    print_load_average("end")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "llama_cpp": binary, "threads": threads, "runs": runs}, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from ..cli_args import Parser, RawDescriptionDefaultsHelpFormatter

    ap = Parser(prog="conveyor bench start", description=__doc__,
                formatter_class=RawDescriptionDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a model path or a random shape name; default: the built-in SmolLM-135M-shaped "
                         "random checkpoint")
    ap.add_argument("--kv", default=None, help="comma-separated kv_cache_memory sizes; the first is the one "
                                               "the others are compared to (default: 4GiB,256MiB; with "
                                               "--llama-cpp, the engine's own default unless given)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="rounds over all sizes, or Conveyor/llama.cpp pairs (default: 2; 3 with --llama-cpp)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="CPU threads (default: all cores; with --llama-cpp, 2, given to both)")
    ap.add_argument("--llama-cpp", default=None, metavar="PATH",
                    help="llama.cpp's llama-completion binary: time Conveyor and it back to back, loading the "
                         "model and generating one token, and print the ratios (default: none)")
    ap.add_argument("--json", default=None, help="write the runs as JSON to this file (default: none)")
    args = ap.parse_args(argv)
    if args.pairs is not None and args.pairs < 1:
        ap.error("--pairs must be >= 1")
    if args.num_threads is not None and args.num_threads < 1:
        ap.error("--num-threads must be >= 1")
    if args.llama_cpp is not None:
        if not (os.path.isfile(args.llama_cpp) and os.access(args.llama_cpp, os.X_OK)):
            ap.error(f"--llama-cpp {args.llama_cpp!r} is not an executable file "
                     f"(tools/llamacpp_load_time.sh builds one and prints its path)")
        model = common.resolve_model(args.model)
        if not str(model).endswith(".gguf"):
            ap.error(f"--llama-cpp needs a GGUF model; {model} is not a .gguf file")
        kv = [s.strip() for s in args.kv.split(",") if s.strip()][:1] if args.kv else []
        return compare_llama_cpp(str(model), args.llama_cpp, args.pairs or 3, args.num_threads or 2,
                                 kv[0] if kv else None, args.json)
    sizes = [s.strip() for s in (args.kv or "4GiB,256MiB").split(",") if s.strip()]
    if len(sizes) < 2:
        ap.error("--kv needs at least two sizes")
    args.pairs = args.pairs or 2
    model = common.resolve_model(args.model)
    print(f"model: {model}")
    print_load_average()
    runs: List[Dict[str, Any]] = []
    for p in range(args.pairs):
        row = {}
        for kv in sizes:
            r = run_one(model, kv, args.num_threads)
            r.update(pair=p, kv=kv)
            runs.append(r)
            row[kv] = r
            print(f"pair {p}  kv_cache_memory={kv:>8}  start {r['start_s']:7.3f} s  "
                  f"RSS {r['rss_bytes'] / 2**20:8.1f} MiB  (pool {r['kv_cache_bytes'] / 2**20:.0f} MiB)")
        base = row[sizes[0]]["start_s"]
        ratios = "  ".join(f"{kv}/{sizes[0]} {row[kv]['start_s'] / base:.2f}x" for kv in sizes[1:])
        print(f"pair {p}  start-time ratios: {sizes[0]}/{sizes[0]} 1.00x  {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
