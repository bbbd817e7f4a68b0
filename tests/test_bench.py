"""The end-to-end benchmarks (throughput, variance, latency, timeline) on tiny settings:
their JSON has the fields and sane values. No timing assertions."""
import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from conveyor.bench import common, latency, roofline, throughput, timeline, variance  # noqa: E402


@pytest.fixture(scope="module")
def model(stories_dir):
    return str(stories_dir / "stories260K.bin")


def _load(path):
    with open(path) as f:
        return json.load(f)


def _ordered(p):
    return p["p50"] <= p["p90"] <= p["p99"] and p["count"] > 0


# ------------------------------------------------------------------ common helpers


def test_capped_exponential_respects_cap_and_seed():
    a = common.capped_exponential(np.random.default_rng(1), 500, 64, 16)
    b = common.capped_exponential(np.random.default_rng(1), 500, 64, 16)
    assert a.shape == (500,) and a.dtype.kind == "i"
    assert a.min() >= 1 and a.max() <= 16
    assert np.array_equal(a, b)
    big = common.capped_exponential(np.random.default_rng(2), 4000, 64, 768)
    assert 50 < big.mean() < 80  # close to the uncapped mean when the cap is far out
    with pytest.raises(ValueError):
        common.capped_exponential(np.random.default_rng(0), 3, 10, 0)


def test_percentiles_match_numpy_linear():
    v = [5.0, 1.0, 3.0, 2.0, 10.0]
    p = common.percentiles(v)
    assert p["p50"] == pytest.approx(np.percentile(v, 50))
    assert p["p90"] == pytest.approx(np.percentile(v, 90))
    assert p["p99"] == pytest.approx(9.8)  # 5 + 0.96 * (10 - 5)
    assert p["mean"] == pytest.approx(4.2)
    assert common.percentiles([])["count"] == 0


def test_workload_is_deterministic():
    a = common.make_workload(n=5, vocab_size=100, prompt_len=7, mean_output=8, cap=8, seed=3)
    b = common.make_workload(n=5, vocab_size=100, prompt_len=7, mean_output=8, cap=8, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a.prompts, b.prompts))
    assert a.output_lens == b.output_lens
    assert all(len(p) == 7 and p.max() < 100 for p in a.prompts)
    assert all(1 <= n <= 8 for n in a.output_lens)
    assert all(p.ignore_eos and p.max_tokens == n for p, n in zip(a.params(), a.output_lens))


def test_poisson_arrivals_rate():
    t = common.poisson_arrivals(np.random.default_rng(0), 2000, 4.0)
    assert t[0] == 0.0 and all(x <= y for x, y in zip(t, t[1:]))
    assert 3.5 < (len(t) - 1) / t[-1] < 4.5


def test_slots_from_synthetic_trace():
    # 2 slots; r0 runs steps 0-3, r1 steps 0-0, r2 starts at 1 (takes r1's slot), r3 at 4
    trace = [(10, 0, 0, 0, 0, 5), (10, 0, 0, 1, 0, 5)]
    trace += [(10 + s, 0, 0, 0, 0, 1) for s in (1, 2, 3)]
    trace += [(11, 0, 0, 2, 0, 4), (12, 0, 0, 2, 0, 1), (14, 0, 0, 3, 0, 3)]
    tl = timeline.slots_from_trace(trace, 2)
    slot = {b["request"]: b["slot"] for b in tl["bars"]}
    assert slot == {0: 0, 1: 1, 2: 1, 3: 0}
    assert tl["n_steps"] == 5
    assert tl["grid"][1] == [1, 2, 2, -1, -1]
    assert tl["grid"][0] == [0, 0, 0, 0, 3]
    # step 3: slot 1 idle while r3 waits
    assert tl["idle_while_waiting"] == 1
    assert [b["prefill_steps"] for b in sorted(tl["bars"], key=lambda b: b["request"])] == [1, 1, 1, 1]


# ------------------------------------------------------------------ the benchmarks


def assert_png(path, min_side=200):
    """A real PNG image (signature and IHDR chunk) of a plausible plot size."""
    import struct

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert width >= min_side and height >= min_side, (width, height)


def assert_throughputs(t, n_requests, output_tokens):
    """The rates are the counts over the wall time (not just positive)."""
    assert t["wall_s"] > 0
    assert t["requests_per_s"] == pytest.approx(n_requests / t["wall_s"])
    assert t["output_tokens_per_s"] == pytest.approx(output_tokens / t["wall_s"])


def test_throughput_main(model, tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = throughput.main(["--model", model, "--num-requests", "6", "--input-len", "8",
                          "--output-len", "4", "--range-ratio", "0.5", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "requests/s" in text and "output tokens/s" in text and "total tokens/s" in text
    r = _load(out)
    t = r["throughput"]
    assert_throughputs(t, 6, r["output_tokens"])
    assert t["total_tokens_per_s"] > t["output_tokens_per_s"]
    assert r["output_tokens"] == r["workload"]["output_tokens"]
    assert 2 <= r["workload"]["output_len_min"] <= r["workload"]["output_len_max"] <= 6
    assert r["preemptions"] == 0
    assert 0.0 <= r["kv"]["waste_mean"] <= r["kv"]["waste_max"] < 1.0
    assert r["machine"]["simd"] and r["machine"]["usable_cores"] >= 1
    assert r["model"]["vocab_size"] == 512
    assert _ordered(r["latency"]["e2e"]) and _ordered(r["latency"]["ttft"])


def test_throughput_warm(model, tmp_path, capsys):
    """--warm times a second run on the same engine, of the same shape but other
    prompts: the counts are one run's, not both runs', the prefix cache served none of
    the timed prompts, and the output says the engine was warm."""
    out = tmp_path / "tp.json"
    rc = throughput.main(["--model", model, "--num-requests", "4", "--input-len", "40", "--output-len", "3",
                          "--warm", "--json", str(out)])  # 40 tokens: two whole blocks the cache could serve
    assert rc == 0
    assert "warm engine" in capsys.readouterr().out
    r = _load(out)
    assert r["knobs"]["warm"] is True
    assert r["output_tokens"] == r["workload"]["output_tokens"] == 12
    assert_throughputs(r["throughput"], 4, 12)
    assert r["steps"] >= 3 and r["preemptions"] == 0
    assert r["prefix_hits"] == 0
    assert "enable_prefix_caching" not in r["knobs"]  # the engine's default: on
    rc = throughput.main(["--model", model, "--num-requests", "2", "--input-len", "40", "--output-len", "2",
                          "--warm", "--no-enable-prefix-caching", "--json", str(out)])
    assert rc == 0
    r = _load(out)
    assert r["knobs"]["enable_prefix_caching"] is False and r["output_tokens"] == 4


def test_throughput_with_quantized_weights(model, tmp_path, capsys):
    """--quantization reaches the engine (the Q8_0 throughput figure is taken on this bench), and
    the output says which weights and KV cache ran."""
    out = tmp_path / "tp.json"
    rc = throughput.main(["--model", model, "--num-requests", "3", "--input-len", "6", "--output-len", "3",
                          "--quantization", "q8_0", "--kv-cache-dtype", "int8", "--json", str(out)])
    assert rc == 0
    assert "weights q8_0, KV int8" in capsys.readouterr().out
    r = _load(out)
    assert r["model"]["matrix_dtype"] == "q8_0" and r["knobs"]["quantization"] == "q8_0"
    assert r["output_tokens"] == 9
    with pytest.raises(SystemExit):
        throughput.main(["--model", model, "--quantization", "q3_x"])
    assert "--quantization" in capsys.readouterr().err


def test_throughput_static_via_cli(model, tmp_path, capsys):
    from conveyor.cli import main as cli_main

    out = tmp_path / "tp.json"
    rc = cli_main(["bench", "throughput", "--model", model, "--num-requests", "5", "--input-len", "6",
                   "--output-len", "3", "--scheduling", "static", "--max-num-seqs", "2",
                   "--json", str(out)])
    assert rc == 0
    r = _load(out)
    assert r["knobs"]["scheduling"] == "static"
    assert r["output_tokens"] == 15
    assert r["running_max"] <= 2


def test_variance_main(model, tmp_path, capsys):
    j, png = tmp_path / "v.json", tmp_path / "v.png"
    rc = variance.main(["--model", model, "--num-requests", "10", "--prompt-len", "16",
                        "--mean-output", "8", "--caps", "2,24", "--static-sizes", "4,2",
                        "--sweep", "3,64", "--json", str(j), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ratio" in text and "p50" in text
    r = _load(j)
    assert [row["cap"] for row in r["rows"]] == [2, 24]
    for row, study_bs in zip(r["rows"], (4, 2)):
        wl = row["workload"]
        assert wl["output_len_max"] <= row["cap"] and wl["output_len_min"] >= 1
        assert row["static_study"]["max_num_seqs"] == study_bs
        assert row["static_study"]["scheduling"] == "static"
        # the sweep holds the study size, 3, and 64 clipped to N = 10
        assert sorted(int(k) for k in row["static_sweep"]) == sorted({study_bs, 3, 10})
        runs = [row["continuous"], *row["static_sweep"].values()]
        for run in runs:  # identical requests on every system
            assert run["output_tokens"] == wl["output_tokens"]
            assert run["preemptions"] == 0
            assert _ordered(run["latency"]["e2e"])
        # the ratios are continuous throughput over each static run's
        c_tp = row["continuous"]["throughput"]["output_tokens_per_s"]
        assert row["ratio_vs_study"] == pytest.approx(c_tp / row["static_study"]["throughput"]["output_tokens_per_s"])
        # the best static size is taken below N; a batch of all N is reported apart
        assert row["static_best_batch_size"] < 10 and row["static_whole_batch_size"] == 10
        best = row["static_sweep"][str(row["static_best_batch_size"])]
        assert row["ratio_vs_best"] == pytest.approx(c_tp / best["throughput"]["output_tokens_per_s"])
        whole = row["static_sweep"][str(row["static_whole_batch_size"])]
        assert row["ratio_vs_whole"] == pytest.approx(c_tp / whole["throughput"]["output_tokens_per_s"])
        assert all(best["throughput"]["output_tokens_per_s"] >= x["throughput"]["output_tokens_per_s"]
                   for k, x in row["static_sweep"].items() if int(k) < 10)
        assert row["step_ratio_vs_study"] >= 1.0  # static never needs fewer steps here
        for run in row["static_sweep"].values():
            assert run["running_max"] <= run["max_num_seqs"]
        kv = row["continuous"]["kv"]
        assert 0.0 <= kv["waste_mean"] <= kv["waste_max"] < 1.0 and kv["block_size"] == 16
    assert_png(png)
    cm = r["cost_model"]
    assert cm["runs"] == 2 * 4 and [c["cap"] for c in cm["caps"]] == [2, 24]
    # a saved run re-renders
    png2 = tmp_path / "v2.png"
    assert variance.main(["--from-json", str(j), "--plot", str(png2)]) == 0
    assert "ratio" in capsys.readouterr().out
    assert_png(png2)


def test_latency_main(model, tmp_path, capsys):
    j, png = tmp_path / "l.json", tmp_path / "l.png"
    rc = latency.main(["--model", model, "--num-requests", "8", "--prompt-len", "16",
                       "--mean-output", "4", "--calib-requests", "4", "--static-batch-size", "3",
                       "--json", str(j), "--plot", str(png)])
    assert rc == 0
    r = _load(j)
    assert r["calibration"]["requests_per_s"] > 0
    assert len(r["rates"]) == 2 and 0 < r["rates"][0] < r["rates"][1]
    assert r["knobs"]["prompt_len_range"] == [8, 24]
    assert len(r["runs"]) == 4
    assert {(x["scheduling"], x["rate"]) for x in r["runs"]} == {
        (s, rate) for s in ("static", "continuous") for rate in r["rates"]}
    for run in r["runs"]:
        assert run["all_finished"]
        assert run["e2e"]["count"] == 8 and run["ttft"]["count"] == 8
        for m in ("ttft", "tpot", "e2e"):
            assert _ordered(run[m]) and run[m]["mean"] >= 0
        assert run["ttft"]["p50"] <= run["e2e"]["p50"]
        assert len(run["e2e_values"]) == 8
        assert run["throughput"]["output_tokens_per_s"] > 0
    assert_png(png)


def test_latency_explicit_rates(model):
    r = latency.run_study(model, num_requests=4, prompt_len=8, mean_output=3, rates=[50.0],
                          static_batch_size=2)
    assert r["calibration"] is None and r["rates"] == [50.0]
    assert [x["scheduling"] for x in r["runs"]] == ["static", "continuous"]
    assert all(x["e2e"]["count"] == 4 for x in r["runs"])


def test_timeline_static_idles_continuous_refills(model, tmp_path, capsys):
    j, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = timeline.main(["--model", model, "--json", str(j), "--plot", str(png)])
    assert rc == 0
    assert "slot 0" in capsys.readouterr().out
    r = _load(j)
    n_req = len(r["knobs"]["output_lens"])
    for sched in ("static", "continuous"):
        tl = r[sched]
        assert tl["n_slots"] == 4
        assert sorted(b["request"] for b in tl["bars"]) == list(range(n_req))
        assert tl["output_lens"] == r["knobs"]["output_lens"]
        # one sequence per slot at a time
        for slot in range(tl["n_slots"]):
            spans = sorted((b["start"], b["end"]) for b in tl["bars"] if b["slot"] == slot)
            assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    st, ct = r["static"], r["continuous"]
    # static: short sequences' slots idle while requests wait; continuous refills at once
    assert st["idle_while_waiting"] > 0
    assert ct["idle_while_waiting"] == 0
    assert ct["n_steps"] < st["n_steps"]
    # static admits a new batch only when the whole previous one has ended
    starts = sorted({b["start"] for b in st["bars"]})
    for s in starts[1:]:
        assert not any(b["start"] < s <= b["end"] for b in st["bars"])
    assert_png(png)


def test_variance_repeat_keeps_fastest(model):
    r = variance.run_study(model, num_requests=4, prompt_len=8, mean_output=4, caps=[8],
                           study_sizes=[2], sweep=(), repeat=2)
    row = r["rows"][0]
    assert sorted(row["static_sweep"]) == ["2"]
    for run in (row["continuous"], row["static_study"]):
        tps = run["repeats_output_tokens_per_s"]
        assert len(tps) == 2 and run["throughput"]["output_tokens_per_s"] == max(tps)
    assert r["knobs"]["repeat"] == 2


@pytest.mark.parametrize("cfg, act, kind", [
    ({"dtype": "q4_k", "matrix_dtype": "q4_k", "compute_dtype": "bfloat16"}, "auto", "int8_dot"),
    ({"dtype": "mixed", "matrix_dtype": "q6_k", "compute_dtype": "bfloat16"}, "auto", "int8_dot"),
    ({"dtype": "q8_0", "matrix_dtype": "q8_0", "compute_dtype": "float32"}, "auto", "int8_dot"),
    ({"dtype": "bfloat16", "compute_dtype": "bfloat16"}, "auto", "bf16_dot"),
    ({"dtype": "bfloat16", "compute_dtype": "bfloat16"}, "float32", "fp32_fma"),
    ({"dtype": "float32"}, "auto", "fp32_fma"),
])
def test_roofline_bound_instruction(cfg, act, kind):
    """Every quantized matrix type multiplies on the int8 dot products (a K-quant file's
    matrices included), float weights on their own instruction."""
    assert roofline.peak_kind_of(cfg, act) == kind


def test_roofline_main(model, tmp_path, capsys):
    """`conveyor bench roofline` (the performance targets are read from it): each fraction is its
    measured rate over the bound printed beside it, and the counts are the work it asked for."""
    out = tmp_path / "roof.json"
    rc = roofline.main(["--model", model, "--threads", "1", "--decode-tokens", "6", "--prefill-len", "24",
                        "--repeats", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for line in ("batch-1 decode:", "prefill (96 tokens):", "64 running:", "compute bound of the GEMMs:"):
        assert line in text
    r = _load(out)
    n_params = r["config"]["n_params"]
    d1, pf, d64, cb = r["decode_b1"], r["prefill"], r["decode_b64"], r["compute_bound"]
    assert r["read_gbs"] > 0 and cb["kind"] in r["peaks"] and cb["gflops"] == r["peaks"][cb["kind"]]["all_gops"]
    # batch 1: the bound is the bytes of a step at the measured read bandwidth
    assert d1["ms_per_token"] > 0
    assert d1["bound_ms"] == pytest.approx(d1["bytes_per_step"] / (r["read_gbs"] * 1e9) * 1e3)
    assert d1["fraction_of_bound"] == pytest.approx(d1["bound_ms"] / d1["ms_per_token"])
    assert d1["bytes_per_step"] >= roofline.streamed_bytes_per_step(r["config"])
    # the work counted: every layer matrix for each token computed, the LM head for each token
    # sampled, attention over the keys each query sees (4 flops a key, a head dim and a head)
    c = r["config"]
    q, kv = c["n_heads"] * c["head_dim"], c["n_kv_heads"] * c["head_dim"]
    layer = c["n_layers"] * c["dim"] * (q + 2 * kv + q + 3 * c["hidden_dim"])
    head = c["vocab_size"] * c["dim"]
    assert layer + head <= n_params

    def work(prompt, out, n):
        computed = prompt + out - 1
        keys = computed * (computed + 1) // 2
        return n * (2 * layer * computed + 2 * head * out + 4 * c["n_layers"] * q * keys)

    # prefill: 4 prompts of 24, one token sampled each
    assert pf["tokens"] == 4 * 24
    assert pf["gflops"] == pytest.approx(work(24, 1, 4) / 96 * pf["tokens_per_s"] * 1e-9)
    assert pf["fraction_of_compute_bound"] == pytest.approx(pf["gflops"] / cb["gflops"])
    # 64 running: 64 x 6 tokens out, in steps; the shares of the wall time are fractions
    assert d64["steps"] >= 6 and d64["output_tokens_per_s"] > 0
    assert d64["gflops"] == pytest.approx(work(16, 6, 64) / (64 * 6) * d64["output_tokens_per_s"] * 1e-9)
    for k in ("outside_kernels_share", "schedule_share", "build_share", "sample_share", "python_share"):
        assert 0.0 <= d64[k] < 1.0, k
    # each figure is the best of --repeats runs; the shares are that run's own
    assert r["repeats"] == 2
    with pytest.raises(SystemExit):
        roofline.main(["--model", model, "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err
