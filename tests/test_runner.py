"""The CPU model runner (conveyor._testing.ModelRunner) held to the NumPy float64 reference.

A small driver below plays the block pool and the runner: each sequence gets KV blocks one
at a time from a shuffled free list (block 0 reserved, as in the engine), so block tables
are non-contiguous and sequences interleave in the cache; it computes the slot mappings and
block tables itself and calls ModelRunner.forward on the flat batch.

Tolerances (max|diff| / max|ref| over all rows compared, "of the logit scale"):
  * float32 weights, float32 KV vs the reference: 1e-4. The C forward computes in float32
    (rel. precision 6e-8); a few layers of sums over <= 176 terms stay far below 1e-5.
  * 16-bit weights vs the reference run on the same rounded weights: 1e-4, as above, since
    the kernels widen the weights and accumulate in float32 (nothing else is rounded).
  * 16-bit weights vs the float32 reference: bf16 5e-2, fp16 1e-2. RNE rounding moves each
    weight by at most 2^-9 (bf16) / 2^-12 (fp16) relative, i.e. about 0.2% / 0.02% rms; the
    errors of a layer's dot products add up like a random walk through the residual stream,
    measured here at ~1e-2 (bf16) and ~1e-3 (fp16) of the logit scale, so the bounds keep a
    margin of 3-10x while still failing on a wrong conversion (which gives O(1)).
  * 16-bit KV cache vs the float32 reference: bf16 5e-2, fp16 1e-2, by the same argument
    (keys/values rounded once after RoPE); the test also checks the 16-bit cache is really
    used (the logits differ from the float32-cache ones).
  * Different batchings of the same work (one pass, chunks, token by token, several
    sequences together): 1e-5, float32 summation-order noise only.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import conveyor
from conveyor._testing import ModelRunner
from conveyor.reference import ReferenceModel
from conveyor.testing import random_shape, round_to_dtype, write_hf_checkpoint, write_llama2c_checkpoint
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"


# ---------------------------------------------------------------------------- the driver


class PagedDriver:
    """Paged allocation over one ModelRunner's cache, done in Python."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        cfg = runner.config
        self.r = runner
        self.bs = cfg["block_size"]
        self.num_blocks = cfg["num_blocks"]
        self.rng = np.random.default_rng(seed)
        self.free = [int(b) for b in self.rng.permutation(np.arange(1, self.num_blocks))]
        self.blocks: dict = {}  # sid -> block ids in order
        self.lens: dict = {}    # sid -> tokens in the cache

    def release(self, sid) -> None:
        self.free.extend(self.blocks.pop(sid))
        self.lens.pop(sid)
        self.rng.shuffle(self.free)

    def batch(self, work, all_logits: bool = False) -> tuple[dict, list]:
        """The forward() arguments for work = [(sid, new_tokens), ...] (allocating blocks), and
        [(sid, n_rows)] telling whose logits rows come back in which order."""
        bs = self.bs
        toks, pos, slots, qs, ctx, rows, owners = [], [], [], [0], [], [], []
        for sid, new in work:
            bl = self.blocks.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            end = start + len(new)
            while len(bl) * bs < end:
                bl.append(self.free.pop())
            for j, t in enumerate(new):
                p = start + j
                toks.append(int(t))
                pos.append(p)
                slots.append(bl[p // bs] * bs + p % bs)
            self.lens[sid] = end
            ctx.append(end)
            qs.append(len(toks))
            rr = list(range(qs[-2], qs[-1])) if all_logits else ([qs[-1] - 1] if new else [])
            rows.extend(rr)
            owners.append((sid, len(rr)))
        # padding columns past each sequence's blocks: never read
        width = min(self.num_blocks, max(len(self.blocks[s]) for s, _ in work) + int(self.rng.integers(0, 3)))
        table = np.zeros((len(work), width), dtype=np.int32)
        for i, (sid, _) in enumerate(work):
            table[i, :len(self.blocks[sid])] = self.blocks[sid]
        args = dict(tokens=np.array(toks, dtype=np.int32), positions=np.array(pos, dtype=np.int64),
                    slot_mapping=np.array(slots, dtype=np.int64), query_start=np.array(qs, dtype=np.int32),
                    context_lens=np.array(ctx, dtype=np.int32), block_tables=table,
                    logits_rows=np.array(rows, dtype=np.int32))
        return args, owners

    def step(self, work, all_logits: bool = False) -> dict:
        """Runs one batch; {sid: float32 logits [rows][vocab]} (all new rows, or the last)."""
        args, owners = self.batch(work, all_logits)
        out = self.r.forward(**args)
        assert out.dtype == np.float32 and out.shape == (len(args["logits_rows"]), self.r.config["vocab_size"])
        res, k = {}, 0
        for sid, n in owners:
            res[sid] = out[k:k + n]
            k += n
        return res

    def prompt_in_chunks(self, sid, tokens, cuts) -> np.ndarray:
        """All logits rows of tokens fed in chunks ending at the given cut points."""
        outs, prev = [], 0
        for c in list(cuts) + [len(tokens)]:
            if c > prev:
                outs.append(self.step([(sid, tokens[prev:c])], all_logits=True)[sid])
                prev = c
        return np.concatenate(outs)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def make_runner(path, **kw) -> ModelRunner:
    kw.setdefault("max_tokens", 512)
    kw.setdefault("max_seqs", 256)  # room to ask for the logits of every prompt row
    kw.setdefault("num_threads", 2)
    return ModelRunner(path, **kw)


def random_prompt(rng, vocab, n) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


# ---------------------------------------------------------------------------- fp32 vs reference

# (id, format, shape overrides, arch, tie, rope_scaling, block_size, force_scalar)
_LLAMA3_SHORT = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 32}
GRID = [
    ("hf-mha-hd8-bs1", "hf", dict(n_heads=4, n_kv_heads=4, head_dim=8, dim=32), "llama", False, None, 1, False),
    ("hf-gqa4-hd16-bs3-tied", "hf", dict(n_heads=8, n_kv_heads=2, head_dim=16, dim=128), "llama", True, None, 3, True),
    ("hf-qwen2-gqa-hd32-bs16", "hf", dict(n_heads=6, n_kv_heads=2, head_dim=32, dim=64), "qwen2", True, None, 16, False),
    ("hf-llama3-hd64-bs32", "hf", dict(n_heads=2, n_kv_heads=1, head_dim=64, dim=96, rope_theta=500000.0),
     "llama", False, "llama3", 32, False),
    ("hf-mistral-hd128-bs5", "hf", dict(n_heads=2, n_kv_heads=1, head_dim=128, dim=64), "mistral", False, None, 5, True),
    ("hf-llama3short-qwen2-bs2", "hf", dict(n_heads=4, n_kv_heads=2, head_dim=16, dim=48), "qwen2", False,
     _LLAMA3_SHORT, 2, False),
    ("hf-hd128-mqa-bs8", "hf", dict(n_heads=4, n_kv_heads=1, head_dim=128, dim=96), "llama", True, None, 8, False),
    ("l2c-mha-tied-bs4", "llama2c", dict(n_heads=4, n_kv_heads=4, dim=64), None, True, None, 4, False),
    ("l2c-gqa-untied-bs7", "llama2c", dict(n_heads=6, n_kv_heads=2, dim=96), None, False, None, 7, True),
    ("l2c-hd8-bs32", "llama2c", dict(n_heads=4, n_kv_heads=2, dim=32), None, True, None, 32, False),
] + [
    (f"random-{seed}", "llama2c" if seed % 3 == 2 else "hf", None, ["llama", "qwen2", "mistral"][seed % 3],
     bool(seed % 2), "llama3" if seed == 4 else None, [1, 2, 4, 8, 16, 32][seed % 6], seed % 2 == 1)
    for seed in range(6)
]


def _write_case(tmp_path, seed, fmt, overrides, arch, tie, rope_scaling, dtype="float32"):
    rng = np.random.default_rng(1000 + seed)
    shape = random_shape(rng, llama2c=fmt == "llama2c")
    if overrides:
        shape.update(overrides)
        if fmt == "llama2c":
            shape.pop("head_dim", None)
    shape["max_pos"] = max(shape["max_pos"], 128)
    if fmt == "hf":
        path = write_hf_checkpoint(tmp_path / "m", shape=shape, arch=arch, dtype=dtype, seed=seed,
                                   tie_embeddings=tie, rope_scaling=rope_scaling, tokenizer=False)
    else:
        path = write_llama2c_checkpoint(tmp_path / "m.bin", shape=shape, seed=seed, tied=tie, tokenizer=False)
    return path, rng


@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_fp32_logits_match_reference(tmp_path, case):
    cid, fmt, overrides, arch, tie, rope_scaling, bs, scalar = case
    seed = GRID.index(case)
    path, rng = _write_case(tmp_path, seed, fmt, overrides, arch, tie, rope_scaling)
    ref = ReferenceModel.load(path)
    runner = make_runner(path, block_size=bs, num_blocks=max(8, 200 // bs + 4), force_scalar=scalar)
    cfg = runner.config
    rc = ref.config
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_pos"):
        assert cfg[key] == rc[key], key
    assert cfg["tie_embeddings"] == rc["tie_embeddings"] and cfg["qkv_bias"] == rc["qkv_bias"]
    assert cfg["rope_layout"] == rc["rope_layout"] and cfg["dtype"] == "float32"
    assert cfg["rope_llama3"] == (rope_scaling is not None)

    n = int(rng.integers(20, 70))
    toks = random_prompt(rng, cfg["vocab_size"], n + 3)
    want = ref.logits(toks)
    drv = PagedDriver(runner, seed)
    cut = int(rng.integers(1, n))
    got = drv.prompt_in_chunks(0, toks[:n], [cut])      # a prompt in two chunks
    for t in toks[n:]:                                  # then decode steps
        got = np.concatenate([got, drv.step([(0, [t])])[0]])
    err = rel_err(got, want)
    assert err < 1e-4, f"{cid}: max|diff| / max|ref| = {err:.3g}"


# ---------------------------------------------------------------------------- 16-bit weights and KV


def _rounded_reference(ref: ReferenceModel, dtype: str) -> ReferenceModel:
    """The reference on the weights as the loader stores them in dtype: matrices and the
    embedding table rounded, norms and biases kept in float32."""
    def rnd(a):
        return None if a is None else round_to_dtype(a, dtype).astype(np.float64)

    W = ref.weights
    head = W["embed"] if W["lm_head"] is None else W["lm_head"]
    layers = []
    for L in W["layers"]:
        L2 = dict(L)
        for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            L2[k] = rnd(L[k])
        layers.append(L2)
    weights = dict(embed=rnd(W["embed"]), final_norm=W["final_norm"], lm_head=rnd(head), layers=layers)
    return ReferenceModel(ref.config, weights)


LOOSE = {"bfloat16": 5e-2, "float16": 1e-2, "int8": 5e-2}


def same_weights_tol(dtype):
    """Bound vs a reference on the same (rounded) weights. On AVX512_BF16 the
    bf16 GEMMs run on vdpbf16ps, which rounds the activations to bf16 too
    (8 significant bits, 2^-8 relative per product): the loose bound applies."""
    paths = conveyor._core.kernel_info()["paths"]
    return LOOSE["bfloat16"] if dtype == "bfloat16" and paths["gemm_bf16"] == "avx512_bf16" else 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["hf", "llama2c"])
def test_16bit_weights(tmp_path, dtype, fmt):
    """fp32 file loaded as 16-bit: matches the reference on the rounded weights tightly,
    and the fp32 reference loosely."""
    path, rng = _write_case(tmp_path, 7, fmt, dict(n_heads=4, n_kv_heads=2, head_dim=16, dim=64),
                            "qwen2" if fmt == "hf" else None, fmt == "llama2c", None)
    ref = ReferenceModel.load(path)
    runner = make_runner(path, dtype=dtype, block_size=4, num_blocks=32)
    assert runner.config["dtype"] == dtype
    toks = random_prompt(rng, ref.vocab_size, 40)
    got = PagedDriver(runner).prompt_in_chunks(0, toks, [17])
    err_same = rel_err(got, _rounded_reference(ref, dtype).logits(toks))
    err_f32 = rel_err(got, ref.logits(toks))
    assert err_same < same_weights_tol(dtype), f"vs the reference on {dtype}-rounded weights: {err_same:.3g}"
    assert err_f32 < LOOSE[dtype], f"vs the float32 reference: {err_f32:.3g}"
    assert err_f32 > 1e-6  # the weights really were rounded


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_checkpoint_auto_dtype(tmp_path, dtype):
    """A 16-bit HF file with dtype="auto" runs in that dtype; the reference reads the very
    same values from the file, so the float32 bound applies."""
    path, rng = _write_case(tmp_path, 8, "hf", dict(n_heads=6, n_kv_heads=3, head_dim=16, dim=96), "llama",
                            False, None, dtype=dtype)
    runner = make_runner(path, block_size=8, num_blocks=16)
    assert runner.config["dtype"] == dtype
    ref = ReferenceModel.load(path)
    toks = random_prompt(rng, ref.vocab_size, 50)
    got = PagedDriver(runner).prompt_in_chunks(0, toks, [9, 30])
    assert rel_err(got, ref.logits(toks)) < same_weights_tol(dtype)


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "int8"])
def test_narrow_kv_cache(tmp_path, kv):
    path, rng = _write_case(tmp_path, 9, "hf", dict(n_heads=4, n_kv_heads=2, head_dim=32, dim=64), "llama",
                            False, None)
    ref = ReferenceModel.load(path)
    toks = random_prompt(rng, ref.vocab_size, 45)
    want = ref.logits(toks)
    outs = {}
    for kvd in ("float32", kv):
        runner = make_runner(path, kv_cache_dtype=kvd, block_size=4, num_blocks=32)
        assert runner.config["kv_cache_dtype"] == kvd
        drv = PagedDriver(runner, 3)
        rows = drv.prompt_in_chunks(0, toks[:30], [11])
        for t in toks[30:]:
            rows = np.concatenate([rows, drv.step([(0, [t])])[0]])
        outs[kvd] = rows
    assert rel_err(outs["float32"], want) < 1e-4
    err = rel_err(outs[kv], want)
    assert err < LOOSE[kv], f"{kv} KV cache: {err:.3g}"
    assert not np.array_equal(outs[kv], outs["float32"])  # the cache really is narrower


# ---------------------------------------------------------------------------- batching invariance


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("runner") / "m", tokenizer=False, seed=5, arch="qwen2",
                               shape=dict(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=1,
                                          head_dim=16, vocab_size=320, max_pos=256))
    return path


@pytest.mark.parametrize("bs", [1, 5, 16])
def test_one_pass_chunks_and_token_by_token_agree(gqa_model, bs):
    """160 tokens: long enough that single-token attention is split across threads."""
    rng = np.random.default_rng(bs)
    toks = random_prompt(rng, 320, 160)
    nb = 160 // bs + 8
    one = PagedDriver(make_runner(gqa_model, block_size=bs, num_blocks=nb, max_seqs=160), 1)
    full = one.step([(0, toks)], all_logits=True)[0]
    cuts = np.sort(rng.choice(np.arange(1, 160), size=6, replace=False))
    chunks = PagedDriver(make_runner(gqa_model, block_size=bs, num_blocks=nb, max_seqs=160), 2)
    chunked = chunks.prompt_in_chunks(0, toks, cuts)
    tbt = PagedDriver(make_runner(gqa_model, block_size=bs, num_blocks=nb), 3)
    steps = np.concatenate([tbt.step([(0, [t])])[0] for t in toks])
    assert rel_err(chunked, full) < 1e-5
    assert rel_err(steps, full) < 1e-5
    # and all of them match the reference
    assert rel_err(full, ReferenceModel.load(gqa_model).logits(toks)) < 1e-4


def test_batched_sequences_match_each_alone(gqa_model):
    """Four sequences under continuous batching (prefill chunks and decode steps of
    different sequences in one batch, blocks interleaved in the cache) give the logits each
    gives alone on a fresh runner."""
    rng = np.random.default_rng(11)
    lens = [37, 5, 64, 20]
    seqs = [random_prompt(rng, 320, n) for n in lens]
    alone = []
    for i, s in enumerate(seqs):
        d = PagedDriver(make_runner(gqa_model, block_size=4, num_blocks=24, max_seqs=64), 20 + i)
        alone.append(d.step([(i, s)], all_logits=True)[i])

    d = PagedDriver(make_runner(gqa_model, block_size=4, num_blocks=64, max_seqs=64), 7)
    done = [0] * len(seqs)
    got = [[] for _ in seqs]
    while any(done[i] < len(s) for i, s in enumerate(seqs)):
        work = []
        for i in rng.permutation(len(seqs)):
            if done[i] < len(seqs[i]):
                k = int(rng.integers(1, 12))
                work.append((int(i), seqs[i][done[i]:done[i] + k]))
                done[i] += len(work[-1][1])
        for i, rows in d.step(work, all_logits=True).items():
            got[i].append(rows)
    for i in range(len(seqs)):
        assert rel_err(np.concatenate(got[i]), alone[i]) < 1e-5, f"sequence {i}"
    # the blocks really were interleaved: no sequence owns a contiguous run
    assert any(np.any(np.diff(b) != 1) for b in d.blocks.values())


def test_freed_blocks_are_reused(gqa_model):
    """A sequence written into blocks another sequence used before gives its own logits."""
    rng = np.random.default_rng(3)
    a, b = random_prompt(rng, 320, 40), random_prompt(rng, 320, 40)
    d = PagedDriver(make_runner(gqa_model, block_size=8, num_blocks=6, max_seqs=64), 0)
    d.step([(0, a)])
    d.release(0)
    got = d.step([(1, b)], all_logits=True)[1]
    assert rel_err(got, ReferenceModel.load(gqa_model).logits(b)) < 1e-4


def test_reset_zeroes_the_cache(gqa_model):
    rng = np.random.default_rng(4)
    toks = random_prompt(rng, 320, 12)
    r = make_runner(gqa_model, block_size=4, num_blocks=8)
    d = PagedDriver(r, 0)
    d.step([(0, toks)])
    args, _ = d.batch([(0, [7])])
    before = r.forward(**args)
    again = r.forward(**args)  # rewriting the same slot is idempotent
    np.testing.assert_array_equal(before, again)
    r.reset()
    after = r.forward(**args)  # the prefix's keys/values are now zeros
    assert rel_err(after, before) > 1e-3


# ---------------------------------------------------------------------------- stories260K


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} not found")
def test_stories260k_greedy_matches_reference():
    ref = ReferenceModel.load(STORIES)
    prompt = [1, 403, 407, 261]
    n_new = 40
    want = ref.greedy(prompt, n_new)
    r = ModelRunner(STORIES, block_size=16, num_blocks=8, max_tokens=64, max_seqs=64, num_threads=2)
    assert r.config["vocab_size"] == 512 and r.config["rope_layout"] == "pairs"
    d = PagedDriver(r, 0)
    logits = d.step([(0, prompt)])[0][-1]
    got = []
    while True:
        tok = int(np.argmax(logits))
        got.append(tok)
        if len(got) == n_new:
            break
        logits = d.step([(0, [tok])])[0][-1]
    assert got == want
    # and the logits of the whole generated text agree with the reference
    seq = prompt + got
    full = PagedDriver(r, 1)
    r.reset()
    assert rel_err(full.step([(0, seq)], all_logits=True)[0], ref.logits(seq)) < 1e-4


# ---------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def small_runner(gqa_model):
    r = make_runner(gqa_model, block_size=4, num_blocks=8, max_tokens=32, max_seqs=4)
    yield r
    r.close()


def _good_args():
    """Two sequences: 3 new tokens after 2 cached ones (blocks 2, 5), and a 2-token prompt (block 3)."""
    return dict(tokens=np.array([10, 11, 12, 20, 21]), positions=np.array([2, 3, 4, 0, 1]),
                slot_mapping=np.array([10, 11, 20, 12, 13]), query_start=np.array([0, 3, 5]),
                context_lens=np.array([5, 2]), block_tables=np.array([[2, 5], [3, 0]]),
                logits_rows=np.array([2, 4]))


BAD = [
    ("token out of vocab", dict(tokens=[10, 11, 320, 20, 21])),
    ("negative token", dict(tokens=[10, 11, -1, 20, 21])),
    ("slot past the cache", dict(slot_mapping=[10, 11, 32, 12, 13])),
    ("negative slot", dict(slot_mapping=[10, -1, 20, 12, 13])),
    ("one slot twice", dict(slot_mapping=[10, 11, 20, 12, 11])),
    ("block id past the cache", dict(block_tables=[[2, 8], [3, 0]])),
    ("negative block id", dict(block_tables=[[-1, 5], [3, 0]])),
    ("position past max_pos", dict(positions=[2, 3, 256, 0, 1])),
    ("negative position", dict(positions=[2, 3, 4, -1, 1])),
    ("tokens longer than positions", dict(tokens=[10, 11, 12, 20, 21, 22])),
    ("slot_mapping too short", dict(slot_mapping=[10, 11, 20, 12])),
    ("query_start not ending at n", dict(query_start=[0, 3, 4])),
    ("query_start not starting at 0", dict(query_start=[1, 3, 5])),
    ("query_start decreasing", dict(query_start=[0, 6, 5])),
    ("context_lens wrong length", dict(context_lens=[5, 2, 1])),
    ("context shorter than new tokens", dict(context_lens=[2, 2])),
    ("context past the block table", dict(context_lens=[9, 2])),
    ("block_tables wrong rows", dict(block_tables=[[2, 5]])),
    ("block_tables 1-D", dict(block_tables=[2, 5])),
    ("block_tables wider than num_blocks", dict(block_tables=np.zeros((2, 9), dtype=np.int32))),
    ("logits row past the tokens", dict(logits_rows=[2, 5])),
    ("negative logits row", dict(logits_rows=[-1])),
    ("more logits rows than max_seqs", dict(logits_rows=[0, 1, 2, 3, 4])),
    ("more tokens than max_tokens", dict(tokens=np.zeros(33, dtype=np.int64), positions=np.arange(33),
                                         slot_mapping=np.arange(33), query_start=[0, 33], context_lens=[33],
                                         block_tables=np.arange(8).reshape(1, 8), logits_rows=[32])),
    ("empty query_start", dict(query_start=np.zeros(0, dtype=np.int64))),
    ("tokens 2-D", dict(tokens=[[10, 11, 12, 20, 21]])),
]


@pytest.mark.parametrize("change", [c[1] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_inputs_raise_value_error(small_runner, change):
    args = _good_args()
    args.update({k: np.asarray(v) for k, v in change.items()})
    with pytest.raises(ValueError):
        small_runner.forward(**args)
    # the runner is still fine afterwards
    out = small_runner.forward(**_good_args())
    assert out.shape == (2, 320) and np.isfinite(out).all()


def test_non_integer_arrays_raise_type_error(small_runner):
    args = _good_args()
    args["tokens"] = args["tokens"].astype(np.float64)
    with pytest.raises(TypeError):
        small_runner.forward(**args)
    args = _good_args()
    args["slot_mapping"] = np.array([2**63, 11, 20, 12, 13], dtype=np.uint64)  # no wrap-around
    with pytest.raises((TypeError, ValueError)):
        small_runner.forward(**args)


def test_empty_batch_and_lists(small_runner):
    e = np.zeros(0, dtype=np.int64)
    out = small_runner.forward(e, e, e, [0], e, np.zeros((0, 0), dtype=np.int32), e)
    assert out.shape == (0, 320)
    # plain lists of ints work like arrays
    lists = {k: v.tolist() for k, v in _good_args().items()}
    np.testing.assert_array_equal(small_runner.forward(**lists), small_runner.forward(**_good_args()))


def test_constructor_errors(gqa_model, tmp_path):
    with pytest.raises(FileNotFoundError):
        ModelRunner(tmp_path / "missing.bin")
    with pytest.raises(ValueError):
        ModelRunner(gqa_model, dtype="int8")
    with pytest.raises(ValueError):
        ModelRunner(gqa_model, kv_cache_dtype="auto")
    for kw in (dict(block_size=0), dict(num_blocks=0), dict(max_tokens=0), dict(max_seqs=0),
               dict(num_threads=-1), dict(block_size=1024, num_blocks=1 << 22)):
        with pytest.raises(ValueError):
            ModelRunner(gqa_model, **kw)


def test_close(gqa_model):
    r = make_runner(gqa_model, block_size=4, num_blocks=8, max_tokens=32, max_seqs=4)
    with r as same:
        assert same is r and not r.closed
        r.forward(**_good_args())
    assert r.closed
    r.close()  # idempotent
    with pytest.raises(conveyor.EngineClosedError):
        r.forward(**_good_args())
    with pytest.raises(conveyor.EngineClosedError):
        r.reset()


def test_forward_runs_in_threads(gqa_model):
    """Two runners in two threads (the GIL is released) give their single-thread results."""
    rng = np.random.default_rng(9)
    toks = [random_prompt(rng, 320, 60) for _ in range(2)]
    want = [PagedDriver(make_runner(gqa_model, block_size=4, num_blocks=20), 0).step([(0, t)])[0] for t in toks]
    got = [None, None]

    def work(i):
        d = PagedDriver(make_runner(gqa_model, block_size=4, num_blocks=20, num_threads=1), 0)
        got[i] = d.step([(0, toks[i])])[0]

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(2):
        assert rel_err(got[i], want[i]) < 1e-5
