"""lm-evaluation-harness (`lm-eval`) as a client of `conveyor serve`, fully
offline: a local multiple-choice task (loglikelihood through /v1/completions
with echo + logprobs) and a local generate_until task, written as JSONL + task
YAML in the test's tmp dir. Each item's chosen answer must equal the one
computed directly from LLM prompt logprobs, and each generation the LLM's.

Loglikelihood needs a tokenizer on lm-eval's side (it counts the context's
tokens): that task runs on a random-weight HF checkpoint from conveyor.testing
whose tokenizer.json transformers loads from disk, and on the default model
(SmolLM2-135M-Instruct GGUF) with the tokenizer transformers builds from the
same GGUF file, where the model must also get easy questions right; the
generate_until task runs on stories260K with tokenizer_backend=None."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("CONVEYOR_SANITIZED") == "1":
    # lm-eval pulls in transformers (and torch where installed), which are not built for
    # ASan; the C paths it drives are covered under the sanitizers by test_prompt_logprobs.
    pytest.skip("lm-eval is not run under the sanitizers", allow_module_level=True)
pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conveyor import LLM, SamplingParams  # noqa: E402
from conveyor.bench.serve import OwnServer  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"

MC_ITEMS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "dog"], "answer": 0},
    {"question": "Lily went to the park and", "choices": ["played", "slept", "sang a song"], "answer": 1},
    {"question": "One day a little bird", "choices": ["flew away", "ate", "was happy"], "answer": 2},
    {"question": "Tom liked", "choices": ["red balls", "the sun", "his mom", "cake"], "answer": 0},
]
GEN_ITEMS = [{"prompt": "Once upon a time", "target": "x"},
             {"prompt": "Lily saw a big dog", "target": "y"},
             {"prompt": "The sun was", "target": "z"}]


def offline_env(monkeypatch):
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(k, raising=False)


def write_task(folder: Path, name: str, items: list, body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        f"dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n" + body)


def served_name(url: str) -> str:
    return httpx.get(url + "/v1/models", trust_env=False, timeout=30).json()["data"][0]["id"]


def evaluate(url: str, task: str, folder: Path, **model_args):
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {"model": served_name(url), "base_url": url + "/v1/completions", "max_retries": 1,
            "num_concurrent": 1, **model_args}
    res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                                  task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                  batch_size=2, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    return sorted(res["samples"][task], key=lambda s: s["doc_id"])


def encode_pair(tok, context: str, continuation: str):
    """lm-eval's split of context + continuation into token ids (trailing
    spaces of the context move to the continuation)."""
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def run_multiple_choice(tmp_path, model: str, tokenizer: str, items: list, server_args=(), **llm_kwargs):
    """lm-eval's multiple-choice task over items against `conveyor serve model`; each
    item's per-choice loglikelihoods must equal the sums of LLM prompt logprobs over the
    choice's tokens, and lm-eval's pick the argmax. Returns lm-eval's samples."""
    write_task(tmp_path, "conveyor_mc", items,
               "output_type: multiple_choice\n"
               "doc_to_text: \"{{question}}\"\n"
               "doc_to_choice: \"{{choices}}\"\n"
               "doc_to_target: \"{{answer}}\"\n"
               "target_delimiter: \" \"\n"
               "metric_list:\n  - metric: acc\n")
    server = OwnServer(model, tuple(server_args), timeout=120.0)
    try:
        samples = evaluate(server.url, "conveyor_mc", tmp_path, tokenizer_backend="huggingface",
                           tokenizer=tokenizer, tokenized_requests=True)
    finally:
        server.stop()
    assert len(samples) == len(items)

    with LLM(model, num_threads=1, **llm_kwargs) as llm:
        tok = llm.get_tokenizer()
        for s, item in zip(samples, items):
            lls = []
            for choice in item["choices"]:
                ctx, cont = encode_pair(tok, item["question"], " " + choice)
                ids = ctx + cont
                out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                   use_tqdm=False)[0]
                lls.append(sum(out.prompt_logprobs[t][ids[t]].logprob for t in range(len(ctx), len(ids))))
            got = [r[0][0] for r in s["resps"]]  # lm-eval's (loglikelihood, is_greedy) per choice
            assert got == pytest.approx(lls, abs=1e-4)
            assert int(np.argmax(got)) == int(np.argmax(lls))
            assert s["acc"] == float(int(np.argmax(lls)) == item["answer"])
    return samples


def test_lm_eval_multiple_choice_matches_prompt_logprobs(tmp_path, monkeypatch):
    from conveyor.testing import write_hf_checkpoint

    offline_env(monkeypatch)
    model = write_hf_checkpoint(tmp_path / "model", shape="tiny")
    run_multiple_choice(tmp_path, str(model), str(model), MC_ITEMS)


# easy for any instruct model; SmolLM2-135M's margins are 0.4 to 14 nats
EASY_ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["blue", "cold", "fast"], "answer": 1},
    {"question": "The sun rises in the", "choices": ["west", "north", "east"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "Newton"], "answer": 0},
    {"question": "A week has seven", "choices": ["apples", "days", "rivers"], "answer": 1},
    {"question": "The color of the clear sky is", "choices": ["green", "purple", "blue"], "answer": 2},
    {"question": "Two plus two equals", "choices": ["four", "nine", "seven"], "answer": 0},
]


def test_lm_eval_multiple_choice_on_the_default_model(tmp_path, monkeypatch, smollm2_gguf):
    """The real model through lm-eval: its loglikelihoods are the engine's, and it answers
    easy questions (chance would get about 2 of 7)."""
    pytest.importorskip("torch", reason="transformers reads GGUF files only with torch installed")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    offline_env(monkeypatch)
    tok_dir = tmp_path / "hf_tokenizer"
    AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name).save_pretrained(tok_dir)
    samples = run_multiple_choice(tmp_path, str(smollm2_gguf), str(tok_dir), EASY_ITEMS,
                                  ("--max-model-len", "256", "--kv-cache-memory", "64MiB"),
                                  max_model_len=256, kv_cache_memory="64MiB")
    assert sum(s["acc"] for s in samples) >= 6


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} not found")
def test_lm_eval_generate_until_on_stories(tmp_path, monkeypatch):
    offline_env(monkeypatch)
    write_task(tmp_path, "conveyor_gen", GEN_ITEMS,
               "output_type: generate_until\n"
               "doc_to_text: \"{{prompt}}\"\n"
               "doc_to_target: \"{{target}}\"\n"
               "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 24\n  do_sample: false\n"
               "  temperature: 0.0\n"
               "metric_list:\n  - metric: exact_match\n")
    server = OwnServer(str(STORIES), (), timeout=120.0)
    try:
        samples = evaluate(server.url, "conveyor_gen", tmp_path, tokenizer_backend=None,
                           tokenized_requests=False)
    finally:
        server.stop()
    with LLM(str(STORIES), num_threads=1) as llm:
        want = llm.generate([g["prompt"] for g in GEN_ITEMS],
                            SamplingParams(temperature=0, max_tokens=24, stop=["."]), use_tqdm=False)
    assert [s["resps"][0][0] for s in samples] == [w.outputs[0].text for w in want]
