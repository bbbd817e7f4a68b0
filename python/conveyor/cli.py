"""The `conveyor` command line.

    conveyor info MODEL [--json] [--tensors]
    conveyor generate ...          -> conveyor.generate.main(argv)
    conveyor serve ...             -> conveyor.serve.main(argv)
    conveyor serve ... --ray       -> conveyor.ray.serve.main(argv) (Ray Serve replicas)
    conveyor chat ...              -> conveyor.chat.main(argv)
    conveyor bench NAME ...        -> conveyor.bench.NAME.main(argv), NAME in BENCHMARKS
    conveyor models [--json]       -> the built-in model names (conveyor.models)
    conveyor fetch-model [NAME]    -> conveyor.models.fetch_main(argv)

Subcommands live in SUBCOMMANDS as name -> ("module:function", help); the module is imported
only when its subcommand runs, so a missing optional module (or one of its dependencies)
gives a clear message instead of breaking the whole command. A subcommand's function takes
the remaining arguments (a list of str) and returns an exit status (None means 0).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from typing import Callable, Sequence

from .cli_args import Parser

BENCHMARK_HELP: dict[str, str] = {
    "kernels": "GEMM and memory bandwidth of the CPU kernels against the machine's peaks",
    "roofline": "a whole model's decode and large steps against the bandwidth and compute bounds",
    "bound": "the physical bound of a workload (study, batch-1 decode, 64 running, prefill) beside its measured time",
    "scheduler": "the cost of one scheduling step with many running sequences",
    "throughput": "offline throughput: N requests at once, run to completion",
    "variance": "static against continuous batching as output lengths vary more",
    "latency": "TTFT / TPOT / end-to-end latency under Poisson arrivals (in process)",
    "timeline": "which sequence sits in which batch slot at every step (a plot)",
    "serve": "latency under Poisson load against the HTTP server",
    "study": "the study: HF static batching vs Conveyor static and continuous (and vLLM if present)",
    "start": "engine start time and resident memory against the KV cache size",
    "speculative": "n-gram speculative decoding vs plain decoding on input-grounded prompts (batch 1)",
    "lora": "1, 4, 16, 64 LoRA adapters in one batch vs the base alone and vs merged copies one at a time",
}
BENCHMARKS: tuple[str, ...] = tuple(BENCHMARK_HELP)

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("conveyor.cli:info_main", "summarize a checkpoint (format, shapes, parameters, bytes)"),
    "generate": ("conveyor.generate:main", "generate text from prompts"),
    "serve": ("conveyor.serve:main", "run the OpenAI-compatible HTTP server"),
    "chat": ("conveyor.chat:main", "chat with a model in the terminal"),
    "bench": ("conveyor.cli:bench_main", "run a benchmark: " + ", ".join(BENCHMARKS)),
    "models": ("conveyor.cli:models_main", "list the built-in model names, their sizes, licenses and "
                                           "whether each is cached"),
    "fetch-model": ("conveyor.models:fetch_main", "download a built-in model once (default: "
                                                  "SmolLM2-135M-Instruct)"),
}


class _LoadError(Exception):
    pass


def _resolve(target: str, what: str) -> Callable:
    module_name, _, func_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise _LoadError(f"{what} is not available in this installation "
                             f"(module {module_name} not found)") from None
        from .extras import explain

        dep = explain(e, what)
        if dep is not None:
            raise _LoadError(str(dep)) from None
        hint = f" (install the missing package {missing!r})" if missing and not missing.startswith("conveyor") else ""
        raise _LoadError(f"{what} could not be loaded: {e}{hint}") from None
    func = getattr(module, func_name or "main", None)
    if not callable(func):
        raise _LoadError(f"{what}: {module_name} has no function {func_name or 'main'}()")
    return func


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: conveyor [--debug] COMMAND [ARGS...]", "",
             "Conveyor: an LLM inference engine with a C core.", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'conveyor COMMAND --help' for a command's options. --debug (anywhere, or",
              "CONVEYOR_DEBUG=1) shows the Python traceback of an error."]
    return "\n".join(lines)


# What a user can cause (a wrong path, a bad value, a model too big, no GPU...): one line.
_USER_ERRORS = (OSError, ValueError, TypeError, MemoryError, RuntimeError, LookupError)


def _silence_broken_pipe() -> int:
    """stdout went to a reader that quit (`| head`): stop writing, quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand. Errors print `conveyor CMD: error: MESSAGE` and return 1 (2 for
    usage errors); Ctrl-C prints `conveyor CMD: interrupted` and the KeyboardInterrupt goes on
    without a traceback. With --debug the traceback propagates instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("CONVEYOR_DEBUG", "") not in ("", "0")
    if "--debug" in argv:
        debug = True
        argv = [a for a in argv if a != "--debug"]
    prog = "conveyor"
    try:
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(_usage())
            return 0 if argv else 2
        if argv[0] == "--version":
            from . import __version__
            print(f"conveyor {__version__}")
            return 0
        cmd, rest = argv[0], argv[1:]
        if cmd not in SUBCOMMANDS:
            print(f"conveyor: error: unknown command {cmd!r}; choose from {', '.join(SUBCOMMANDS)}",
                  file=sys.stderr)
            return 2
        prog = f"conveyor {cmd}"
        if cmd == "bench" and rest and rest[0] in BENCHMARKS:
            prog = f"conveyor bench {rest[0]}"
        if not debug:  # a user's warning as one line in the errors' format, not Python's source line
            warnings.formatwarning = lambda message, category, *args, **kw: f"{prog}: warning: {message}\n"
        try:
            target = SUBCOMMANDS[cmd][0]
            if cmd == "serve" and "--ray" in rest:  # replicas on Ray Serve (the `ray` extra)
                target = "conveyor.ray.serve:main"
            func = _resolve(target, prog)
        except _LoadError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 1
        try:
            rc = func(rest)
        except _LoadError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 1
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return 0 if rc is None else int(rc)
    except BrokenPipeError:  # output piped into `head` and the like
        return _silence_broken_pipe()
    except KeyboardInterrupt as e:
        if debug:
            raise
        _say_interrupted(prog, e)
        raise
    except SystemExit:
        raise  # argparse: it printed "conveyor CMD: error: ..." and exits 2
    except Exception as e:
        if not debug and _caused_by_interrupt(e):  # e.g. NumPy turns one inside its import into ImportError
            interrupt = KeyboardInterrupt()
            _say_interrupted(prog, interrupt)
            raise interrupt from None
        from ._core import ConveyorError

        if debug or not isinstance(e, _USER_ERRORS + (ConveyorError,)):
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _say_interrupted(prog: str, interrupt: KeyboardInterrupt) -> None:
    """Ctrl-C: one line, and no traceback when this interrupt reaches the top. It is left to
    propagate because the interpreter then ends the process by SIGINT after its normal
    shutdown, as a shell expects of an interrupted command (status 130, and a script's loop
    stops). Returning 130 would not even be reliable: under `python -m` CPython ends by SIGINT
    anyway once an interrupt has surfaced inside exec'd source (a dataclass's generated
    __init__, say), caught or not."""
    print(f"\n{prog}: interrupted", file=sys.stderr)
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if exc is not interrupt:
            previous(exc_type, exc, tb)

    sys.excepthook = hook


def _caused_by_interrupt(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _one_line(e: BaseException) -> str:
    msg = str(e).strip()
    if isinstance(e, KeyError):
        msg = f"missing key {msg}"
    if isinstance(e, OSError) and e.filename and e.strerror and str(e.filename) not in msg:
        msg = f"{e.strerror}: {e.filename}"
    return " ".join(msg.split()) or type(e).__name__


# ---------------------------------------------------------------------------- bench


def _bench_usage() -> str:
    width = max(len(n) for n in BENCHMARKS)
    lines = ["usage: conveyor bench NAME [ARGS...]", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {BENCHMARK_HELP[name]}" for name in BENCHMARKS]
    lines += ["", "Run 'conveyor bench NAME --help' for a benchmark's options."]
    return "\n".join(lines)


def bench_main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_bench_usage())
        return 0 if argv else 2
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"conveyor bench: error: unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    func = _resolve(f"conveyor.bench.{name}:main", f"conveyor bench {name}")
    try:
        rc = func(argv[1:])
    except ImportError as e:  # an optional dependency, imported where it is first needed
        from .extras import explain

        dep = explain(e, f"conveyor bench {name}")
        if dep is None:
            raise
        raise dep from None
    return 0 if rc is None else int(rc)


# ---------------------------------------------------------------------------- info


def _nbytes(dtype, n: int) -> int:
    """Bytes of n elements: the block layout of a quantized GGUF type (q8_0 ... q6_k), else
    the item size."""
    from .gguf import _TYPE_LAYOUT, GGMLType

    d = str(dtype).lower()
    t = GGMLType.__members__.get(d.upper())
    if t is not None and _TYPE_LAYOUT[t][0] > 1:
        blk, size = _TYPE_LAYOUT[t]
        return n // blk * size
    return n * _itemsize(d)


def _itemsize(dtype) -> int:
    d = str(dtype).lower()
    for key, size in (("64", 8), ("32", 4), ("16", 2), ("8", 1)):
        if key in d:
            return size
    raise ValueError(f"unknown dtype {dtype!r}")


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.3g}{suffix}{unit}" if suffix else f"{n:g}{unit}"
        n /= 1000.0
    return str(n)


def summarize(path) -> dict:
    """A dict describing the checkpoint at ``path`` (what `conveyor info` prints)."""
    from . import _core
    from .models import weights_dtype

    if not hasattr(_core, "Checkpoint"):
        raise RuntimeError("this build of conveyor._core has no Checkpoint")
    ck = _core.Checkpoint(str(path))
    cfg = dict(ck.config)
    tensors = ck.tensors()
    params = 0
    nbytes = 0
    by_dtype: dict[str, int] = {}
    bytes_by_dtype: dict[str, int] = {}
    for dtype, shape in tensors.values():
        n = 1
        for s in shape:
            n *= int(s)
        params += n
        b = _nbytes(dtype, n)
        nbytes += b
        by_dtype[str(dtype)] = by_dtype.get(str(dtype), 0) + 1
        bytes_by_dtype[str(dtype)] = bytes_by_dtype.get(str(dtype), 0) + b
    meta = ck.metadata if hasattr(ck, "metadata") else {}
    extra = {}
    if ck.format == "gguf":  # what the GGUF file brings besides the weights
        extra = {"tokenizer": meta.get("tokenizer.ggml.model"),
                 "chat_template": "tokenizer.chat_template" in meta,
                 "file_type": meta.get("general.file_type"), "name": meta.get("general.name")}
    return {
        "path": str(path),
        "format": ck.format,
        "dtype": weights_dtype(by_dtype),
        **extra,
        "config": cfg,
        "n_tensors": len(tensors),
        "tensor_dtypes": by_dtype,
        "tensor_dtype_bytes": bytes_by_dtype,
        "parameters": params,
        "weight_bytes": nbytes,
        "tensors": {name: [str(d), [int(s) for s in shape]] for name, (d, shape) in tensors.items()},
    }


def _format_summary(info: dict, show_tensors: bool) -> str:
    c = info["config"]
    g = c.get

    def yn(v):
        return "yes" if v else "no"

    scaling = g("rope_scaling")
    lines = [
        f"model:           {info['path']}",
        f"format:          {info['format']}",
        f"architecture:    {g('arch')}",
        f"dim:             {g('dim')}   hidden_dim: {g('hidden_dim')}   layers: {g('n_layers')}",
        f"heads:           {g('n_heads')}   kv heads: {g('n_kv_heads')}   head_dim: {g('head_dim')}",
        f"vocab_size:      {g('vocab_size')}   max positions: {g('max_pos')}",
        f"rope:            theta {g('rope_theta'):g}, layout {g('rope_layout')}, scaling {scaling or 'none'}",
        f"rms_eps:         {g('rms_eps'):.6g}",
        f"tied embeddings: {yn(g('tie_embeddings'))}   qkv bias: {yn(g('qkv_bias'))}   qk norm: {yn(g('qk_norm'))}"
        + (f"   sliding window: {g('sliding_window')}" if g("sliding_window") else ""),
        f"bos / eos ids:   {g('bos_id')} / {g('eos_ids')}",
        f"dtype:           {info['dtype']}   (tensors: "
        + ", ".join(f"{n} {d}" for d, n in sorted(info["tensor_dtypes"].items())) + ")",
        f"parameters:      {info['parameters']:,} ({_human(info['parameters'])})",
        f"weight bytes:    {info['weight_bytes']:,} ({info['weight_bytes'] / 2**20:.2f} MiB)",
        f"tensors:         {info['n_tensors']}",
    ]
    for d, n in sorted(info["tensor_dtypes"].items(), key=lambda kv: -info["tensor_dtype_bytes"][kv[0]]):
        b = info["tensor_dtype_bytes"][d]
        lines.append(f"  {d:<9} {n:>5} tensors {b:>14,} bytes ({b / 2**20:8.2f} MiB)")
    if info["format"] == "gguf":
        lines.append(f"tokenizer:       {info['tokenizer'] or 'none'}   chat template: {yn(info['chat_template'])}")
    if show_tensors:
        width = max((len(n) for n in info["tensors"]), default=0)
        for name, (d, shape) in info["tensors"].items():
            n = 1
            for s in shape:
                n *= int(s)
            lines.append(f"  {name:<{width}}  {d:>8}  {str(shape):<14} {_nbytes(d, n):>12,} B")
    return "\n".join(lines)


def info_main(argv: Sequence[str]) -> int:
    p = Parser(prog="conveyor info", description=SUBCOMMANDS["info"][1])
    p.add_argument("model", help="a HF model folder, a .gguf file, a llama2.c .bin file or a built-in "
                                 "name ('conveyor models'; a fetched one must be in the cache)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    args = p.parse_args(list(argv))
    from . import ConveyorError

    try:
        from .models import resolve_model

        info = summarize(resolve_model(args.model, fetch=False))
    except (OSError, ConveyorError, ValueError, RuntimeError) as e:
        print(f"conveyor info: error: {e}", file=sys.stderr)
        return 1
    if not args.tensors:
        info_out = {k: v for k, v in info.items() if k != "tensors"}
    else:
        info_out = info
    if args.json:
        print(json.dumps(info_out, indent=2, default=str))
    else:
        print(_format_summary(info, args.tensors))
    return 0


# ---------------------------------------------------------------------------- models


def models_main(argv: Sequence[str]) -> int:
    p = Parser(prog="conveyor models", description=SUBCOMMANDS["models"][1] + ". Any of these names "
               "works wherever a model is given (LLM(NAME), --model NAME); so does a path.")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    args = p.parse_args(list(argv))
    from .models import cache_dir, describe_models

    rows = describe_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    lic = max(len(r["license"]) for r in rows)
    print(f"{'NAME':<{width}}  {'SIZE':>8}  {'LICENSE':<{lic}}  WHERE")
    for r in rows:
        where = r["path"] or f"not cached (fetched on first use; 'conveyor fetch-model {r['name']}')"
        mark = " (default)" if r["default"] else ""
        print(f"{r['name']:<{width}}  {r['bytes'] / 1e6:>6.1f}MB  {r['license']:<{lic}}  {where}{mark}")
    print(f"\ncache: {cache_dir()} ($CONVEYOR_CACHE moves it)")
    return 0
