"""The fixed workloads the study and the bound share: one cap's requests (the
same prompts for every cap, only the lengths depend on it), their SHA-256
fingerprint, and the file a worker process reads them from."""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np

from . import common


def make_study_workload(*, vocab_size: int, num_requests: int, prompt_len: int, mean_output: int,
                        cap: int, seed: int = 0) -> common.Workload:
    """The requests of one cap: the prompts do not depend on the cap, only the lengths."""
    return common.make_workload(n=num_requests, vocab_size=vocab_size, prompt_len=prompt_len,
                                mean_output=mean_output, cap=cap, seed=seed)


def workload_hash(prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> str:
    """SHA-256 over every request's prompt token ids and output length, in order."""
    h = hashlib.sha256()
    h.update(np.int64(len(prompts)).tobytes())
    for p, n in zip(prompts, output_lens, strict=True):
        ids = np.asarray(p, dtype="<i8")
        h.update(np.int64(ids.size).tobytes())
        h.update(ids.tobytes())
        h.update(np.int64(int(n)).tobytes())
    return h.hexdigest()


def save_workload(wl: common.Workload, path) -> str:
    prompts = [np.asarray(p).tolist() for p in wl.prompts]
    digest = workload_hash(prompts, wl.output_lens)
    with open(path, "w") as f:
        json.dump({"prompts": prompts, "output_lens": list(map(int, wl.output_lens)), "hash": digest}, f)
    return digest


def load_workload(path):
    """(prompts, output_lens, hash) as written by save_workload; the hash is recomputed
    from what was read, and a mismatch is an error."""
    with open(path) as f:
        d = json.load(f)
    digest = workload_hash(d["prompts"], d["output_lens"])
    if digest != d["hash"]:
        raise ValueError(f"workload {path}: hash {digest} differs from the recorded {d['hash']}")
    return d["prompts"], d["output_lens"], digest
