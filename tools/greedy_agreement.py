"""Greedy agreement of Conveyor with a running llama.cpp `llama-server` on the same GGUF.

    llama-server -m MODEL.gguf -t 2 -c 2048 --port 8091 -np 1 &
    python tools/greedy_agreement.py MODEL.gguf '{"activation_dtype": "auto"}'

Ten chat prompts, templated and tokenized by Conveyor, sent as token ids to both; 48 greedy
tokens each; prints where each pair of outputs first differs and how many agree throughout.
(llama.cpp is built from source in a scratch folder, never part of this repository.)"""
import json
import sys
import urllib.request

import conveyor
from conveyor import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
           "List three prime numbers.", "What is 12 times 7?", "Translate 'good morning' into Spanish.",
           "Who wrote Romeo and Juliet?", "Give me a tip for learning to code.", "What color is the sky on a clear day?",
           "Describe a cat in one sentence."]


def main() -> int:
    path, kw = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    url = sys.argv[3] if len(sys.argv) > 3 else "http://127.0.0.1:8091"
    llm = conveyor.LLM(path, num_threads=2, **kw)
    tok = llm.get_tokenizer()
    same = 0
    for p in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        ids = tok.encode(text) if isinstance(text, str) else list(text)
        ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48),
                            use_tqdm=False)[0].outputs[0]
        body = {"prompt": ids, "n_predict": 48, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "return_tokens": True}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        theirs = json.loads(urllib.request.urlopen(req).read()).get("tokens") or []
        a = list(ours.token_ids)
        n = min(len(a), len(theirs))
        first = next((i for i in range(n) if a[i] != theirs[i]), None)
        if first is None and len(a) != len(theirs):
            first = n
        same += first is None
        print(f"{p[:40]!r:44} conveyor {len(a):2d} tokens, llama.cpp {len(theirs):2d}, first difference at {first}")
    print(f"identical throughout: {same} / {len(PROMPTS)}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
