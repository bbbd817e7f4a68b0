"""The `conveyor` command line.

    conveyor info MODEL [--json] [--tensors]
    conveyor generate ...          -> conveyor.generate.main(argv)
    conveyor serve ...             -> conveyor.serve.main(argv)
    conveyor bench NAME ...        -> conveyor.bench.NAME.main(argv), NAME in BENCHMARKS
    conveyor fetch-model           -> conveyor.default_model.main(argv)

Subcommands live in SUBCOMMANDS as name -> ("module:function", help); the module is imported
only when its subcommand runs, so a missing optional module (or one of its dependencies)
gives a clear message instead of breaking the whole command. A subcommand's function takes
the remaining arguments (a list of str) and returns an exit status (None means 0).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Callable, Sequence

BENCHMARKS: tuple[str, ...] = ("kernels", "roofline", "scheduler", "throughput", "variance", "latency",
                               "timeline", "serve")

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("conveyor.cli:info_main", "summarize a checkpoint (format, shapes, parameters, bytes)"),
    "generate": ("conveyor.generate:main", "generate text from prompts"),
    "serve": ("conveyor.serve:main", "run the OpenAI-compatible HTTP server"),
    "bench": ("conveyor.cli:bench_main", "run a benchmark: " + ", ".join(BENCHMARKS)),
    "fetch-model": ("conveyor.default_model:main", "download the default model (SmolLM2-135M-Instruct) once"),
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
        hint = f" (install the missing package {missing!r})" if missing and not missing.startswith("conveyor") else ""
        raise _LoadError(f"{what} could not be loaded: {e}{hint}") from None
    func = getattr(module, func_name or "main", None)
    if not callable(func):
        raise _LoadError(f"{what}: {module_name} has no function {func_name or 'main'}()")
    return func


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: conveyor COMMAND [ARGS...]", "", "Conveyor: an LLM inference engine with a C core.",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'conveyor COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__
        print(f"conveyor {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"conveyor: unknown command {cmd!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    try:
        func = _resolve(SUBCOMMANDS[cmd][0], f"conveyor {cmd}")
    except _LoadError as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 1
    try:
        rc = func(rest)
    except BrokenPipeError:  # output piped into `head` and the like
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    return 0 if rc is None else int(rc)


# ---------------------------------------------------------------------------- bench


def bench_main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: conveyor bench NAME [ARGS...]\n\nbenchmarks: " + ", ".join(BENCHMARKS))
        return 0 if argv else 2
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"conveyor bench: unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    try:
        func = _resolve(f"conveyor.bench.{name}:main", f"conveyor bench {name}")
    except _LoadError as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 1
    rc = func(argv[1:])
    return 0 if rc is None else int(rc)


# ---------------------------------------------------------------------------- info


# bytes per block of 32 elements of the quantized (GGUF) types
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def _nbytes(dtype, n: int) -> int:
    d = str(dtype).lower()
    return n // 32 * _BLOCK_BYTES[d] if d in _BLOCK_BYTES else n * _itemsize(d)


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

    if not hasattr(_core, "Checkpoint"):
        raise RuntimeError("this build of conveyor._core has no Checkpoint")
    ck = _core.Checkpoint(str(path))
    cfg = dict(ck.config)
    tensors = ck.tensors()
    params = 0
    nbytes = 0
    by_dtype: dict[str, int] = {}
    for dtype, shape in tensors.values():
        n = 1
        for s in shape:
            n *= int(s)
        params += n
        nbytes += _nbytes(dtype, n)
        by_dtype[str(dtype)] = by_dtype.get(str(dtype), 0) + 1
    meta = ck.metadata if hasattr(ck, "metadata") else {}
    extra = {}
    if ck.format == "gguf":  # what the GGUF file brings besides the weights
        extra = {"tokenizer": meta.get("tokenizer.ggml.model"),
                 "chat_template": "tokenizer.chat_template" in meta,
                 "file_type": meta.get("general.file_type"), "name": meta.get("general.name")}
    return {
        "path": str(path),
        "format": ck.format,
        **extra,
        "config": cfg,
        "n_tensors": len(tensors),
        "tensor_dtypes": by_dtype,
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
        f"tied embeddings: {yn(g('tie_embeddings'))}   qkv bias: {yn(g('qkv_bias'))}",
        f"bos / eos ids:   {g('bos_id')} / {g('eos_ids')}",
        f"dtype:           {g('dtype')}   (tensors: "
        + ", ".join(f"{n} {d}" for d, n in sorted(info["tensor_dtypes"].items())) + ")",
        f"parameters:      {info['parameters']:,} ({_human(info['parameters'])})",
        f"weight bytes:    {info['weight_bytes']:,} ({info['weight_bytes'] / 2**20:.2f} MiB)",
        f"tensors:         {info['n_tensors']}",
    ]
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
    p = argparse.ArgumentParser(prog="conveyor info", description=SUBCOMMANDS["info"][1])
    p.add_argument("model", help="a HF model folder, a .gguf file or a llama2.c .bin file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    args = p.parse_args(list(argv))
    from . import ConveyorError

    try:
        info = summarize(args.model)
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
