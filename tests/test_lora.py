"""LoRA adapters: PEFT folders and GGUF LoRA files read and checked, per-request adapters in
the batched step equal to the NumPy reference with the delta and to merged weights, mixed
batches batch-invariant, slots swapped LRU, the prefix cache keyed by adapter."""
import json

import numpy as np
import pytest

from conveyor import LLM, LoRAError, LoRARequest, SamplingParams, _core
from conveyor import testing as T
from conveyor.lora import load_adapter
from conveyor.reference import ReferenceModel

LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = [[1, 5, 9, 30, 2, 7, 8], [3, 4, 100, 200, 17], list(range(2, 40)), [11, 12]]


def cfg_of(model) -> dict:
    ck = _core.Checkpoint(str(model))
    try:
        return ck.config
    finally:
        ck.close()


def adapter(tmp_path, model, name, rank, seed, targets=T.LORA_MODULES, alpha=None, **kw):
    cfg = cfg_of(model)
    w = T.random_lora_weights(cfg, rank, targets=targets, seed=seed, scale=1.0)
    path = T.write_peft_adapter(tmp_path / name, w, rank=rank, alpha=alpha or 2 * rank, **kw)
    return path, w


def ref_tokens(model, path, prompt, n=10, lora_dtype="float32"):
    """The reference's greedy tokens with the adapter at path (None: the base), its A and B
    rounded to lora_dtype as the engine holds them."""
    ref = ReferenceModel.load(model)
    if path is not None:
        ad = load_adapter(path, cfg_of(model))
        if lora_dtype != "float32":
            ad.weights = {k: (T.round_to_dtype(a, lora_dtype).astype(np.float32),
                              T.round_to_dtype(b, lora_dtype).astype(np.float32)) for k, (a, b) in ad.weights.items()}
        ref.lora = ad
    return ref.greedy(prompt, n)


def gen(llm, prompts, loras=None, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- reading and refusals

def test_gguf_lora_equals_peft(tmp_path, stories_dir):
    model = stories_dir / "stories260K.bin"
    cfg = cfg_of(model)
    w = T.random_lora_weights(cfg, 8, seed=3)
    a = load_adapter(T.write_peft_adapter(tmp_path / "p", w, rank=8, alpha=4), cfg)
    g = load_adapter(T.write_gguf_lora(tmp_path / "g.gguf", w, alpha=4, n_heads=cfg["n_heads"],
                                       n_kv_heads=cfg["n_kv_heads"]), cfg)
    assert a.rank == g.rank == 8 and a.scale == g.scale == 0.5
    assert a.weights.keys() == g.weights.keys()
    for k in a.weights:
        assert np.array_equal(a.weights[k][0], g.weights[k][0]) and np.array_equal(a.weights[k][1], g.weights[k][1])


def test_rslora_scale(tmp_path, tiny_hf_dir):
    path, _ = adapter(tmp_path, tiny_hf_dir, "rs", 16, 1, alpha=8, use_rslora=True)
    assert load_adapter(path, cfg_of(tiny_hf_dir)).scale == pytest.approx(8 / 4)
    path, _ = adapter(tmp_path, tiny_hf_dir, "plain", 16, 1, alpha=8)
    assert load_adapter(path, cfg_of(tiny_hf_dir)).scale == pytest.approx(0.5)


def _bad_config(tmp_path, model, key, value):
    path, _ = adapter(tmp_path, model, f"bad_{key}", 4, 1)
    c = json.loads((path / "adapter_config.json").read_text())
    c[key] = value
    (path / "adapter_config.json").write_text(json.dumps(c))
    return path


@pytest.mark.parametrize("key,value,field", [
    ("use_dora", True, "use_dora"),
    ("bias", "all", "bias"),
    ("target_modules", ["q_proj", "embed_tokens"], "target_modules"),
    ("peft_type", "IA3", "peft_type"),
    ("r", 0, "r"),
])
def test_peft_refusals_name_the_key(tmp_path, tiny_hf_dir, key, value, field):
    path = _bad_config(tmp_path, tiny_hf_dir, key, value)
    with pytest.raises(LoRAError, match=key) as e:
        load_adapter(path, cfg_of(tiny_hf_dir))
    assert e.value.field == field


def test_rank_and_shape_mismatch_refused(tmp_path, tiny_hf_dir, stories_dir):
    cfg = cfg_of(tiny_hf_dir)
    path = _bad_config(tmp_path, tiny_hf_dir, "r", 8)  # tensors of rank 4
    with pytest.raises(LoRAError, match="r=8"):
        load_adapter(path, cfg)
    # an adapter of another base (stories260K's shapes on the tiny HF model)
    other, _ = adapter(tmp_path, stories_dir / "stories260K.bin", "other", 4, 1)
    with pytest.raises(LoRAError, match="do not match the base|beyond the base"):
        load_adapter(other, cfg)
    path, _ = adapter(tmp_path, tiny_hf_dir, "big", 32, 1)
    with pytest.raises(LoRAError, match="max_lora_rank=16"):
        load_adapter(path, cfg, max_rank=16)


def test_gguf_refusals(tmp_path, tiny_hf_dir, stories_dir):
    cfg = cfg_of(stories_dir / "stories260K.bin")
    w = T.random_lora_weights(cfg, 4, seed=1)
    p = T.write_gguf_lora(tmp_path / "m.gguf", w, alpha=4, n_heads=8, n_kv_heads=4, general_type="model")
    with pytest.raises(LoRAError, match="general.type"):
        load_adapter(p, cfg)
    p = T.write_gguf_lora(tmp_path / "q.gguf", w, alpha=4, arch="qwen2")
    with pytest.raises(LoRAError, match="general.architecture"):
        load_adapter(p, cfg)


def test_engine_refuses_adapter_without_enable_lora(tmp_path, tiny_hf_dir):
    path, _ = adapter(tmp_path, tiny_hf_dir, "a", 4, 1)
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            gen(llm, [PROMPTS[0]], LoRARequest("a", 1, path))
    with pytest.raises(ValueError, match="max_loras"):
        LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=0)


# ---------------------------------------------------------------- the engine's adapter path

@pytest.mark.parametrize("rank,targets", [(1, T.LORA_MODULES), (8, T.LORA_MODULES), (8, ("q_proj", "v_proj")),
                                          (16, ("o_proj", "down_proj", "up_proj"))])
def test_engine_equals_reference(tmp_path, tiny_hf_dir, rank, targets):
    path, _ = adapter(tmp_path, tiny_hf_dir, "a", rank, rank, targets=targets)
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16) as llm:
        got = gen(llm, PROMPTS, LoRARequest("a", 1, path))
    assert got == [ref_tokens(tiny_hf_dir, path, p) for p in PROMPTS]
    assert got != [ref_tokens(tiny_hf_dir, None, p) for p in PROMPTS]  # the adapter changes the output


def test_stories260k_peft_and_gguf(tmp_path, stories_dir):
    model = stories_dir / "stories260K.bin"
    cfg = cfg_of(model)
    w = T.random_lora_weights(cfg, 8, seed=5, scale=1.0)
    peft = T.write_peft_adapter(tmp_path / "p", w, rank=8, alpha=16)
    gg = T.write_gguf_lora(tmp_path / "g.gguf", w, alpha=16, n_heads=cfg["n_heads"], n_kv_heads=cfg["n_kv_heads"])
    with LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, skip_tokenizer_init=True) as llm:
        a = gen(llm, PROMPTS, LoRARequest("p", 1, peft))
        b = gen(llm, PROMPTS, LoRARequest("g", 2, gg))
    assert a == b == [ref_tokens(model, peft, p) for p in PROMPTS]


def _write_merged(tmp_path, model, w, rank, alpha):
    """The HF checkpoint with W + scale * B A written into its weights."""
    return T.write_merged_lora(tmp_path / "merged", model, w, alpha / rank)


def test_merged_weights_equivalence(tmp_path, tiny_hf_dir):
    path, w = adapter(tmp_path, tiny_hf_dir, "a", 8, 7, alpha=16)
    merged = _write_merged(tmp_path, tiny_hf_dir, w, 8, 16)
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8) as llm:
        got = gen(llm, PROMPTS, LoRARequest("a", 1, path))
    with LLM(str(merged), skip_tokenizer_init=True) as llm:
        want = gen(llm, PROMPTS)
    assert got == want


@pytest.mark.parametrize("level", LEVELS)
def test_mixed_batch_invariant_at_each_level(tmp_path, tiny_hf_dir, monkeypatch, level):
    """No adapter, adapter 1 and adapter 2 in one batch: each row's tokens and logprob bits
    equal running it alone; and equal the reference."""
    if level not in _core.kernel_info()["levels"]:
        pytest.skip(f"this CPU lacks {level}")
    monkeypatch.setenv("CONVEYOR_SIMD", level)
    p1, _ = adapter(tmp_path, tiny_hf_dir, "a1", 8, 11)
    p2, _ = adapter(tmp_path, tiny_hf_dir, "a2", 4, 12, targets=("q_proj", "k_proj", "gate_proj"))
    l1, l2 = LoRARequest("a1", 1, p1), LoRARequest("a2", 2, p2)
    prompts = PROMPTS + PROMPTS[:2]
    loras = [None, l1, l2, l1, l2, None]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)

    def run(ps, ls):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False, lora_request=ls)
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                         o.outputs[0].logprobs)]) for o in outs]

    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=8,
             num_threads=2, enable_prefix_caching=False) as llm:
        alone = [run([p], [lr])[0] for p, lr in zip(prompts, loras)]
        together = run(prompts, loras)
    assert together == alone
    for (toks, _), p, lr in zip(together, prompts, loras):
        assert toks == ref_tokens(tiny_hf_dir, lr.lora_path if lr else None, p)


def test_eviction_with_one_slot(tmp_path, tiny_hf_dir):
    """max_loras=1 and two adapters alternating in one call: requests wait for the slot,
    adapters are swapped in and out, and every request gets its own adapter's tokens."""
    p1, _ = adapter(tmp_path, tiny_hf_dir, "a1", 4, 21)
    p2, _ = adapter(tmp_path, tiny_hf_dir, "a2", 4, 22)
    l1, l2 = LoRARequest("a1", 1, p1), LoRARequest("a2", 2, p2)
    loras = [l1, l2, None, l1, l2, l1]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        got = gen(llm, prompts, loras)
        st = llm.stats()
        assert llm._core.num_unfinished() == 0
    assert st["lora_swaps"] >= 3 and st["lora_requests_waiting"] == 0
    assert st["lora_evictions"] == st["lora_swaps"] - 1  # one slot: every load after the first evicts
    assert st["lora_requests"] == {"a1": 3, "a2": 2} and st["lora_tokens"] == {"a1": 30, "a2": 20}
    assert got == [ref_tokens(tiny_hf_dir, lr.lora_path if lr else None, p) for p, lr in zip(prompts, loras)]


def test_prefix_cache_not_shared_across_adapters(tmp_path, tiny_hf_dir):
    p1, _ = adapter(tmp_path, tiny_hf_dir, "a1", 4, 31)
    p2, _ = adapter(tmp_path, tiny_hf_dir, "a2", 4, 32)
    prompt = list(range(2, 70))  # several 16-token blocks
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=4,
             enable_prefix_caching=True) as llm:
        def one(lr):
            o = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lr)[0]
            return o.outputs[0].token_ids, o.metrics.num_cached_tokens

        base = one(None)
        first1 = one(LoRARequest("a1", 1, p1))
        first2 = one(LoRARequest("a2", 2, p2))
        again1 = one(LoRARequest("a1", 1, p1))
        base_again = one(None)
    assert first1[1] == 0 and first2[1] == 0  # the base's blocks are not taken under an adapter
    assert again1[1] > 0 and base_again[1] > 0  # the same adapter (and the base) find their own
    assert first1[0] == again1[0] == ref_tokens(tiny_hf_dir, p1, prompt)
    assert first2[0] == ref_tokens(tiny_hf_dir, p2, prompt)
    assert base[0] == base_again[0] == ref_tokens(tiny_hf_dir, None, prompt)


def test_async_llm_lora(tmp_path, tiny_hf_dir):
    import asyncio

    from conveyor import AsyncLLM

    path, _ = adapter(tmp_path, tiny_hf_dir, "a", 4, 41)

    async def main():
        async with AsyncLLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True,
                            max_lora_rank=4) as llm:
            last = None
            async for out in llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY,
                                          lora_request=LoRARequest("a", 1, path)):
                last = out
            return last.outputs[0].token_ids

    assert asyncio.run(main()) == ref_tokens(tiny_hf_dir, path, PROMPTS[0])


# ---------------------------------------------------------------- the server

def test_server_adapters_by_model_name(tmp_path, stories_dir):
    """conveyor serve --lora-modules: the openai client names an adapter as its model and gets
    what LLM gives with that adapter; /v1/models lists adapters with their parent; adapters
    load and unload at run time behind --api-key; unknown names are 404, bad files 400."""
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from conveyor.bench.serve import OwnServer

    model = stories_dir / "stories260K.bin"
    cfg = cfg_of(model)
    paths = {}
    for name, seed in (("a1", 51), ("a2", 52), ("a3", 53)):
        w = T.random_lora_weights(cfg, 4, seed=seed, scale=1.0)
        paths[name] = T.write_peft_adapter(tmp_path / name, w, rank=4, alpha=8)
    bad = _bad_config(tmp_path, model, "use_dora", True)
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(str(model), enable_lora=True, max_loras=3, max_lora_rank=4) as llm:
        def want(name):
            lr = LoRARequest(name, 1 + list(paths).index(name), paths[name]) if name else None
            return llm.generate(["Once upon a time"], params, use_tqdm=False, lora_request=lr)[0].outputs[0].text

        expected = {n: want(n) for n in (None, "a1", "a2", "a3")}
    assert len(set(expected.values())) == 4  # the adapters change the text

    s = OwnServer(str(model), ("--api-key", "k", "--lora-modules", f"a1={paths['a1']}", f"a2={paths['a2']}",
                               "--max-loras", "2", "--max-lora-rank", "4"), timeout=60.0)
    try:
        with httpx.Client(base_url=s.url, timeout=30.0, trust_env=False,
                          headers={"Authorization": "Bearer k"}) as http:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0,
                                   http_client=httpx.Client(trust_env=False, timeout=30.0))
            cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
            base = next(n for n, c in cards.items() if c["parent"] is None)
            assert cards["a1"]["parent"] == cards["a2"]["parent"] == base

            def ask(name):
                return client.completions.create(model=name, prompt="Once upon a time", max_tokens=8,
                                                 temperature=0).choices[0].text

            assert ask(base) == expected[None]
            assert ask("a1") == expected["a1"] and ask("a2") == expected["a2"]
            r = client.completions.create(model="a2", prompt="Once upon a time", max_tokens=2)
            assert r.model == "a2"  # the answer names the adapter asked for
            with pytest.raises(openai.NotFoundError, match="a3"):
                ask("a3")
            assert httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a3",
                                                                      "lora_path": str(paths["a3"])},
                              trust_env=False).status_code == 401
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(paths["a3"])})
            assert r.status_code == 200, r.text
            assert ask("a3") == expected["a3"]  # a third adapter in two slots: one was evicted
            assert ask("a1") == expected["a1"]
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
            assert r.status_code == 400 and "use_dora" in r.text
            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 200, r.text
            with pytest.raises(openai.NotFoundError, match="a2"):
                ask("a2")
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
            assert "a2" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
            client.close()
    finally:
        s.stop()


def test_ngram_speculation_with_adapter_and_draft_refused(tmp_path, tiny_hf_dir):
    path, _ = adapter(tmp_path, tiny_hf_dir, "a", 4, 61)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=4,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        assert gen(llm, [prompt], LoRARequest("a", 1, path)) == [ref_tokens(tiny_hf_dir, path, prompt)]
    with pytest.raises(ValueError, match="draft model") as e:
        LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True,
            speculative_config={"model": str(tiny_hf_dir), "num_speculative_tokens": 2})
    assert e.value.field == "speculative_config"


@pytest.mark.parametrize("lora_dtype", ["float32", "bfloat16"])
def test_cuda_lora_kernels_match_cpu(tmp_path, tiny_hf_dir, lora_dtype):
    """The CUDA backend's shrink/expand (on a GPU, or the CPU emulator with
    CONVEYOR_CUDA_LIB, see tests/test_cuda.py) in a mixed batch: the same greedy tokens as
    the CPU backend and logprobs within float rounding."""
    from conveyor import _testing

    if not (hasattr(_testing, "cuda_available") and _testing.cuda_available()):
        pytest.skip("no CUDA backend (build the emulator: tests/test_cuda.py)")
    p1, _ = adapter(tmp_path, tiny_hf_dir, "a1", 8, 71)
    p2, _ = adapter(tmp_path, tiny_hf_dir, "a2", 4, 72, targets=("v_proj", "o_proj", "down_proj"))
    loras = [LoRARequest("a1", 1, p1), None, LoRARequest("a2", 2, p2)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    outs = {}
    for device in ("cpu", "cuda"):
        with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=8,
                 device=device, max_num_seqs=4, max_model_len=64, kv_cache_memory="4MiB",
                 lora_dtype=lora_dtype) as llm:
            res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False,
                               lora_request=loras)
            outs[device] = [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                     o.outputs[0].logprobs)])
                            for o in res]
    for (ct, cl), (gt, gl) in zip(outs["cpu"], outs["cuda"]):
        assert ct == gt
        np.testing.assert_allclose(gl, cl, atol=1e-3)


@pytest.mark.parametrize("base", ["bfloat16", "q8_0", "q4_1"])
def test_adapters_over_bf16_and_quantized_bases(tmp_path, base):
    """Adapters over a bf16 base (against the reference, exact float32 activations) and over
    Q8_0/Q4_1 bases (the adapter changes the tokens; a mixed batch equals each row alone)."""
    model = T.write_hf_checkpoint(tmp_path / "m", shape="tiny", dtype="bfloat16" if base == "bfloat16" else "float32")
    p1, _ = adapter(tmp_path, model, "a1", 8, 81)
    p2, _ = adapter(tmp_path, model, "a2", 8, 82)
    loras = [LoRARequest("a1", 1, p1), None, LoRARequest("a2", 2, p2), LoRARequest("a1", 1, p1)]
    kw = {"activation_dtype": "float32"} if base == "bfloat16" else {"quantization": base}
    with LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=8,
             lora_dtype="float32", enable_prefix_caching=False, **kw) as llm:
        together = gen(llm, PROMPTS, loras)
        alone = [gen(llm, [p], [lr])[0] for p, lr in zip(PROMPTS, loras)]
        plain = gen(llm, PROMPTS)
    assert together == alone
    assert together[0] != plain[0] and together[2] != plain[2] and together[1] == plain[1]
    if base == "bfloat16":
        assert together == [ref_tokens(model, lr.lora_path if lr else None, p) for p, lr in zip(PROMPTS, loras)]


def test_crafted_adapter_files_refused(tmp_path, stories_dir):
    """Sizes and shapes are checked before tensors are read: an oversized file, a GGUF
    tensor of the wrong shape or an excessive rank, a NaN, a truncated safetensors file."""
    model = stories_dir / "stories260K.bin"
    cfg = cfg_of(model)
    w = T.random_lora_weights(cfg, 4, seed=91)
    # a file larger than any adapter of max_lora_rank could be
    big = T.write_peft_adapter(tmp_path / "big", w, rank=4, alpha=4)
    with open(big / "adapter_model.safetensors", "ab") as f:
        f.truncate(10 * (1 << 20))
    with pytest.raises(LoRAError, match="more than an adapter") as e:
        load_adapter(big, cfg, max_rank=4)
    assert e.value.field == "size"
    # GGUF: B of the wrong output size; a rank over the limit
    bad = dict(w)
    a, b = bad[(0, "v_proj")]
    bad[(0, "v_proj")] = (a, np.zeros((b.shape[0] + 1, 4), np.float32))
    g = T.write_gguf_lora(tmp_path / "shape.gguf", bad, alpha=4, n_heads=8, n_kv_heads=4)
    with pytest.raises(LoRAError, match="blk.0.attn_v.weight.lora_b"):
        load_adapter(g, cfg)
    g = T.write_gguf_lora(tmp_path / "rank.gguf", T.random_lora_weights(cfg, 8, seed=92), alpha=4,
                          n_heads=8, n_kv_heads=4)
    with pytest.raises(LoRAError, match="rank <= 4"):
        load_adapter(g, cfg, max_rank=4)
    # non-finite values
    nan = dict(w)
    a, b = nan[(1, "o_proj")]
    nan[(1, "o_proj")] = (a, np.full_like(b, np.nan))
    with pytest.raises(LoRAError, match="non-finite"):
        load_adapter(T.write_peft_adapter(tmp_path / "nan", nan, rank=4, alpha=4), cfg)
    # a truncated safetensors file
    cut = T.write_peft_adapter(tmp_path / "cut", w, rank=4, alpha=4)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError):
        load_adapter(cut, cfg)


def test_parallel_completions_and_bad_requests(tmp_path, tiny_hf_dir):
    path, _ = adapter(tmp_path, tiny_hf_dir, "a", 4, 95)
    lr = LoRARequest("a", 1, path)
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=4) as llm:
        out = llm.generate([{"prompt_token_ids": list(range(2, 40))}], SamplingParams(temperature=0, max_tokens=8, n=3),
                           use_tqdm=False, lora_request=lr)[0]
        want = ref_tokens(tiny_hf_dir, path, list(range(2, 40)), 8)
        assert [c.token_ids for c in out.outputs] == [want] * 3  # forked completions keep the adapter
        with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
            gen(llm, [PROMPTS[0]], [lr, lr])
        with pytest.raises(TypeError, match="LoRARequest"):
            gen(llm, [PROMPTS[0]], "a")
        with pytest.raises(ValueError, match="already"):  # one id, two paths
            gen(llm, [PROMPTS[0]], LoRARequest("b", 1, tmp_path / "elsewhere"))
        with pytest.raises(FileNotFoundError):
            gen(llm, [PROMPTS[0]], LoRARequest("c", 3, tmp_path / "missing"))
        assert llm._core.num_unfinished() == 0
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, path)


@pytest.mark.parametrize("level", LEVELS)
def test_bf16_adapter_weights(tmp_path, tiny_hf_dir, monkeypatch, level):
    """lora_dtype="bfloat16": the adapter held in bf16 gives the reference's tokens with
    A and B rounded to bf16, at every SIMD level; a mixed batch equals each row alone."""
    if level not in _core.kernel_info()["levels"]:
        pytest.skip(f"this CPU lacks {level}")
    monkeypatch.setenv("CONVEYOR_SIMD", level)
    p1, _ = adapter(tmp_path, tiny_hf_dir, "a1", 8, 101)
    p2, _ = adapter(tmp_path, tiny_hf_dir, "a2", 8, 102)
    loras = [LoRARequest("a1", 1, p1), None, LoRARequest("a2", 2, p2), LoRARequest("a1", 1, p1)]
    with LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=8,
             lora_dtype="bfloat16", enable_prefix_caching=False) as llm:
        together = gen(llm, PROMPTS, loras)
        alone = [gen(llm, [p], [lr])[0] for p, lr in zip(PROMPTS, loras)]
    assert together == alone
    for toks, p, lr in zip(together, PROMPTS, loras):
        assert toks == ref_tokens(tiny_hf_dir, lr.lora_path if lr else None, p, lora_dtype="bfloat16")
    with pytest.raises(ValueError, match="lora_dtype"):
        LLM(str(tiny_hf_dir), skip_tokenizer_init=True, enable_lora=True, lora_dtype="float16")


def test_auto_lora_dtype_follows_the_base(tmp_path, tiny_hf_dir):
    """lora_dtype="auto" (the default) holds the adapters in float32 over a float32 base and in
    bf16 over a bf16 or quantized one: the tokens equal the reference with A and B rounded so,
    and the logprobs equal those of the dtype named outright, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    bf16_model = T.write_hf_checkpoint(tmp_path / "m", shape="tiny", dtype="bfloat16")
    cases = [(tiny_hf_dir, {}, "float32"), (bf16_model, {"activation_dtype": "float32"}, "bfloat16"),
             (tiny_hf_dir, {"quantization": "q8_0"}, "bfloat16")]
    for i, (model, kw, want) in enumerate(cases):
        path, _ = adapter(tmp_path, model, f"a{i}", 8, 121)
        lr = [LoRARequest("a", 1, path)] * 2
        runs = {}
        for dtype in ("auto", want):
            with LLM(str(model), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8, lora_dtype=dtype,
                     enable_prefix_caching=False, **kw) as llm:
                assert llm.model_config["lora_dtype"] == want
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False,
                                    lora_request=lr)
                runs[dtype] = [(o.outputs[0].token_ids, [{t: x.logprob for t, x in d.items()}
                                                         for d in o.outputs[0].logprobs]) for o in outs]
        assert runs["auto"] == runs[want]
        if not kw.get("quantization"):  # the reference has no quantized base
            for (toks, _), p in zip(runs["auto"], PROMPTS[:2]):
                assert toks == ref_tokens(model, path, p, n=8, lora_dtype=want)


def test_bench_lora_command(tmp_path, tiny_hf_dir):
    """`conveyor bench lora` on a tiny base: a base/adapters pair per number of adapters,
    the merged copies, the JSON; every request of every adapter counted in the stats."""
    from conveyor import cli

    out = tmp_path / "lora.json"
    rc = cli.main(["bench", "lora", "--model", str(tiny_hf_dir), "--adapters", "1,3", "--requests", "6",
                   "--max-tokens", "3", "--prompt-len", "5", "--reps", "1", "--merged-adapters", "3",
                   "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [m["adapters"] for m in r["mixed"]] == [1, 3]
    for m in r["mixed"]:
        (p,) = m["pairs"]
        assert p["base_tok_s"] > 0 and p["lora_tok_s"] > 0 and p["ratio"] == pytest.approx(p["lora_tok_s"] /
                                                                                           p["base_tok_s"])
    (mg,) = r["merged"]
    assert mg["adapters"] == 3 and mg["tok_s"] > 0 and mg["mixed_over_merged"] > 0
    # a0: the warm-up of k=1 (1) and of k=3 (1), 6 + 2 requests of the two measured batches
    assert r["lora_stats"]["lora_requests"] == {"a0": 1 + 6 + 1 + 2, "a1": 1 + 2, "a2": 1 + 2}
    assert r["lora_stats"]["lora_tokens"]["a1"] == 3 * 3
    with pytest.raises(SystemExit):
        cli.main(["bench", "lora", "--model", str(tiny_hf_dir), "--adapters", "7", "--requests", "6"])


def _metric(text: str, name: str, **labels) -> float:
    """The value of one sample of /metrics (all of its labels given, model_name aside)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            lab = dict(kv.split("=", 1) for kv in line[len(name) + 1:line.index("}")].split(","))
            lab.pop("model_name", None)
            if lab == {k: f'"{v}"' for k, v in labels.items()}:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_server_lora_metrics_and_loads_while_streaming(tmp_path, stories_dir):
    """Requests and tokens per adapter and slot loads/evictions in /metrics after a known
    workload; adapters loaded and unloaded over HTTP while other adapters' requests stream
    (slot writes against running steps) leave every stream's text equal to the adapter's
    own, alone."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    import threading

    from conveyor.bench.serve import OwnServer

    LONG = 200  # the streams' tokens: long enough to run under the loads
    model = stories_dir / "stories260K.bin"
    cfg = cfg_of(model)
    paths = {n: T.write_peft_adapter(tmp_path / n, T.random_lora_weights(cfg, 4, seed=80 + i, scale=1.0), rank=4,
                                     alpha=8) for i, n in enumerate(("a1", "a2", "a3", "a4"))}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(model), enable_lora=True, max_loras=4, max_lora_rank=4) as llm:
        want = {n: llm.generate(["Once upon a time"], params, use_tqdm=False,
                                lora_request=LoRARequest(n, i + 1, str(paths[n])))[0].outputs[0].text
                for i, n in enumerate(paths)}
        long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
        want_long = {n: llm.generate(["Once upon a time"], long, use_tqdm=False,
                                     lora_request=LoRARequest(n, i + 1, str(paths[n])))[0].outputs[0].text
                     for i, n in enumerate(paths)}
    s = OwnServer(str(model), ("--lora-modules", f"a1={paths['a1']}", f"a2={paths['a2']}", "--max-loras", "3",
                               "--max-lora-rank", "4"), timeout=60.0)
    try:
        with httpx.Client(base_url=s.url, timeout=60.0, trust_env=False) as http:
            def ask(name, max_tokens=24):
                r = http.post("/v1/completions", json={"model": name, "prompt": "Once upon a time", "temperature": 0,
                                                       "max_tokens": max_tokens, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            for name in ("a1", "a1", "a1", "a2", "a2"):
                assert ask(name) == want[name]
            for name in ("a3", "a4"):
                r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths[name])})
                assert r.status_code == 200, r.text
                assert ask(name) == want[name]  # a4 in three slots: a1, the least recently used, is evicted
            m = http.get("/metrics").text
            assert _metric(m, "conveyor_lora_requests_total", adapter="a1") == 3
            assert _metric(m, "conveyor_lora_requests_total", adapter="a2") == 2
            assert _metric(m, "conveyor_lora_generation_tokens_total", adapter="a1") == 3 * 24
            assert _metric(m, "conveyor_lora_generation_tokens_total", adapter="a3") == 24
            assert _metric(m, "conveyor_lora_adapter_loads_total") == 4
            assert _metric(m, "conveyor_lora_adapter_evictions_total") == 1
            assert _metric(m, "conveyor_lora_adapters_resident") == 3

            streamed, errors = {}, []

            def stream(i, name):
                try:
                    text = ""
                    with httpx.Client(base_url=s.url, timeout=60.0, trust_env=False) as c:
                        with c.stream("POST", "/v1/completions",
                                      json={"model": name, "prompt": "Once upon a time", "temperature": 0,
                                            "max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
                            for line in r.iter_lines():
                                if line.startswith("data: {"):
                                    text += json.loads(line[6:])["choices"][0]["text"]
                    streamed[i] = (name, text)
                except Exception as e:  # noqa: BLE001 - reported by the main thread
                    errors.append(repr(e))

            threads = [threading.Thread(target=stream, args=(i, ("a2", "a3")[i % 2])) for i in range(6)]
            for t in threads:
                t.start()
            for _ in range(3):  # a1 into the idle slot and out again while the streams step
                assert want["a1"].startswith(ask("a1", 4))
                assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
                r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(paths["a1"])})
                assert r.status_code == 200, r.text
            for t in threads:
                t.join(60)
            assert errors == [] and len(streamed) == 6
            assert all(text == want_long[name] for name, text in streamed.values())
            assert ask("a1") == want["a1"]
            m = http.get("/metrics").text
            assert _metric(m, "conveyor_lora_requests_total", adapter="a2") == 2 + 3
            assert _metric(m, "conveyor_lora_requests_waiting") == 0
    finally:
        s.stop()
