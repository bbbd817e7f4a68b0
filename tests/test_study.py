"""`conveyor bench study`: the workload every system gets, the HF naive-static baseline,
and the command end to end (tiny model)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conveyor.testing import subprocess_env

from conveyor.bench import common, study
from conveyor.generate import default_model

ROOT = Path(__file__).resolve().parents[1]
# torch is not built with the sanitizers: under tools/sanitize.sh its own allocations
# would fill LeakSanitizer's report, so the tests that load it run in the plain suite
# (and it is not even imported to see whether it loads).
SANITIZED = os.environ.get("CONVEYOR_SANITIZED") == "1"
HF_MISSING = "torch does not run under the sanitizers" if SANITIZED else study.system_available("hf_static")
HAVE_HF = HF_MISSING is None
needs_hf = pytest.mark.skipif(not HAVE_HF, reason=f"the HF baseline (the 'peers' extra) cannot run: {HF_MISSING}")


@pytest.fixture(scope="module")
def tiny():
    """The tiny random HF checkpoint in float32 (exact enough for token equality)."""
    return str(default_model(shape="tiny", dtype="float32"))


def _wl(**kw):
    args = dict(vocab_size=512, num_requests=24, prompt_len=16, mean_output=8, cap=32, seed=3)
    args.update(kw)
    return study.make_study_workload(**args)


# ----------------------------------------------------------------------------- workload


def test_every_system_reads_byte_identical_requests(tmp_path):
    a, b = _wl(), _wl()
    ha = study.save_workload(a, tmp_path / "a.json")
    hb = study.save_workload(b, tmp_path / "b.json")
    assert ha == hb  # the same arguments give the same requests
    prompts, lens, h = study.load_workload(tmp_path / "a.json")
    assert h == ha
    assert [list(map(int, p)) for p in a.prompts] == prompts and lens == a.output_lens
    # the prompts do not depend on the cap; the lengths do
    c = _wl(cap=4)
    assert all(np.array_equal(x, y) for x, y in zip(a.prompts, c.prompts))
    assert study.workload_hash(c.prompts, c.output_lens) != ha
    # any change to a token or a length changes the hash, and a tampered file is refused
    p2 = [list(map(int, p)) for p in a.prompts]
    p2[5][7] = (p2[5][7] + 1) % 512
    assert study.workload_hash(p2, a.output_lens) != ha
    l2 = list(a.output_lens)
    l2[0] += 1
    assert study.workload_hash(a.prompts, l2) != ha
    d = json.loads((tmp_path / "a.json").read_text())
    d["prompts"][0][0] = (d["prompts"][0][0] + 1) % 512
    (tmp_path / "a.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="hash"):
        study.load_workload(tmp_path / "a.json")


def _capped_exponential_cdf(mean, cap):
    """CDF of max(1, round(Exp(mean))) conditioned on <= cap, at 1..cap."""
    k = np.arange(1, cap + 1, dtype=np.float64)
    F = lambda x: 1.0 - np.exp(-x / mean)  # noqa: E731
    cdf = F(k + 0.5)  # P(length <= k) before the cap: rint(x) <= k  <=>  x < k + 0.5
    return cdf / cdf[-1]


@pytest.mark.parametrize("cap", [32, 128, 512])
def test_lengths_follow_the_capped_exponential(cap):
    n, mean = 20000, 128
    wl = study.make_study_workload(vocab_size=100, num_requests=n, prompt_len=1, mean_output=mean,
                                   cap=cap, seed=11)
    x = np.asarray(wl.output_lens)
    assert x.min() >= 1 and x.max() <= cap
    assert x.max() >= cap - max(2, cap // 50)  # the cap binds: draws reach up to it
    ecdf = np.searchsorted(np.sort(x), np.arange(1, cap + 1), side="right") / n
    ks = np.abs(ecdf - _capped_exponential_cdf(mean, cap)).max()
    assert ks < 1.63 / math.sqrt(n), f"KS distance {ks:.4f} (99% bound {1.63 / math.sqrt(n):.4f})"


def test_variance_rises_with_the_cap():
    stds = [np.std(_wl(num_requests=4000, mean_output=128, cap=c).output_lens) for c in (32, 128, 512, 1536)]
    assert all(a < b for a, b in zip(stds, stds[1:])), stds


def test_static_batch_is_the_largest_that_fits_the_kv_budget():
    p = study.plan_batch(kv_tokens=8192, prompt_len=512, cap=32, block_size=16, num_requests=1000)
    assert p["blocks_per_seq"] == 34 and p["batch_size"] == 15 and p["pool_blocks"] == 512
    for cap in (32, 128, 512, 1536):
        p = study.plan_batch(kv_tokens=8192, prompt_len=128, cap=cap, block_size=16, num_requests=1000)
        assert p["batch_size"] * p["blocks_per_seq"] <= p["pool_blocks"] < (p["batch_size"] + 1) * p["blocks_per_seq"]
    # a given batch that the budget cannot hold grows the pool; never above N
    p = study.plan_batch(kv_tokens=1024, prompt_len=128, cap=512, block_size=16, num_requests=128, batch_size=16)
    assert p["batch_size"] == 16 and p["pool_blocks"] == 16 * 40
    assert study.plan_batch(kv_tokens=10**6, prompt_len=8, cap=8, block_size=16, num_requests=5)["batch_size"] == 5
    with pytest.raises(ValueError, match="kv_tokens"):
        study.plan_batch(kv_tokens=0, prompt_len=8, cap=8, block_size=16, num_requests=5)


def test_bad_arguments_are_named(tiny):
    with pytest.raises(ValueError, match="unknown system"):
        study.run_study(tiny, num_requests=2, prompt_len=4, mean_output=2, caps=[2], systems=["nope"])
    with pytest.raises(ValueError, match="caps"):
        study.run_study(tiny, num_requests=2, prompt_len=4, mean_output=2, caps=[0])
    with pytest.raises(ValueError, match="unknown system"):
        study.run_worker({"system": "nope"})


# ----------------------------------------------------------------------------- HF naive static


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    if not HAVE_HF or SANITIZED:
        pytest.skip(f"the HF baseline (the 'peers' extra) cannot run: {HF_MISSING}")
    import torch

    from conveyor.bench import hf_static

    torch.set_num_threads(1)
    return hf_static.load_model(tiny, dtype="float32")


def _requests(n, lens, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 512, size=int(k)).tolist() for k in lens][:n]


@needs_hf
def test_padded_rows_give_the_tokens_of_unpadded_ones(hf_tiny):
    from conveyor.bench import hf_static

    prompts = _requests(4, [5, 13, 9, 2])
    outs = [6, 3, 9, 4]
    together = hf_static.run_static(hf_tiny, prompts, outs, batch_size=4, return_tokens=True)
    alone = hf_static.run_static(hf_tiny, prompts, outs, batch_size=1, return_tokens=True)
    assert together["batches"][0]["prompt_width"] == 13  # the short prompts were left-padded
    assert together["tokens"] == alone["tokens"]
    assert [len(t) for t in together["tokens"]] == outs


@needs_hf
def test_a_batch_runs_exactly_to_its_longest_member(hf_tiny):
    from conveyor.bench import hf_static

    prompts = _requests(5, [7, 7, 4, 7, 6])
    outs = [3, 11, 2, 5, 1]
    r = hf_static.run_static(hf_tiny, prompts, outs, batch_size=2, return_tokens=True)
    assert [b["requests"] for b in r["batches"]] == [2, 2, 1]
    assert [b["generated_width"] for b in r["batches"]] == [11, 5, 1]
    # one forward pass per generated column: the prompt's, then one per decode step
    assert [b["forwards"] for b in r["batches"]] == [11, 5, 1]
    assert r["steps"] == 17
    # only each request's own tokens count; the padding and the tokens a row computed
    # for its batch's longest member do not
    assert r["output_tokens"] == sum(outs) == 22 and r["own_tokens"] == outs
    assert r["computed_output_tokens"] == 2 * 11 + 2 * 5 + 1
    assert [len(t) for t in r["tokens"]] == outs
    # a request is done when its batch is: latencies rise batch by batch, equal within one
    e = r["e2e_s"]
    assert e[0] == e[1] < e[2] == e[3] < e[4]
    assert r["kv_bytes_peak"] > 0
    with pytest.raises(ValueError, match="output length"):
        hf_static.run_static(hf_tiny, prompts[:1], [0], batch_size=1)
    with pytest.raises(ValueError, match="output lengths"):
        hf_static.run_static(hf_tiny, prompts, outs[:2], batch_size=1)


@needs_hf
def test_conveyor_greedy_tokens_equal_hf_greedy_tokens(hf_tiny, tiny):
    from conveyor.bench import hf_static

    prompts = _requests(3, [9, 14, 5], seed=8)
    outs = [12, 7, 16]
    hf = hf_static.run_static(hf_tiny, prompts, outs, batch_size=3, return_tokens=True)
    wl = common.Workload([np.asarray(p, dtype=np.int32) for p in prompts], outs)
    llm = common.make_llm(tiny, workload=wl, num_threads=1)
    try:
        res = common.run_offline(llm, wl, temperature=0.0, sample_stats=False)
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in res["outputs"]] == hf["tokens"]


# ----------------------------------------------------------------------------- end to end


def _cli(*args, timeout=900):
    env = subprocess_env()
    if SANITIZED:
        # LeakSanitizer's stop-the-world at this CLI's exit failed now and then in CI
        # ("LeakSanitizer has encountered a fatal error": a fatal error, not a leak),
        # failing the exit code; the engines it runs are leak-checked in process by the
        # rest of the suite.
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=0"
    return subprocess.run([sys.executable, "-m", "conveyor", "bench", "study", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_study_quick_end_to_end(tmp_path):
    """--quick on the tiny model: every system on the same requests, a table to paste, JSON
    and the plot. Without torch/transformers (or under the sanitizers) the HF baseline is
    left out and the rest still runs."""
    systems = ["conveyor_static", "conveyor_continuous"]
    if HAVE_HF and not SANITIZED:
        systems.insert(0, "hf_static")
    out, png = tmp_path / "study.json", tmp_path / "study.png"
    p = _cli("--quick", "--caps", "4,32", "--num-threads", "1", "--systems", ",".join(systems),
             "--markdown", "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert r["threads"] == 1 and r["machine"]["cpu"] and "conveyor" in r["versions"]
    assert [row["cap"] for row in r["rows"]] == [4, 32]
    for row in r["rows"]:
        assert set(row["systems"]) == set(systems)
        wl = study.make_study_workload(vocab_size=512, num_requests=12, prompt_len=16, mean_output=8,
                                       cap=row["cap"], seed=0)
        assert row["workload_hash"] == study.workload_hash(wl.prompts, wl.output_lens)
        for name, res in row["systems"].items():
            assert res["workload_hash"] == row["workload_hash"], name
            assert res["output_tokens"] == sum(wl.output_lens)
            # one token per sequence per step: at least as many steps as the longest output
            assert res["steps"] >= max(wl.output_lens) and res["kv_bytes_peak"] > 0
            assert res["e2e"]["p50"] <= res["e2e"]["p99"]
        for name in ("conveyor_static", "conveyor_continuous"):
            res = row["systems"][name]
            # what the report says about the scheduler: recomputation, batch, KV use over time
            assert 0 <= res["recomputed_tokens"] <= res["computed_tokens"]
            assert res["computed_tokens"] >= sum(wl.output_lens) + 12 * 16
            assert 1 <= res["running_mean"] <= (row["batch_size"] if name == "conveyor_static" else 12)
            assert 1 <= len(res["kv_occupancy"]) <= 10 and all(0 <= x <= 1 for x in res["kv_occupancy"])
            assert max(res["kv_occupancy"]) > 0
        static = row["systems"]["conveyor_static"]
        assert static["batch_size"] == row["batch_size"]
        # both static systems run batch by batch to each batch's longest member
        if "hf_static" in row["systems"]:
            hf = row["systems"]["hf_static"]
            assert hf["batch_size"] == row["batch_size"]
            assert hf["ratio_to_naive"] == pytest.approx(1.0)
            lens = wl.output_lens
            bs = row["batch_size"]
            assert hf["steps"] == sum(max(lens[i:i + bs]) for i in range(0, len(lens), bs))
    # the Markdown table: a header and one line per (cap, system)
    md = [ln for ln in p.stdout.splitlines() if ln.startswith("|")]
    assert md[0].startswith("| cap | mean out | system |") and len(md) == 2 + 2 * len(systems)
    assert md[0].rstrip().endswith("| preempt | recomputed | mean running | KV use % |")
    assert "KV pool occupancy over time" in p.stdout
    if HAVE_HF and not SANITIZED:
        assert any("HF static (naive)" in ln and "| 1.00 |" in ln for ln in md)
    # re-rendering the saved result prints the same table
    p2 = subprocess.run([sys.executable, "-m", "conveyor", "bench", "study", "--from-json", str(out),
                         "--markdown", "--plot", ""], cwd=ROOT, capture_output=True, text=True,
                        env=subprocess_env())
    assert p2.returncode == 0, p2.stderr
    assert [ln for ln in p2.stdout.splitlines() if ln.startswith("|")] == md


def test_a_peer_installed_but_broken_is_skipped_with_its_error(tmp_path, monkeypatch):
    """A torch whose install was cut short (its shared libraries missing) is found by the
    import system but fails to load: the study names that error and leaves the HF
    baseline out, instead of failing after the other systems ran."""
    for name in ("torch", "transformers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            'raise OSError("libtorch_global_deps.so: cannot open shared object file")\n' if name == "torch" else "")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    why = study.system_available.__wrapped__("hf_static")
    assert why and "failing to import" in why and "libtorch_global_deps.so" in why
    assert study.system_available.__wrapped__("conveyor_static") is None


def test_bench_study_refuses_a_checkpoint_that_is_not_hf(tmp_path):
    p = _cli("--model", str(tmp_path), "--json", "", "--plot", "")
    assert p.returncode != 0 and "not a HF checkpoint" in p.stderr


@needs_hf
def test_bench_study_on_a_gguf_file(tmp_path):
    """A quantized GGUF: HF transformers runs its dequantized weights, Conveyor the quantized
    ones; same requests, same counts, one KV budget in the same dtype."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate", reason="transformers loads a GGUF model only with accelerate")
    from conveyor.testing import write_gguf_checkpoint

    model = write_gguf_checkpoint(tmp_path / "m" / "tiny.gguf", shape="tiny", ggml_type="Q8_0")
    out = tmp_path / "study.json"
    p = _cli("--quick", "--model", str(model), "--caps", "8", "--num-threads", "1", "--json", str(out),
             "--plot", "")
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads(out.read_text())["rows"]
    systems = row["systems"]
    assert set(systems) == {"hf_static", "conveyor_static", "conveyor_continuous"}
    assert len({s["output_tokens"] for s in systems.values()}) == 1
    assert len({s["workload_hash"] for s in systems.values()}) == 1
