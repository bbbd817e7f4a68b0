"""The CUDA backend held to the CPU backend's plain kernels.

Everything but the availability tests is skipped unless conveyor._testing.cuda_available().
Without a GPU the same tests can run on the CPU emulator of the CUDA kernels
(kernels/cuda/cuda_emu.h), slowly and on smaller grids:

    python -c "import sys; sys.path.insert(0, 'build_support'); import cuda_build; \
               cuda_build.build_emulated_library('/tmp/emu.so', '/tmp/emu')"
    CONVEYOR_CUDA_LIB=/tmp/emu.so PYTHONPATH=... pytest tests/test_cuda.py
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import conveyor
from conveyor import _testing
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"


def _available() -> bool:
    return hasattr(_testing, "cuda_available") and _testing.cuda_available()


AVAILABLE = _available()
EMULATED = AVAILABLE and _testing.cuda_info()["device"].startswith("CPU emulator")
needs_cuda = pytest.mark.skipif(not AVAILABLE, reason="no CUDA device (conveyor._testing.cuda_available() is False)")
# Long end-to-end runs are pointless (and very slow) on the CPU emulator.
needs_gpu = pytest.mark.skipif(not AVAILABLE or EMULATED, reason="needs a real CUDA device")


def check(got, want, tol, what):
    """Asserts ||got - want|| / ||want|| <= tol, naming the worst element."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.size == 0:
        return
    diff = np.abs(got - want)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output at {np.argwhere(~np.isfinite(got))[:3].tolist()}"
    norm = np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30)
    i = np.unravel_index(np.argmax(diff), diff.shape)
    assert norm <= tol, (f"{what}: normalized error {norm:.3g} > {tol:g}; worst at {tuple(int(v) for v in i)}: "
                         f"cuda {got[i]!r} cpu {want[i]!r}")


def bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(a):
    return (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


def round_to(a, dtype):
    if dtype == "float32":
        return np.asarray(a, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)
    return bf16_round(a)


# ----------------------------------------------------------------- availability (always run)


def test_availability_is_a_clean_bool():
    assert hasattr(_testing, "cuda_available"), "conveyor._testing has no cuda_available()"
    avail = _testing.cuda_available()
    assert isinstance(avail, bool)
    assert _testing.cuda_available() is avail  # cached, stable
    if avail:
        _testing.cuda_check()
        info = _testing.cuda_info()
        assert info["total_bytes"] > 0 and info["device"]
    else:
        with pytest.raises(conveyor.UnsupportedError, match="CUDA"):
            _testing.cuda_check()


def test_missing_library_gives_a_clear_error():
    code = ("from conveyor import _testing\n"
            "assert _testing.cuda_available() is False\n"
            "try:\n"
            "    _testing.cuda_check()\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    env = dict(os.environ, CONVEYOR_CUDA_LIB="/nonexistent/_conveyor_cuda.so")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("UnsupportedError"), r.stdout
    assert "no CUDA backend" in r.stdout


@pytest.mark.skipif(AVAILABLE, reason="a CUDA device is present")
def test_llm_on_cuda_without_a_device_raises():
    if not hasattr(conveyor, "LLM") or not STORIES.is_file():
        pytest.skip("conveyor.LLM or stories260K not available")
    with pytest.raises(conveyor.ConveyorError, match="(?i)cuda"):
        conveyor.LLM(str(STORIES), device="cuda")


# ----------------------------------------------------------------- element-wise kernels


@needs_cuda
@pytest.mark.parametrize("n,dim", [(1, 1), (3, 64), (17, 300), (5, 2048), (2, 4099)])
def test_rmsnorm(n, dim):
    rng = np.random.default_rng(n * 1000 + dim)
    x = (rng.standard_normal((n, dim)) * 3).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    for eps in (1e-5, 1e-6):
        check(_testing.cuda_kernel_rmsnorm(x, w, eps), _testing.kernel_rmsnorm(x, w, eps, impl="plain"), 1e-6,
              f"rmsnorm n={n} dim={dim} eps={eps}")


@needs_cuda
@pytest.mark.parametrize("n,dim", [(1, 1), (5, 172), (33, 1000)])
def test_swiglu(n, dim):
    rng = np.random.default_rng(dim)
    gu = (rng.standard_normal((n, 2 * dim)) * 4).astype(np.float32)
    check(_testing.cuda_kernel_swiglu(gu), _testing.kernel_swiglu(gu, impl="plain"), 1e-6, f"swiglu n={n} dim={dim}")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows,cols,n", [(1, 1, 1), (512, 64, 9), (100, 257, 40)])
def test_embedding(dtype, rows, cols, n):
    rng = np.random.default_rng(rows + cols)
    table = rng.standard_normal((rows, cols)).astype(np.float32)
    tokens = rng.integers(0, rows, n).astype(np.int32)
    got = _testing.cuda_kernel_embedding(table, tokens, dtype)
    check(got, _testing.kernel_embedding(table, tokens, dtype, impl="plain"), 0, f"embedding {dtype}")
    check(got, round_to(table, dtype)[tokens], 0, f"embedding {dtype} vs numpy")


@needs_cuda
def test_embedding_bad_token_is_an_error_not_a_crash():
    table = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="(?i)embedding"):
        _testing.cuda_kernel_embedding(table, np.array([0, 7], np.int32), validate=False)
    # the backend recovers: the next call works
    check(_testing.cuda_kernel_embedding(table, np.array([3], np.int32)), table[[3]], 0, "embedding after an error")


@needs_cuda
@pytest.mark.parametrize("layout", ["halves", "pairs"])
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(8, 8, 4), (64, 4, 2), (128, 8, 1), (80, 3, 3)])
def test_rope(layout, head_dim, n_heads, n_kv):
    rng = np.random.default_rng(head_dim + n_heads)
    n = 11
    pos = np.concatenate([np.arange(5), rng.integers(0, 40000, n - 5)]).astype(np.int32)
    inv_freq = (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    q = rng.standard_normal((n, n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, head_dim)).astype(np.float32)
    q1, k1, q2, k2 = q.copy(), k.copy(), q.copy(), k.copy()
    _testing.cuda_kernel_rope(q1, k1, pos, inv_freq, layout)
    _testing.kernel_rope(q2, k2, pos, inv_freq, layout, impl="plain")
    check(q1, q2, 2e-6, f"rope q {layout} hd={head_dim}")
    check(k1, k2, 2e-6, f"rope k {layout} hd={head_dim}")
    q3 = q.copy()
    _testing.cuda_kernel_rope(q3, None, pos, inv_freq, layout, host_freq=True)  # host inv_freq, no k
    check(q3, q2, 2e-6, f"rope q (host inv_freq) {layout}")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n,rows,cols", [(1, 1, 1), (1, 300, 64), (7, 64, 172), (40, 129, 257), (3, 512, 2048)])
def test_gemm(dtype, n, rows, cols):
    rng = np.random.default_rng(n * 7 + rows + cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    acc = rng.standard_normal((n, rows)).astype(np.float32)
    for b, a in [(None, None), (bias, None), (None, acc), (bias, acc)]:
        got = _testing.cuda_kernel_gemm(x, w, dtype, b, a)
        # The 16-bit path rounds the activations to the weights' type; the
        # reference rounds the same way, in float64.
        ref = round_to(x, dtype).astype(np.float64) @ round_to(w, dtype).astype(np.float64).T
        if b is not None:
            ref += b
        if a is not None:
            ref += a
        check(got, ref, 1e-5, f"gemm {dtype} n={n} rows={rows} cols={cols} bias={b is not None} acc={a is not None}")
        cpu = _testing.kernel_gemm(x, w, dtype, b, a, impl="plain")
        check(got, cpu, 1e-5 if dtype == "float32" else 1e-2, f"gemm {dtype} vs cpu")


@needs_cuda
def test_gemm_matrix_reuse_and_timing():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    mat = _testing.cuda_kernel_matrix(w, "bfloat16")
    for n in (1, 5):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        ref = bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64).T
        check(_testing.cuda_kernel_matmul(mat, x), ref, 1e-5, f"matmul n={n}")
    assert _testing.cuda_kernel_matmul_time(mat, x, repeats=2) > 0


# ----------------------------------------------------------------- KV cache


def _cache(rng, num_blocks, n_kv, bs, hd, dtype):
    k = rng.standard_normal((num_blocks, n_kv, bs, hd)).astype(np.float32)
    v = rng.standard_normal((num_blocks, n_kv, bs, hd)).astype(np.float32)
    if dtype == "float32":
        return k, v
    if dtype == "float16":
        return k.astype(np.float16), v.astype(np.float16)
    return bf16_bits(k).reshape(k.shape), bf16_bits(v).reshape(v.shape)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_kv,bs,hd", [(1, 1, 8), (4, 16, 64), (2, 8, 80), (3, 32, 7)])
def test_kv_write(dtype, n_kv, bs, hd):
    rng = np.random.default_rng(bs * hd + n_kv)
    n = 13
    num_blocks = max(6, -(-2 * n // bs))
    kc, vc = _cache(rng, num_blocks, n_kv, bs, hd, dtype)
    # strided rows, as views into a fused qkv buffer
    qkv = rng.standard_normal((n, 3, n_kv, hd)).astype(np.float32)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = rng.permutation(num_blocks * bs)[:n].astype(np.int64)
    slots[::4] = -1  # padding tokens are skipped
    kc1, vc1, kc2, vc2 = kc.copy(), vc.copy(), kc.copy(), vc.copy()
    _testing.cuda_kernel_kv_write(kc1, vc1, k, v, slots, dtype)
    _testing.kernel_kv_write(kc2, vc2, k, v, slots, dtype, impl="plain")
    assert np.array_equal(kc1.view(np.uint8), kc2.view(np.uint8)), f"k cache differs ({dtype})"
    assert np.array_equal(vc1.view(np.uint8), vc2.view(np.uint8)), f"v cache differs ({dtype})"


@needs_cuda
def test_kv_write_bad_slot_is_an_error_not_a_crash():
    rng = np.random.default_rng(0)
    kc, vc = _cache(rng, 2, 1, 4, 8, "float32")
    k = rng.standard_normal((2, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="(?i)slot"):
        _testing.cuda_kernel_kv_write(kc.copy(), vc.copy(), k, k, np.array([0, 99], np.int64), validate=False)


# ----------------------------------------------------------------- paged attention


def _attention_case(rng, *, n_heads, n_kv, hd, bs, dtype, new_tokens, contexts, spare_blocks=3):
    """A batch over a paged cache with shuffled block tables: sequence s has
    new_tokens[s] query rows and contexts[s] tokens of context."""
    mb = max(-(-c // bs) for c in contexts)
    num_blocks = sum(-(-c // bs) for c in contexts) + spare_blocks
    kc, vc = _cache(rng, num_blocks, n_kv, bs, hd, dtype)
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(contexts), mb), -1, np.int32)
    at = 0
    for s, c in enumerate(contexts):
        used = -(-c // bs)
        tables[s, :used] = ids[at:at + used]
        at += used
    qs = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]), n_heads, hd)).astype(np.float32)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables,
                context_lens=np.array(contexts, np.int32), query_start=qs)


def _run_attention(case, dtype, what, tol=2e-5):
    cdt = "bfloat16" if dtype == "bfloat16" else None
    got = _testing.cuda_kernel_paged_attention(**case, cache_dtype=cdt)
    want = _testing.kernel_paged_attention(**case, cache_dtype=cdt, impl="plain")
    check(got, want, tol, what)
    return got


# (n_heads, n_kv): MHA, GQA 2/4/7/8/12, MQA 16 (g > 8: several decode blocks per KV head)
HEADS = [(4, 4), (8, 4), (8, 2), (14, 2), (32, 4), (24, 2), (16, 1)]
HEAD_DIMS = [64, 80, 96, 128, 256, 40, 72]


def _grid():
    """(heads, head_dim, block_size) cases: every head layout with every head_dim at block
    size 16 on a GPU, plus other block sizes; a sample on the (slow) emulator."""
    if EMULATED:
        return [((8, 4), 64, 16), ((32, 4), 128, 16), ((16, 1), 80, 8), ((4, 4), 256, 32),
                ((8, 2), 40, 16), ((8, 4), 72, 1), ((24, 2), 96, 64), ((14, 2), 64, 16)]
    grid = [(h, hd, 16) for h in HEADS for hd in HEAD_DIMS]
    return grid + [((8, 2), 64, 1), ((32, 4), 128, 32), ((16, 1), 80, 1), ((4, 4), 256, 32),
                   ((14, 2), 64, 8), ((24, 2), 96, 64)]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads,hd,bs", _grid())
def test_paged_attention_decode(dtype, heads, hd, bs):
    n_heads, n_kv = heads
    rng = np.random.default_rng(hd * 31 + bs + n_heads)
    contexts = [1, 2, 17, 255, 256, 257, 700] if EMULATED else [1, 2, 17, 255, 256, 257, 700, 1500, 4100]
    case = _attention_case(rng, n_heads=n_heads, n_kv=n_kv, hd=hd, bs=bs, dtype=dtype,
                           new_tokens=[1] * len(contexts), contexts=contexts)
    _run_attention(case, dtype, f"decode {dtype} heads={heads} hd={hd} bs={bs}")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads,hd,bs", _grid())
def test_paged_attention_prefill_and_mixed(dtype, heads, hd, bs):
    n_heads, n_kv = heads
    rng = np.random.default_rng(hd * 17 + bs + n_heads)
    # whole prompts, chunks over a cached prefix, and decode rows in one batch
    new = [5, 1, 33, 2, 40, 1] if EMULATED else [5, 1, 33, 2, 160, 1, 64, 100]
    ctx = [5, 9, 33, 70, 47, 300] if EMULATED else [5, 9, 33, 70, 400, 300, 64, 600]
    case = _attention_case(rng, n_heads=n_heads, n_kv=n_kv, hd=hd, bs=bs, dtype=dtype,
                           new_tokens=new, contexts=ctx)
    _run_attention(case, dtype, f"prefill/mixed {dtype} heads={heads} hd={hd} bs={bs}")


@needs_cuda
def test_paged_attention_chunking_invariance():
    """A prompt's rows do not depend on how the prompt is split into chunks."""
    rng = np.random.default_rng(7)
    n_heads, n_kv, hd, bs, T = 8, 2, 64, 16, 70
    case = _attention_case(rng, n_heads=n_heads, n_kv=n_kv, hd=hd, bs=bs, dtype="float32",
                           new_tokens=[T], contexts=[T])
    whole = _testing.cuda_kernel_paged_attention(**case)
    for cut in (2, 31, 32, 33, 68):
        part = dict(case, q=case["q"][cut:], context_lens=np.array([T], np.int32),
                    query_start=np.array([0, T - cut], np.int32))
        tail = _testing.cuda_kernel_paged_attention(**part)
        if T - cut >= 2:
            assert np.array_equal(tail, whole[cut:]), f"chunk from {cut} differs from the whole prompt"


@needs_cuda
def test_paged_attention_empty_sequences_and_no_rows():
    rng = np.random.default_rng(11)
    case = _attention_case(rng, n_heads=4, n_kv=2, hd=64, bs=16, dtype="float16",
                           new_tokens=[0, 3, 0, 1], contexts=[20, 3, 40, 41])
    _run_attention(case, "float16", "sequences with no new tokens")


@needs_cuda
def test_paged_attention_bad_block_is_an_error_not_a_crash():
    rng = np.random.default_rng(5)
    case = _attention_case(rng, n_heads=4, n_kv=2, hd=64, bs=16, dtype="float32",
                           new_tokens=[1, 4], contexts=[40, 30])
    case["block_tables"][0, 1] = 10_000
    with pytest.raises(ValueError, match="(?i)block"):
        _testing.cuda_kernel_paged_attention(**case, validate=False)
    case["block_tables"][0, 1] = 0
    _run_attention(case, "float32", "attention after an error")  # the backend recovers


@needs_cuda
def test_paged_attention_context_hint_too_small_is_reported():
    rng = np.random.default_rng(6)
    case = _attention_case(rng, n_heads=4, n_kv=2, hd=64, bs=16, dtype="float32",
                           new_tokens=[1], contexts=[600])
    with pytest.raises(ValueError, match="max_context_len"):
        _testing.cuda_kernel_paged_attention(**case, max_context_len=100)


@needs_cuda
def test_unsupported_head_dim_is_an_error():
    rng = np.random.default_rng(8)
    case = _attention_case(rng, n_heads=2, n_kv=1, hd=264, bs=4, dtype="float32",
                           new_tokens=[1], contexts=[5])
    with pytest.raises(conveyor.UnsupportedError, match="head_dim"):
        _testing.cuda_kernel_paged_attention(**case)


@needs_cuda
def test_memcpy_bandwidth_is_measured():
    assert _testing.cuda_memcpy_bandwidth(1 << 20, 2) > 0


# ----------------------------------------------------------------- end to end (needs the engine)

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a bird"]


def _llm(**kw):
    if not hasattr(conveyor, "LLM"):
        pytest.skip("conveyor.LLM is not available yet")
    if not STORIES.is_file():
        pytest.skip("stories260K not found")
    return conveyor.LLM(str(STORIES), **kw)


def _greedy(llm, prompts, max_tokens=48):
    params = conveyor.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_cuda
def test_greedy_text_matches_the_cpu():
    n = 12 if EMULATED else 48
    with _llm(device="cpu") as cpu:
        want = _greedy(cpu, PROMPTS, n)
    with _llm(device="cuda") as gpu:
        got = _greedy(gpu, PROMPTS, n)
    for p, g, w in zip(PROMPTS, got, want):
        assert g == w, f"prompt {p!r}: cuda {g} != cpu {w}"


@needs_gpu
def test_batch_invariance_alone_vs_batch_of_64():
    with _llm(device="cuda") as gpu:
        alone = _greedy(gpu, PROMPTS, 48)
        rng = np.random.default_rng(0)
        words = rng.choice(["cat", "sun", "tree", "boy", "car", "red ball"], 64 - len(PROMPTS))
        got = _greedy(gpu, PROMPTS + [f"The {w} was" for w in words], 48)
    for i, p in enumerate(PROMPTS):
        assert got[i] == alone[i], f"prompt {p!r} alone {alone[i]} != in a batch of 64 {got[i]}"


@needs_gpu
def test_256_sequences_at_once_complete():
    with _llm(device="cuda", max_num_seqs=256) as gpu:
        params = conveyor.SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=3)
        outs = gpu.generate([PROMPTS[i % len(PROMPTS)] for i in range(256)], params, use_tqdm=False)
    assert len(outs) == 256
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)


@needs_cuda
def test_prompt_logprobs_match_the_cpu():
    """The LM head on prompt rows after the forward (cv_model_logits): the rows
    go to the device, the logits come back, and the sampling rows are
    recomputed; small groups (max_num_seqs 2) and chunks (8 tokens)."""
    kw = dict(max_num_seqs=2, max_num_batched_tokens=8)
    params = conveyor.SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    with _llm(device="cpu", **kw) as cpu:
        want = cpu.generate(PROMPTS[:2], params, use_tqdm=False)
    with _llm(device="cuda", **kw) as gpu:
        got = gpu.generate(PROMPTS[:2], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
        for eg, ew in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert sorted(eg) == sorted(ew)
            for t in ew:
                assert eg[t].logprob == pytest.approx(ew[t].logprob, abs=2e-3)
