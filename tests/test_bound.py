"""`conveyor bench bound`: a workload's physical bound from the model's shapes, its weight
and KV dtypes and the machine's measured peak and bandwidth.

The arithmetic is checked against hand computations on a tiny shape, the ideal engine's
steps against a hand-worked example and an independent token-by-token simulation of the
study workload, the weight bytes against the engine's own count of what it stores, and the
command end to end on stories260K (no timing assertions)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

core = pytest.importorskip("conveyor._core")

from conveyor import LLM  # noqa: E402
from conveyor.bench import bound  # noqa: E402
from conveyor.bench.study import make_study_workload  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
SMOLLM2 = Path.home() / ".cache/conveyor/SmolLM2-135M-Instruct.Q4_1.gguf"

# 2 layers, dim 32, FFN 64, 2 query heads and 1 KV head of 16, vocab 32, Q8_0 matrices
TINY = dict(n_layers=2, dim=32, hidden_dim=64, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=32,
            dtype="q8_0", matrix_dtype="q8_0", compute_dtype="float32", embed_bytes=32 * 32 * 34 // 32)


def tiny_cost(**over):
    cfg = dict(TINY, **over)
    kv = 2 * cfg["n_layers"] * cfg["n_kv_heads"] * cfg["head_dim"] * 2  # K and V, bf16
    return bound.model_cost(cfg, kv)


# ----------------------------------------------------------------------------- arithmetic


def test_costs_of_a_tiny_shape_by_hand():
    c = tiny_cost()
    # per layer: q 32x32, k and v 16x32 each, o 32x32, gate and up 64x32 each, down 32x64
    per_layer = 1024 + 512 + 512 + 1024 + 2048 + 2048 + 2048
    assert c.layer_weights == 2 * per_layer == 18432
    assert c.lm_head_weights == 32 * 32
    # matrices at 34 bytes a block of 32, the LM head at the embedding's 1088 bytes, 5 norms of 32 floats
    assert c.weight_bytes == 18432 * 34 / 32 + 1088 + 5 * 32 * 4 == 21312
    assert c.kv_bytes_per_token == 128 == core.kv_bytes_per_token(2, 1, 16, "bfloat16")
    assert c.attn_flops_per_key == 4 * 2 * 2 * 16
    # a step of 3 tokens, 2 of them sampling, attending to 10 keys in all, reading 7 tokens of KV
    assert c.step_flops(3, 2, 10) == 2 * 18432 * 3 + 2 * 1024 * 2 + 256 * 10 == 117248
    assert c.step_bytes(7) == 21312 + 7 * 128


def test_a_matrix_whose_rows_do_not_split_into_blocks_stays_float():
    c = tiny_cost(hidden_dim=48)  # down is 32 x 48: not blocks of 32, so float32; the rest Q8_0
    quant = 2 * (1024 + 512 + 512 + 1024 + 2 * 48 * 32)
    assert c.weight_bytes == quant * 34 / 32 + 2 * 32 * 48 * 4 + 1088 + 5 * 32 * 4


def test_bound_of_steps_by_hand():
    c = tiny_cost()
    steps = [bound.Step(tokens=3, samples=2, attended=10, kv_tokens=7, running=2, attended_local=10, kv_local=7),
             bound.Step(tokens=1000, samples=1, attended=0, kv_tokens=0, running=1, attended_local=0, kv_local=0)]
    # peak 1 GOP/s, 1 GB/s: both steps cost their FLOPs (117248 ns against 22208 ns of bytes)
    b = bound.bound_seconds(steps, c, peak_gops=1.0, read_gbs=1.0)
    f0, f1 = 117248.0, 2 * 18432 * 1000 + 2 * 1024
    m0, m1 = 21312 + 896.0, 21312.0
    assert b["seconds"] == pytest.approx((max(f0, m0) + max(f1, m1)) * 1e-9, rel=1e-12)
    assert b["memory_bound_steps"] == 0
    b = bound.bound_seconds(steps, c, peak_gops=1e6, read_gbs=1.0)  # compute nearly free
    assert b["seconds"] == pytest.approx((m0 + m1) * 1e-9, rel=1e-3)
    assert b["memory_bound_steps"] == 2 and b["memory_bound_share"] == 1.0
    with pytest.raises(ValueError, match="bandwidth"):
        bound.bound_seconds(steps, c, peak_gops=1.0, read_gbs=0.0)


def test_unknown_weight_dtype_is_an_error():
    with pytest.raises(ValueError, match="unknown weight dtype 'q9_9'"):
        tiny_cost(matrix_dtype="q9_9", dtype="q9_9")


# ----------------------------------------------------------------------------- the ideal engine's steps


def test_steps_of_a_small_workload_by_hand():
    # 3 prompts of 4 tokens, outputs 1, 3 and 2 tokens, a budget of 8 tokens a step
    steps = bound.ideal_steps([4, 4, 4], [1, 3, 2], budget=8, max_seqs=256)
    assert steps == [
        # prompts 0 and 1 whole (0 leaves with its one token); keys 1+2+3+4 each
        bound.Step(tokens=8, samples=2, attended=20, kv_tokens=8, running=2, attended_local=20, kv_local=8),
        # 1 decodes (5 keys), prompt 2 whole
        bound.Step(tokens=5, samples=2, attended=5 + 10, kv_tokens=5 + 4, running=2, attended_local=15, kv_local=9),
        # 1 (6 keys) and 2 (5 keys) decode; both leave
        bound.Step(tokens=2, samples=2, attended=11, kv_tokens=11, running=2, attended_local=11, kv_local=11),
    ]
    # a window of 3 keys: the queries at positions 3, 4, 5 see 3 keys, not 4, 5, 6
    win = bound.ideal_steps([4, 4, 4], [1, 3, 2], budget=8, max_seqs=256, window=3)
    assert [(s.attended, s.kv_tokens) for s in win] == [(s.attended, s.kv_tokens) for s in steps]
    assert [(s.attended_local, s.kv_local) for s in win] == [(2 * (1 + 2 + 3 + 3), 8), (3 + 9, 3 + 4), (6, 6)]


def test_a_long_prompt_is_chunked_and_max_seqs_limits_admission():
    steps = bound.ideal_steps([10], [2], budget=4, max_seqs=1)
    assert [s.tokens for s in steps] == [4, 4, 2, 1]
    assert [s.samples for s in steps] == [0, 0, 1, 1]
    assert steps[1].attended == 4 * 4 + 4 * 5 // 2  # positions 4..7 attend to 5..8 keys
    steps = bound.ideal_steps([2, 2, 2], [3, 3, 3], budget=100, max_seqs=1)
    assert [s.running for s in steps] == [1] * 9  # one at a time: 1 prefill + 2 decodes each


def simulate(prompt_lens, output_lens, budget):
    """Token by token: the (sequence, position, samples) of every token computed each step,
    for requests all admitted at once (max_seqs above their number)."""
    n = len(prompt_lens)
    pos, made, out = [0] * n, [0] * n, []
    while any(made[i] < output_lens[i] for i in range(n)):
        step, left = [], budget
        for i in range(n):  # decodes first
            if pos[i] >= prompt_lens[i] and made[i] < output_lens[i] and left:
                step.append((i, pos[i], True))
                pos[i], made[i], left = pos[i] + 1, made[i] + 1, left - 1
        for i in range(n):
            while pos[i] < prompt_lens[i] and left:
                last = pos[i] == prompt_lens[i] - 1
                step.append((i, pos[i], last))
                pos[i], left = pos[i] + 1, left - 1
                made[i] += last
        out.append(step)
    return out


@pytest.mark.parametrize("budget,window", [(2048, None), (200, None), (37, None), (200, 30), (37, 7)])
def test_study_steps_match_a_token_by_token_simulation(budget, window):
    wl = make_study_workload(vocab_size=100, num_requests=12, prompt_len=24, mean_output=10, cap=40, seed=3)
    prompts = [24] * 12
    got = bound.ideal_steps(prompts, wl.output_lens, budget=budget, max_seqs=256, window=window)
    ref = simulate(prompts, wl.output_lens, budget)
    w = window or 10**9
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        seqs = {i for i, _, _ in r}
        first = {i: min(p for j, p, _ in r if j == i) for i in seqs}
        last = {i: max(p for j, p, _ in r if j == i) for i in seqs}
        assert g.tokens == len(r)
        assert g.samples == sum(s for _, _, s in r)
        assert g.attended == sum(p + 1 for _, p, _ in r)
        assert g.kv_tokens == sum(last[i] + 1 for i in seqs)
        assert g.attended_local == sum(min(p + 1, w) for _, p, _ in r)
        assert g.kv_local == sum(last[i] + 1 - max(0, first[i] - w + 1) for i in seqs)
        assert g.running == len(seqs)
    assert sum(s.samples for s in got) == sum(wl.output_lens)


def test_keys_seen_against_counting():
    for start in range(0, 12):
        for n in range(1, 9):
            for window in (None, 1, 3, 8, 30):
                w = window or 10**9
                attended = sum(min(p + 1, w) for p in range(start, start + n))
                read = len({k for p in range(start, start + n) for k in range(max(0, p - w + 1), p + 1)})
                assert bound.keys_seen(start, n, window) == (attended, read), (start, n, window)


def test_local_layers_read_only_their_window():
    c = tiny_cost()
    assert c.local_layers == 0
    w = tiny_cost(sliding_window=8, sliding_window_period=2)  # layer 0 local, layer 1 global
    assert w.local_layers == 1 and w.n_layers == 2
    assert w.step_bytes(100, 8) == 21312 + 128 * (100 + 8) / 2
    assert w.step_flops(1, 1, 100, 8) == c.step_flops(1, 1, (100 + 8) / 2)


def test_bad_workloads_are_errors():
    with pytest.raises(ValueError, match="output length"):
        bound.ideal_steps([4], [0], budget=8, max_seqs=1)
    with pytest.raises(ValueError, match="budget"):
        bound.ideal_steps([4], [1], budget=0, max_seqs=1)
    with pytest.raises(ValueError, match="2 prompt lengths against 1"):
        bound.ideal_steps([4, 4], [1], budget=8, max_seqs=1)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        bound.workload_specs(["nope"], 100)


# ----------------------------------------------------------------------------- monotonic


MACHINE = {"read_gbs": 30.0, "peaks": {k: {"all_gops": g, "instruction": "x"} for k, g in
                                       (("fp32_fma", 200.0), ("bf16_dot", 400.0), ("int8_dot", 800.0))}}


def tiny_bound(prompts=(16,) * 8, outputs=(16,) * 8, machine=MACHINE, kv_dtype="bfloat16", **over):
    cfg = dict(TINY, dim=64, hidden_dim=192, head_dim=32, vocab_size=1024, **over)
    cfg["embed_bytes"] = int(cfg["vocab_size"] * cfg["dim"] * bound.bytes_per_weight(cfg["matrix_dtype"]))
    kv = core.kv_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"], kv_dtype)
    return bound.workload_bound(cfg, kv, list(prompts), list(outputs), budget=64, max_seqs=256,
                                machine=machine)["seconds"]


def test_bound_is_monotonic():
    base = tiny_bound()
    assert tiny_bound(prompts=(16,) * 9, outputs=(16,) * 9) > base  # more requests
    assert tiny_bound(outputs=(32,) * 8) > base  # longer outputs
    assert tiny_bound(prompts=(64,) * 8) > base  # longer prompts
    slow = {"read_gbs": 10.0, "peaks": MACHINE["peaks"]}
    assert tiny_bound(machine=slow) > base  # less bandwidth
    weak = {"read_gbs": 30.0, "peaks": {k: dict(p, all_gops=p["all_gops"] / 4) for k, p in MACHINE["peaks"].items()}}
    assert tiny_bound(machine=weak) > base  # lower peaks
    assert tiny_bound(kv_dtype="int8") < base < tiny_bound(kv_dtype="float32")  # KV bytes
    # more bytes a weight cost more at batch 1 (every step reads the weights)
    dec = [tiny_bound(prompts=(16,), outputs=(64,), matrix_dtype=d, dtype=d) for d in ("q4_1", "q8_0")]
    assert dec[0] < dec[1]
    assert bound.STORED_BYTES_PER_WEIGHT["q4_1"] < bound.STORED_BYTES_PER_WEIGHT["q8_0"] < \
        bound.STORED_BYTES_PER_WEIGHT["bfloat16"] < bound.STORED_BYTES_PER_WEIGHT["float32"]


# ----------------------------------------------------------------------------- against the engine


def engine_weight_bytes(path, **kw):
    with LLM(str(path), kv_cache_memory="16MiB", num_threads=1, **kw) as llm:
        cfg = dict(llm.model_config)
    return bound.model_cost(cfg, 0).weight_bytes, cfg["weight_bytes"] - cfg["embed_bytes"]


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1"])
def test_weight_bytes_equal_what_the_engine_stores_quantized(quantization):
    from conveyor.models import random_checkpoint

    ours, engine = engine_weight_bytes(random_checkpoint(shape="tiny", dtype="float32"), quantization=quantization)
    assert ours == engine


def test_weight_bytes_of_float_models_near_what_the_engine_stores():
    ours, engine = engine_weight_bytes(STORIES)
    assert 0.9 * engine < ours <= engine  # the float panels pad odd sizes a little


GEMMA3 = Path.home() / ".cache/conveyor/gemma-3-270m-q4_k_m.gguf"


@pytest.mark.skipif(not GEMMA3.is_file(), reason="Gemma 3 270M GGUF not downloaded")
def test_gemma3_has_15_local_layers_of_512():
    cfg = dict(core.Checkpoint(str(GEMMA3)).config)
    assert (cfg["sliding_window"], cfg["sliding_window_period"]) == (512, 6)
    cfg.update(matrix_dtype="q8_0", embed_bytes=1, weight_bytes=1)
    assert bound.model_cost(cfg, 0).local_layers == 15  # every 6th of 18 attends to all


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="SmolLM2 Q4_1 GGUF not downloaded")
def test_weight_bytes_of_smollm2_equal_what_the_engine_stores():
    ours, engine = engine_weight_bytes(SMOLLM2)
    assert ours == engine


# ----------------------------------------------------------------------------- the command


def test_bench_bound_command_on_stories(capsys):
    rc = bound.main(["--model", str(STORIES), "--measure", "--num-requests", "6", "--prompt-len", "8",
                     "--mean-output", "6", "--cap", "16", "--decode-tokens", "8", "--running", "4",
                     "--running-tokens", "4", "--prefill-len", "32", "--num-prefill", "2", "--num-threads", "1"])
    assert rc in (0, None)
    out = capsys.readouterr().out
    for name in bound.WORKLOADS:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        frac = float(re.search(r"-> ([0-9.]+) of the bound", line).group(1))
        assert frac > 0
    assert "read bandwidth" in out and "float32 matrices" in out


def test_bench_bound_repeats_keeps_the_best_run(tmp_path, capsys):
    """--repeats N times each workload N times and compares the fastest with the bound
    (the bandwidth is the best of its measurements too); every time is printed and saved."""
    out_json = tmp_path / "bound.json"
    bound.main(["--model", str(STORIES), "--workload", "decode", "--decode-tokens", "8", "--measure",
                "--repeats", "3", "--num-threads", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())["rows"]
    assert len(row["walls_s"]) == 3 and row["wall_s"] == min(row["walls_s"])
    assert row["fraction_of_bound"] == pytest.approx(row["bound"]["seconds"] / min(row["walls_s"]))
    assert "best of 3 runs:" in out
    # each run against the bandwidth measured around it, the median printed
    assert len(row["run_read_gbs"]) == 3 and len(row["run_fractions"]) == 3
    assert row["paired_fraction_of_bound"] == pytest.approx(sorted(row["run_fractions"])[1])
    assert "each run against the read bandwidth measured around it" in out
    with pytest.raises(SystemExit):
        bound.main(["--model", str(STORIES), "--workload", "decode", "--measure", "--repeats", "0"])
    assert "argument --repeats: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        bound.run(str(STORIES), [], repeats=0)


def test_each_run_is_set_against_the_bandwidth_around_it(monkeypatch):
    """The read bandwidth of this VM moves with its neighbours' load: with repeats, each run
    is compared with the bound at the mean of the bandwidths measured just before and
    just after it (here 10 and 30 GB/s around every run: its bound at 20 GB/s)."""
    readings = iter([25.0, 10.0, 30.0, 10.0, 30.0, 25.0])  # the machine's, run 1, run 2, the machine's again
    monkeypatch.setattr(bound, "measure_read_bw", lambda threads=0: next(readings))
    specs = bound.workload_specs(["decode"], 512, decode_tokens=4)
    r = bound.run(str(STORIES), specs, measure=True, threads=1, repeats=2)
    (row,) = r["rows"]
    assert row["run_read_gbs"] == [20.0, 20.0] and r["measured"]["read_gbs"] == 25.0
    with LLM(str(STORIES), num_threads=1) as llm:
        at20 = bound.engine_bound(llm, str(STORIES), specs[0].prompt_lens, specs[0].output_lens,
                                  {**r["measured"], "read_gbs": 20.0}, max_seqs=256)
    assert row["run_fractions"] == pytest.approx([at20["seconds"] / w for w in row["walls_s"]])
    assert row["paired_fraction_of_bound"] == pytest.approx(sum(row["run_fractions"]) / 2)


def test_bench_bound_without_measure_prints_no_ratio(capsys):
    bound.main(["--model", str(STORIES), "--workload", "decode", "--decode-tokens", "4"])
    out = capsys.readouterr().out
    assert "decode (batch 1, prompt 32, 4 out): bound" in out and "of the bound" not in out


def test_bench_bound_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        bound.main(["--model", str(STORIES), "--workload", "nope"])
    assert e.value.code == 2 and "unknown workload 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bound.main(["--model", str(STORIES), "--cap", "0"])
    assert "argument --cap: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bound.main(["--model", str(STORIES), "--workload", ","])
    assert "--workload names no workload" in capsys.readouterr().err


def test_conveyor_bench_bound_runs_from_the_cli(capsys):
    from conveyor.cli import bench_main

    rc = bench_main(["bound", "--model", str(STORIES), "--workload", "prefill", "--prefill-len", "16"])
    assert rc in (0, None)
    assert "prefill (4 x prompt 16, 1 out): bound" in capsys.readouterr().out


def test_throughput_and_study_print_the_fraction_of_the_bound(capsys):
    from conveyor.bench import study, throughput

    throughput.main(["--model", str(STORIES), "--num-requests", "4", "--input-len", "8", "--output-len", "8",
                     "--num-threads", "1", "--bound"])
    out = capsys.readouterr().out
    assert re.search(r"this workload: bound .* -> [0-9.]+ of the bound", out)
    study.main(["--quick", "--systems", "conveyor_continuous", "--caps", "4,8", "--num-threads", "1", "--bound"])
    out = capsys.readouterr().out
    for cap in (4, 8):
        assert f"cap {cap}: bound" in out
    assert len(re.findall(r"conveyor_continuous +measured .* -> [0-9.]+ of the bound", out)) == 2
