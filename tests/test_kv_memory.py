"""The KV cache is committed as it is used: an engine with a 2 GiB pool is not 2 GiB resident
after construction, and generating touches only the blocks it holds. Each case runs in a fresh
process so its resident set is that engine's alone (RSS from /proc/self/statm). Timing is a
benchmark (`conveyor bench start`), not a test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor.testing import STORIES_DIR  # noqa: E402

STORIES = STORIES_DIR / "stories260K.bin"
pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")

CHILD = r"""
import json, os, sys
import conveyor
from conveyor import SamplingParams
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
before = rss()
llm = conveyor.LLM(sys.argv[1], kv_cache_memory=sys.argv[2], num_threads=1)
built = rss()
outs = llm.generate(["Once upon a time"] * 4, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
used = rss()
print(json.dumps({"before": before, "built": built, "used": used, "pool": llm.stats()["kv_cache_bytes"],
                  "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
llm.close()
"""


def measure(model: str, kv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, kv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} not found")
@pytest.mark.skipif(os.environ.get("CONVEYOR_SANITIZED") == "1",
                    reason="under the sanitizers the allocator and shadow memory change the resident set")
def test_the_kv_pool_is_not_resident_after_construction():
    big = measure(str(STORIES), "2GiB")
    small = measure(str(STORIES), "64MiB")
    assert big["pool"] >= 2 * 2**30 and small["pool"] <= 65 * 2**20  # + the reserved block 0
    assert big["tokens"] == small["tokens"] == 128
    # The 2 GiB pool adds nothing like 2 GiB: the two engines' footprints after construction
    # and after generating differ by far less than the 64 MiB pool itself.
    assert big["built"] - big["before"] < 256 * 2**20, big
    assert abs((big["built"] - big["before"]) - (small["built"] - small["before"])) < 32 * 2**20, (big, small)
    assert abs((big["used"] - big["before"]) - (small["used"] - small["before"])) < 32 * 2**20, (big, small)


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} not found")
def test_blocks_touched_counts_the_committed_part_of_the_pool():
    """stats()["blocks_touched"]: blocks ever handed out, the part of the pool that is
    resident. None before the first request; it grows with use and never past the pool."""
    import conveyor
    from conveyor import SamplingParams

    with conveyor.LLM(str(STORIES), num_threads=1, kv_cache_memory="64MiB", block_size=16) as llm:
        st = llm.stats()
        assert st["blocks_touched"] == 0
        llm.generate(["Once upon a time"] * 4, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        first = llm.stats()["blocks_touched"]
        assert 4 <= first <= st["num_blocks"] - 1
        llm.generate(["The little dog"] * 8, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        assert first < llm.stats()["blocks_touched"] <= st["num_blocks"] - 1
        assert llm.stats()["blocks_used"] == 0
