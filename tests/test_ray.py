"""Conveyor on Ray: Serve replicas behind the OpenAI API and Ray Data batch inference, on a
simulated two-node cluster (ray.cluster_utils.Cluster, 1 CPU per node) started once for
the module. Skips without the `ray` extra."""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from conveyor.testing import subprocess_env

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'conveyor[ray]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'conveyor[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'conveyor[ray]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import conveyor  # noqa: E402
from conveyor import SamplingParams  # noqa: E402
from conveyor.ray.data import ConveyorPredictor, build_processor  # noqa: E402
from conveyor.ray.serve import NODE_HEADER, REPLICA_HEADER, build  # noqa: E402
from conveyor.testing import STORIES_DIR  # noqa: E402

MODEL = str(STORIES_DIR / "stories260K.bin")
SERVED = "stories260K"  # what a deployment answers to: the model's name, never its path on disk
pytestmark = [pytest.mark.skipif(not Path(MODEL).is_file(), reason=f"{MODEL} not found"),
              pytest.mark.timeout(300)]

OBJECT_STORE = 100 << 20     # per node: 200 MB for the cluster
PROMPTS = ["Once upon a time", "The little dog", "Lily went to the park", "One day, a bird"]
ENGINE = {"kv_cache_memory": "64MiB"}  # per engine: enough for every test here
REPLICA = REPLICA_HEADER.decode()
NODE = NODE_HEADER.decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    # Ray's workers cannot import this test module: ship its classes by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=OBJECT_STORE,
                                                          include_dashboard=False))
    c.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def url(cluster):
    """Two replicas of 1 CPU on two 1-CPU nodes: one per node."""
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(MODEL, engine_kwargs=ENGINE, num_replicas=2, ray_actor_options={"num_cpus": 1},
                    health_check_period_s=1),
              name="main", route_prefix="/")
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60.0, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                      http_client=httpx.Client(trust_env=False, timeout=60.0))
    yield c
    c.close()


@pytest.fixture(scope="module")
def llm():
    engine = conveyor.LLM(MODEL, num_threads=1, **ENGINE)
    yield engine
    engine.close()


def greedy(llm, prompts, max_tokens):
    outs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def replicas_seen(http, n=24) -> dict:
    """replica id -> node id over n concurrent-ish completions."""
    seen = {}
    lock = threading.Lock()

    def one():
        r = http.post("/v1/completions", json={"model": SERVED, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        with lock:
            seen[r.headers[REPLICA]] = r.headers[NODE]

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen


def test_openai_client_gets_llm_generate_greedy_text(client, llm):
    want = greedy(llm, PROMPTS, 24)
    for prompt, text in zip(PROMPTS, want):
        r = client.completions.create(model=SERVED, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == text
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens <= 8


def test_streaming(client, llm):
    want = greedy(llm, [PROMPTS[0]], 32)[0]
    pieces = [c.choices[0].text for c in client.completions.create(
        model=SERVED, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == want


def test_requests_spread_over_replicas_on_both_nodes(http, cluster):
    seen = replicas_seen(http)
    assert len(seen) == 2, seen
    assert len(set(seen.values())) == 2, f"both replicas on one node: {seen}"
    assert set(seen.values()) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_health_check_and_stats_call_into_each_engine(http, llm):
    seen = replicas_seen(http, 8)
    handle = serve.get_deployment_handle("conveyor", app_name="main")
    assert handle.check_health.remote().result(timeout_s=30) is None
    stats = [handle.stats.remote().result(timeout_s=30) for _ in range(8)]
    assert {s["replica"] for s in stats} <= set(seen)
    # each replica's engine has served requests, and got the engine knobs (same KV cache as
    # an LLM built with them)
    assert all(s["requests_finished"] >= 1 for s in stats)
    assert {s["kv_cache_bytes"] for s in stats} == {llm.stats()["kv_cache_bytes"]}


def _hold_request(port: int, path: str) -> socket.socket:
    """Sends a request's headers and half its body: Serve has routed it to a replica, whose
    app waits for the rest of the body, so it stays ongoing until the socket closes."""
    body = json.dumps({"model": SERVED, "prompt": "Hi", "max_tokens": 2}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
    return s


def test_over_max_queued_requests_get_the_status_at_once(url, http):
    serve.run(build(MODEL, engine_kwargs=ENGINE, num_replicas=1, max_ongoing_requests=1, max_queued_requests=1,
                    queue_full_status=429, retry_after_s=2, ray_actor_options={"num_cpus": 0},
                    name="limited"), name="limited", route_prefix="/limited")
    port = int(url.rsplit(":", 1)[1])
    path = "/limited/v1/completions"
    held = _hold_request(port, path)
    try:
        time.sleep(2.0)  # the held request reaches the replica
        queued = threading.Thread(target=lambda: results.append(
            http.post(path, json={"model": SERVED, "prompt": "Hi", "max_tokens": 2}).status_code))
        results: list = []
        queued.start()
        time.sleep(2.0)  # the second one waits in the router's queue
        t0 = time.monotonic()
        rejected = [http.post(path, json={"model": SERVED, "prompt": "Hi", "max_tokens": 2}) for _ in range(3)]
        elapsed = time.monotonic() - t0
        assert [r.status_code for r in rejected] == [429] * 3, [r.text for r in rejected]
        assert all(r.headers.get("retry-after") == "2" for r in rejected)
        assert elapsed < 10.0, f"rejections took {elapsed:.1f}s"
        assert queued.is_alive(), "the queued request should still be waiting"
        # The openai client sees the same answer as its RateLimitError.
        c = openai.OpenAI(base_url=url + "/limited/v1", api_key="unused", max_retries=0,
                          http_client=httpx.Client(trust_env=False, timeout=30.0))
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=SERVED, prompt="Hi", max_tokens=2)
        c.close()
    finally:
        held.close()  # frees the replica: the queued request runs
    queued.join(timeout=60)
    assert results == [200]
    serve.delete("limited")


def _replica_actor(replica_id: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::main#") and a["name"].endswith("#" + replica_id):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise AssertionError(f"no actor for replica {replica_id}")


def test_killed_replica_ends_its_streams_and_is_replaced(url, http):
    before = replicas_seen(http)
    assert len(before) == 2
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "n": 64, "stream": True}
    with httpx.Client(base_url=url, timeout=60.0, trust_env=False) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            victim = r.headers[REPLICA]
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            ray.kill(_replica_actor(victim), no_restart=True)
            # The proxy loses the replica mid-response and cuts the chunked body short: the
            # client gets an error, never a stream that looks complete.
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                list(lines)
    # New requests succeed at once, on the survivor.
    for _ in range(4):
        r = http.post("/v1/completions", json={"model": SERVED, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.headers[REPLICA] != victim
    # Serve replaces the killed replica, and the new one serves.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen = replicas_seen(http, 12)
        if len(seen) == 2 and victim not in seen:
            break
        time.sleep(1.0)
    else:
        pytest.fail(f"the killed replica {victim} was not replaced: {seen}")


class CountingPredictor(ConveyorPredictor):
    """Adds `calls_in_flight`: how many batches this actor had in flight when the row's batch
    started (its own included)."""

    calls = 0

    async def __call__(self, batch):
        self.calls += 1
        seen = self.calls
        try:
            out = await super().__call__(batch)
        finally:
            self.calls -= 1
        out["calls_in_flight"] = [seen] * len(out["id"])
        return out


def test_data_job_over_1000_prompts_from_jsonl(cluster, tmp_path, llm):
    serve.shutdown()  # frees both nodes' CPUs for the actor pool
    n = 1000
    rows = [{"id": i, "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i % 13}"} for i in range(n)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = build_processor(MODEL, ENGINE, sampling_params={"max_tokens": 8, "temperature": 0.0},
                                batch_size=50, concurrency=2, num_cpus=0.5, predictor=CountingPredictor)
    # Half a CPU per actor on each 1-CPU node: the read tasks must fit in the other half.
    out = processor(ray.data.read_json(str(path), lines=True, num_cpus=0.25)).take_all()
    # Several batches at once on one actor's engine, not one blocking generate at a time.
    assert max(r["calls_in_flight"] for r in out) >= 2
    ids = sorted(int(r["id"]) for r in out)
    assert ids == list(range(n)), "every input row exactly once"
    distinct = sorted({r["prompt"] for r in rows})
    want = dict(zip(distinct, greedy(llm, distinct, 8)))
    for r in out:
        assert r["generated_text"] == want[r["prompt"]], r
        assert r["num_generated_tokens"] == 8 and r["finish_reason"] == "length"
        assert r["num_prompt_tokens"] == len(llm.get_tokenizer().encode(r["prompt"]))


def test_data_chat_messages_column(cluster, llm):
    convs = [[{"role": "user", "content": f"Tell me about {w}"}] for w in ("a cat", "the sea", "a king")]
    ds = ray.data.from_items([{"id": i, "messages": c} for i, c in enumerate(convs)])
    processor = build_processor(MODEL, ENGINE, sampling_params={"max_tokens": 6, "temperature": 0.0},
                                batch_size=2, concurrency=1, num_cpus=0.5, messages_column="messages")
    out = sorted(processor(ds).take_all(), key=lambda r: r["id"])
    want = llm.chat(convs, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [r["generated_text"] for r in out] == [o.outputs[0].text for o in want]


def test_bad_arguments_fail_before_ray_runs():
    with pytest.raises(ValueError, match="num_replicas or autoscaling_config"):
        build(MODEL, num_replicas=2, autoscaling_config="1:2")
    with pytest.raises(ValueError, match="MIN:MAX"):
        build(MODEL, autoscaling_config="3:1")
    with pytest.raises(ValueError, match="503 or 429"):
        build(MODEL, queue_full_status=500)
    with pytest.raises(ValueError, match="concurrency"):
        build_processor(MODEL, concurrency=0)
    with pytest.raises(TypeError, match="sampling_params"):
        build_processor(MODEL, sampling_params=3)
    with pytest.raises(ValueError, match="num_cpus"):
        build_processor(MODEL, num_cpus=-1)
    with pytest.raises(TypeError, match="predictor"):
        build_processor(MODEL, predictor=dict)


def test_threads_follow_cpus_and_builder_arguments(monkeypatch):
    from conveyor.ray import threads_for
    from conveyor.ray.serve import MODEL_ENV, app_builder

    assert [threads_for(c) for c in (0, 0.5, 1, 2.5, 8)] == [1, 1, 1, 2, 8]  # as Ray sets OMP_NUM_THREADS
    monkeypatch.delenv(MODEL_ENV, raising=False)
    with pytest.raises(ValueError, match=MODEL_ENV):
        app_builder({})
    with pytest.raises(ValueError, match="num_replicas must be a number"):
        app_builder({"model": MODEL, "num_replicas": "two"})
    app = app_builder({"model": MODEL, "num_replicas": "2", "num_cpus": "2", "max_num_seqs": "8"})
    assert type(app).__name__ == "Application"


def test_cli_dispatches_ray_options_and_checks_them_before_starting_ray():
    import subprocess

    env = subprocess_env()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "conveyor", "serve", MODEL, "--ray", *args],
                              capture_output=True, text=True, timeout=120, env=env)

    r = run("--port", "0")
    assert r.returncode == 2 and "--ray needs a fixed --port" in r.stderr
    r = run("--autoscale", "3:1")
    assert r.returncode == 2 and "MIN:MAX" in r.stderr
    r = run("--replicas", "2", "--autoscale", "1:2")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = subprocess.run([sys.executable, "-m", "conveyor", "serve", MODEL, "--replicas", "2"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--replicas" in r.stderr  # without --ray: the plain server refuses it
