"""A short soak (the full one is tools/soak.py, figures in docs/reliability.md):
many requests with random lengths, 30% aborted at random moments (by cancelling
the consumer or by abort()), 30% on a KV pool of a few blocks so that preemption
never stops. Every request must end, every KV block must be free at the end, the
tight engine must have preempted, and resident memory must come back within 5%
of its level after a warm-up round."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from conveyor.testing import STORIES_DIR  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = STORIES_DIR / "stories260K.bin"
SOAK = ROOT / "tools" / "soak.py"
pytestmark = [pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not found"),
              pytest.mark.skipif(not SOAK.is_file(), reason="tools/soak.py not in this tree")]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("conveyor_soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# Under tools/sanitize.sh ASan's quarantine holds freed memory, so RSS says nothing.
CHECK_RSS = os.environ.get("CONVEYOR_SANITIZED") != "1"


def _check(res: dict, n: int):
    assert res["ok"], res["problems"]
    assert res["finished"] + res["aborted"] + res["cancelled"] == n
    assert res["hung"] == 0 and res["n_errors"] == 0
    assert res["finished"] > 0 and res["aborted"] + res["cancelled"] > 0
    assert res["blocks_used_end"] == {"normal": 0, "tight": 0}
    assert res["preemptions"]["tight"] > 0
    if CHECK_RSS:
        assert res["rss_growth_pct"] <= 5.0


def test_soak_async_short(soak):
    n = 1000
    res = soak.soak_async(MODEL, n, seed=7, warmup=150, concurrency=48, watchdog=60.0, log=lambda *_: None,
                          check_rss=CHECK_RSS)
    _check(res, n)
    assert res["aborted"] > 0 and res["cancelled"] > 0  # both kinds of abort happened
    assert res["engine_aborted"]["normal"] + res["engine_aborted"]["tight"] > 0


def test_soak_http_short(soak):
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    try:
        import conveyor.serve  # noqa: F401
    except ImportError:
        pytest.skip("conveyor.serve is not importable")
    n = 300
    # 150 warm-up requests, as the async soak
    res = soak.soak_http(MODEL, n, seed=7, warmup=150, concurrency=32, watchdog=60.0, log=lambda *_: None,
                          check_rss=CHECK_RSS)
    _check(res, n)
    assert res["cancelled"] > 0  # clients did disconnect
