"""Times prefill alone: 2 random prompts of 512 tokens, max_tokens=1, on one thread,
three times after loading. Used to compare two builds of the same commit (run it
alternately with each build's python/ on PYTHONPATH).

    PYTHONPATH=build_a/python python tools/prefill_time.py MODEL
"""
import sys
import time

import numpy as np

from conveyor import LLM, SamplingParams


def main(model: str) -> None:
    llm = LLM(model, num_threads=1, dtype="bfloat16", enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(3):
        prompts = [{"prompt_token_ids": rng.integers(10, 10000, 512).tolist()} for _ in range(2)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        times.append(round(time.perf_counter() - t, 3))
    print("prefill 2 x 512 tokens, 1 thread, s:", times)


if __name__ == "__main__":
    main(sys.argv[1])
