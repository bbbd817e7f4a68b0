"""Scheduler and block pool: random workloads driven by a fake runner.

The fake runner models the KV cache itself: every step it checks that the
context a planned sequence attends to (positions before start_pos, read
through its block table) holds exactly that sequence's tokens, and it writes
the new positions. So a prefix-cache hit, a fork or a preemption that handed
out wrong or shared-and-overwritten blocks fails here, not only in check().
"""
import math

import numpy as np

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor._testing import Scheduler

VOCAB = 5  # tiny, so blocks repeat inside and across prompts
SHARED_PREFIXES = [
    [],
    [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2],
    [3] * 20,
    [2, 4, 1, 3, 0, 0, 4, 2, 1, 3, 2, 4, 1, 3, 0, 0, 4, 2],
]


def next_token(seed, tokens):
    """Deterministic 'model': the next token from the history and a seed."""
    h = seed * 1000003 + len(tokens)
    for t in tokens[-6:]:
        h = (h * 31 + t) % 1000000007
    return h % VOCAB


def order_key(info, sid):
    return (info["priority"], info["arrival"], sid)


def admitted_now(s, before):
    """Sequences that were waiting before the step and run after it."""
    return [sid for sid, b in before.items()
            if b["status"] == "waiting" and s.seq_info(sid)["status"] == "running"]


class Driver:
    """Runs a workload through the scheduler, checking it after every step."""

    def __init__(self, cfg, requests, aborts=(), forks=(), kv_model=True):
        self.cfg = cfg
        self.s = Scheduler(**cfg)
        self.bs = cfg["block_size"]
        self.policy = cfg.get("policy", "continuous")
        self.budget = cfg["max_num_batched_tokens"]
        self.cap = cfg["max_num_seqs"]
        self.chunked = cfg.get("enable_chunked_prefill", True)
        self.prefill_cap = cfg.get("max_prefill_tokens_while_decoding", 0) if self.chunked else 0
        self.requests = sorted(requests, key=lambda r: r["arrival"])  # stable: ties keep list order
        self.aborts = sorted(aborts)
        self.forks = set(forks)  # request ids to fork when they sample their first token
        self.stop_after = {r["id"]: r.get("stop_after") for r in requests}  # output tokens at its EOS
        self.kv = [[None] * self.bs for _ in range(cfg["num_blocks"])] if kv_model else None
        self.queue = []      # mirror of the waiting queue, front first
        self.running = set()
        self.unfinished = set()
        self.meta = {}       # sid -> arrival, priority, fork
        self.first_started = []  # fresh (never forked) requests in first-scheduled order
        self.kept = {}           # preempted sid -> tokens of KV it let go (kept reclaimable)
        self.recomputed = 0      # model of the scheduler's recomputed-token count
        self.resumed = 0         # and of the tokens taken back instead
        self.started = set()
        self.computed_tokens = 0
        self.planned = 0         # tokens planned: the continuous policy's clock
        self.outputs = [0, 0]    # outputs that ended by a stop; tokens of every output that ended (not aborted)
        self.wait_key = {}       # sid -> the continuous policy's waiting key
        self.steps = 0
        self.next_child = 10_000

    # -- workload events --
    def _register(self, sid, fork):
        info = self.s.seq_info(sid)
        assert info["status"] == "waiting"
        self.meta[sid] = dict(arrival=info["arrival"], priority=info["priority"], fork=fork)
        self.unfinished.add(sid)

    def expected_output(self):
        """The mean output length the scheduler expects: tokens seen (running outputs so
        far included) over the outputs that ended by a stop (one cut at its max_tokens is
        censored); None before a stop."""
        if not self.outputs[0]:
            return None
        seen = self.outputs[1]
        for sid in self.running:
            info = self.s.seq_info(sid)
            seen += max(0, info["n_tokens"] - info["n_prompt"])
        return seen / self.outputs[0]

    def add(self, r):
        # its virtual finish: the clock now, its prompt and its expected output
        out, mean = r["max_tokens"], self.expected_output()
        if mean is not None and mean < out:
            out = int(mean) + 1
        self.wait_key[r["id"]] = self.planned + len(r["prompt"]) + out
        self.s.add(r["id"], r["prompt"], r["max_tokens"], r.get("priority", 0))
        self._register(r["id"], fork=False)
        self.queue.append(r["id"])

    def fork(self, parent):
        child = self.next_child
        self.next_child += 1
        self.s.fork(child, parent)
        self._register(child, fork=True)
        self.queue.insert(0, child)
        pinfo, cinfo = self.s.seq_info(parent), self.s.seq_info(child)
        shared = (pinfo["n_prompt"] - 1) // self.bs
        assert cinfo["block_table"] == pinfo["block_table"][:shared]
        assert cinfo["n_computed"] == shared * self.bs

    def finish(self, sid, reason):
        info = self.s.seq_info(sid)
        if info["status"] == "running" and reason != "aborted":
            self.outputs[0] += reason == "stopped"
            self.outputs[1] += info["n_tokens"] - info["n_prompt"]
        self.s.finish(sid, reason)
        self.kept.pop(sid, None)
        assert self.s.seq_info(sid)["status"] == reason
        self.unfinished.discard(sid)
        self.running.discard(sid)
        if sid in self.queue:
            self.queue.remove(sid)

    def victim_key(self, sid):
        m = self.meta[sid]
        if self.policy == "priority":
            return (m["priority"], m["arrival"], sid)
        return (m["arrival"], sid)

    def priority_preemptions(self, pre, running_before, queue_before):
        """1 when the step's first preemption made room for a better-ranked waiting
        sequence (priority policy: the worst running one, ranked strictly below the
        queue's head), which does not stop admissions; else 0."""
        if self.policy != "priority" or not pre or not queue_before or not running_before:
            return 0
        worst = max(running_before, key=self.victim_key)
        head = queue_before[0]
        return int(pre[0] == worst and self.meta[worst]["priority"] > self.meta[head]["priority"])

    def ordered_queue(self):
        if self.policy == "priority":
            return sorted(self.queue, key=lambda sid: order_key(self.meta[sid], sid))
        if self.policy == "continuous":  # preempted and forks first, then the fresh by virtual finish
            fresh = [sid for sid in self.queue if sid not in self.started and not self.meta[sid]["fork"]]
            rest = [sid for sid in self.queue if sid not in fresh]
            return rest + sorted(fresh, key=lambda sid: (self.wait_key[sid], self.meta[sid]["arrival"], sid))
        return list(self.queue)

    # -- one step --
    def step(self):
        s = self.s
        before = {sid: s.seq_info(sid) for sid in self.unfinished}
        running_before = set(self.running)
        queue_before = self.ordered_queue()
        plan = s.schedule()
        ids, new, start = plan["seq_ids"], plan["num_new_tokens"], plan["start_pos"]
        pre = plan["preempted"]

        # budget, cap, sane plan
        assert plan["total_tokens"] == sum(new) <= self.budget
        assert len(ids) <= self.cap and len(set(ids)) == len(ids)
        assert not set(ids) & set(pre)
        for sid, n, p, table in zip(ids, new, start, plan["block_tables"]):
            b = before[sid]
            assert n >= 1 and p + n <= b["n_tokens"]
            if sid in running_before:
                assert p == b["n_computed"]
            else:  # admitted: after its prefix-cache hits, a fork's shared blocks or its own kept KV
                assert p % self.bs == 0 or p <= self.kept.get(sid, 0)
            assert len(table) * self.bs >= p + n
        for sid in admitted_now(s, before):
            # resumed this step: it took back up to what it let go, the rest is recomputed
            if sid in self.kept and s.seq_info(sid)["status"] == "running":
                p = start[ids.index(sid)] if sid in ids else s.seq_info(sid)["n_computed"]
                old = self.kept.pop(sid)
                self.recomputed += old - min(p, old)
                self.resumed += min(p, old)
        for sid in pre:  # static admits its batch first, so it may preempt a new member
            assert sid in running_before or (self.policy == "static" and not running_before)
            info = s.seq_info(sid)
            assert info["status"] == "waiting" and info["n_computed"] == 0 and info["block_table"] == []
            if sid in running_before:  # it keeps all the KV it had
                assert info["kept_computed"] == before[sid]["n_computed"]
            else:  # admitted (taking back KV: its own or cached) and preempted again in the same step
                old, back = self.kept.pop(sid, 0), info["kept_computed"]
                self.recomputed += old - min(back, old)
                self.resumed += min(back, old)
            self.kept[sid] = info["kept_computed"]

        # admission order: the admitted are a prefix of the waiting queue
        n_prio = self.priority_preemptions(pre, running_before, queue_before)
        if self.policy == "static":
            admitted = []
            if not running_before:
                admitted = queue_before[: self.cap]
                for sid in admitted:
                    assert sid in pre or s.seq_info(sid)["status"] == "running"
            assert all(sid in running_before or sid in admitted for sid in ids)
        else:
            admitted = [sid for sid in ids if sid not in running_before]
            assert admitted == queue_before[: len(admitted)]
            k = len(ids) - len(admitted)
            assert all(sid in running_before for sid in ids[:k])  # running ones first
            if len(pre) > n_prio:
                assert not admitted  # no admission in a step that preempted for blocks
        def is_decode(info):
            return info["n_computed"] >= info["n_prompt"] and info["n_tokens"] - info["n_computed"] == 1

        # a priority preemption comes before the step is planned: its victim does not decode in it
        decoding = any(is_decode(before[sid]) for sid in running_before if sid not in pre[:n_prio])
        prefill = sum(n for sid, n in zip(ids, new) if not is_decode(before[sid]))
        capped = self.prefill_cap > 0 and decoding
        if capped:  # stall-free mixed steps: prompt work is capped while sequences decode
            assert prefill <= self.prefill_cap
        if self.chunked and plan["total_tokens"] < self.budget and not (capped and prefill == self.prefill_cap):
            # budget left over: every running sequence got its tokens
            assert running_before <= set(ids) | set(pre)
        for sid in admitted:
            self.queue.remove(sid)
            self.running.add(sid)
            m = self.meta[sid]
            if not m["fork"] and sid not in self.started:
                self.first_started.append(sid)
            self.started.add(sid)
        for sid in pre:  # each to the head, so the last preempted ends up first
            self.running.discard(sid)
            self.queue.insert(0, sid)
        if pre:  # victims are the newest (under priority: lowest priority, then newest)
            key = self.victim_key
            assert all(key(v) > key(r) for v in pre for r in self.running)

        # fake runner over a model of the KV cache
        if self.kv is not None:
            refs = s.block_refcounts()
            for sid, n, p, table in zip(ids, new, start, plan["block_tables"]):
                toks = before[sid]["tokens"] if sid in before else s.seq_info(sid)["tokens"]
                for pos in range(p):  # the context it attends to
                    got = self.kv[table[pos // self.bs]][pos % self.bs]
                    assert got == toks[pos], f"seq {sid} reads wrong KV at {pos}"
                for pos in range(p, p + n):
                    blk = table[pos // self.bs]
                    assert blk != 0 and refs[blk] == 1, f"seq {sid} writes shared block {blk}"
                    self.kv[blk][pos % self.bs] = toks[pos]
        self.computed_tokens += sum(new)
        self.planned += plan["total_tokens"]
        s.commit()

        # sample for every sequence whose tokens are all computed
        for sid in ids:
            info = s.seq_info(sid)
            if info["status"] != "running" or info["n_computed"] != info["n_tokens"]:
                continue
            if sid in self.forks and info["n_tokens"] == info["n_prompt"]:
                self.forks.discard(sid)
                self.fork(sid)
            if info["n_tokens"] < info["max_total"]:
                s.append_token(sid, next_token(sid, info["tokens"]))
            now = s.seq_info(sid)["n_tokens"]
            if now >= info["max_total"]:
                self.finish(sid, "length")
            elif self.stop_after.get(sid) is not None and now - info["n_prompt"] >= self.stop_after[sid]:
                self.finish(sid, "stopped")
        self.steps += 1
        self.check()

    def check(self):
        s = self.s
        s.check()
        refs = [0] * self.cfg["num_blocks"]
        for sid in self.unfinished:
            for b in s.seq_info(sid)["block_table"]:
                refs[b] += 1
        assert s.block_refcounts() == refs
        st = s.stats()
        assert st["n_running"] == len(self.running) <= self.cap
        assert st["n_waiting"] == len(self.queue)
        assert s.num_unfinished() == len(self.unfinished)
        assert st["blocks_used"] + st["blocks_free"] == st["blocks_total"]
        assert 0.0 <= st["kv_waste"] < 1.0 or st["blocks_used"] == 0

    def run(self, max_steps=5000):
        step = ri = ai = 0
        while ri < len(self.requests) or self.unfinished:
            while ri < len(self.requests) and self.requests[ri]["arrival"] <= step:
                self.add(self.requests[ri])
                ri += 1
            while ai < len(self.aborts) and self.aborts[ai][0] <= step:
                live = sorted(self.unfinished)
                if live:
                    self.finish(live[self.aborts[ai][1] % len(live)], "aborted")
                ai += 1
            self.step()
            step += 1
            assert step < max_steps, "no progress: starvation or deadlock"
        st = self.s.stats()
        assert st["blocks_used"] == 0 and st["n_running"] == 0 and st["n_waiting"] == 0
        assert st["n_recomputed_tokens"] == self.recomputed
        assert st["n_resumed_tokens"] == self.resumed
        assert all(r == 0 for r in self.s.block_refcounts())
        return self

    def tokens_of(self, sid):
        return self.s.seq_info(sid)["tokens"]


# ---------------------------------------------------------------- strategies

@st.composite
def workloads(draw):
    policy = draw(st.sampled_from(["continuous", "fcfs", "priority", "static"]))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = 48
    n_req = draw(st.integers(1, 12))
    reqs = []
    for i in range(n_req):
        prefix = draw(st.sampled_from(SHARED_PREFIXES))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10))
        prompt = (prefix + suffix)[: max_model_len - 1]
        max_tokens = draw(st.integers(1, min(12, max_model_len - len(prompt))))
        stop_after = draw(st.one_of(st.none(), st.integers(1, max_tokens)))  # an EOS before max_tokens
        reqs.append(dict(id=i, arrival=draw(st.integers(0, 10)), prompt=prompt,
                         max_tokens=max_tokens, priority=draw(st.integers(0, 2)), stop_after=stop_after))
    need = max(math.ceil((len(r["prompt"]) + r["max_tokens"]) / bs) for r in reqs)
    num_blocks = 1 + need + draw(st.sampled_from([0, 0, 0, 1, 2, 4, 10, 60]))  # tiny: heavy preemption
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 40)) if chunked else max_model_len + draw(st.integers(0, 16))
    cfg = dict(num_blocks=num_blocks, block_size=bs, max_num_seqs=draw(st.integers(1, 6)),
               max_num_batched_tokens=budget, max_model_len=max_model_len,
               enable_prefix_caching=draw(st.sampled_from([True, True, False])), enable_chunked_prefill=chunked,
               policy=policy, max_prefill_tokens_while_decoding=draw(st.sampled_from([0, 0, 1, 3, 8])),
               admission_reserve=draw(st.sampled_from([-1, -1, 0, 25, 300])))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), max_size=3))
    forks = draw(st.lists(st.integers(0, n_req - 1), max_size=2, unique=True))
    return cfg, reqs, aborts, forks


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants(w):
    cfg, reqs, aborts, forks = w
    d = Driver(cfg, reqs, aborts, forks).run()
    st = d.s.stats()
    event(f"policy {cfg['policy']}")
    event("preempted" if st["n_preempted_total"] else "no preemption")
    event("prefix hits" if st["prefix_hits"] else "no prefix hits")
    event("resumed with kept KV" if st["n_resumed_tokens"] else "no kept KV taken back")
    event("recomputed after preemption" if st["n_recomputed_tokens"] else "nothing recomputed")
    event("forked" if d.next_child > 10_000 else "no fork")
    if cfg["policy"] in ("fcfs", "static"):
        # fresh requests start in arrival order (preempted ones resume ahead of them)
        arrival = {sid: d.meta[sid]["arrival"] for sid in d.first_started}
        assert d.first_started == sorted(d.first_started, key=arrival.get)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30), st.sampled_from([1, 2, 4, 8]))
def test_prefix_caching_changes_no_tokens(suffix, bs):
    """Same workload with the cache on and off: identical outputs, fewer tokens computed."""
    reqs = [dict(id=i, arrival=3 * i, prompt=SHARED_PREFIXES[3] + suffix[: 5 + i], max_tokens=6)
            for i in range(5)]
    out = {}
    for on in (False, True):
        cfg = dict(num_blocks=80, block_size=bs, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=64, enable_prefix_caching=on)
        d = Driver(cfg, reqs).run()
        out[on] = ({r["id"]: d.tokens_of(r["id"]) for r in reqs}, d.computed_tokens, d.s.stats())
    assert out[True][0] == out[False][0]
    assert out[True][1] < out[False][1]
    assert out[True][2]["prefix_hits"] > 0
    assert out[False][2]["prefix_hits"] == 0


# ------------------------------------------------------------ direct cases

def advance(s, plan, token=1):
    """After commit: sample for fully computed sequences, finish them at max_tokens."""
    for sid in plan["seq_ids"]:
        info = s.seq_info(sid)
        if info["status"] == "running" and info["n_computed"] == info["n_tokens"]:
            if info["n_tokens"] < info["max_total"]:
                s.append_token(sid, token)
            if s.seq_info(sid)["n_tokens"] >= info["max_total"]:
                s.finish(sid, "length")


def drain(s, limit=1000):
    """Fake runner loop until idle; returns the plans."""
    plans = []
    for _ in range(limit):
        if not s.num_unfinished():
            return plans
        plan = s.schedule()
        s.commit()
        advance(s, plan)
        plans.append(plan)
        s.check()
    raise AssertionError("did not drain")


def test_second_identical_prompt_hits_cache():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64)
    prompt = list(range(2, 20))  # 18 tokens: 4 full blocks + 2
    s.add(1, prompt, 3)
    first = drain(s)
    s.add(2, prompt, 3)
    plan = s.schedule()
    info = s.seq_info(2)
    assert info["n_cached_prompt"] == 16
    assert plan["start_pos"] == [16] and plan["num_new_tokens"] == [2]
    assert sum(first[0]["num_new_tokens"]) == 18
    s.commit()
    st = s.stats()
    assert st["prefix_hits"] == 16 and st["prefix_queries"] == 36


def test_whole_prompt_cached_still_computes_last_block():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64)
    prompt = list(range(16))  # exactly 4 blocks
    s.add(1, prompt, 2)
    drain(s)
    s.add(2, prompt, 2)
    plan = s.schedule()
    assert plan["start_pos"] == [12] and plan["num_new_tokens"] == [4]
    assert s.seq_info(2)["n_cached_prompt"] == 12


def test_prefix_caching_off_gives_no_hits():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64, enable_prefix_caching=False)
    prompt = list(range(18))
    s.add(1, prompt, 2)
    drain(s)
    s.add(2, prompt, 2)
    plan = s.schedule()
    assert plan["start_pos"] == [0] and plan["num_new_tokens"] == [18]
    assert s.seq_info(2)["n_cached_prompt"] == 0
    assert s.stats()["prefix_hits"] == 0 and s.stats()["blocks_cached_free"] == 0


def test_cached_blocks_evicted_lru_and_prefix_last():
    """A freed prefix stays reusable until the pool needs its blocks; its tail goes first."""
    s = Scheduler(num_blocks=9, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=32)
    a = list(range(100, 117))  # 17 tokens: 4 full blocks + 1
    s.add(1, a, 1)
    drain(s)
    assert s.stats()["blocks_cached_free"] == 4
    s.add(2, [7] * 13, 1)  # 4 blocks: takes the 4 never-cached ones first
    drain(s)
    s.add(3, a, 1)
    plan = s.schedule()
    assert s.seq_info(3)["n_cached_prompt"] == 16  # a's prefix survived
    s.commit()
    advance(s, plan)
    drain(s)
    s.add(4, [9] * 25, 1)  # 7 blocks: must evict; a's tail blocks go before its head
    drain(s)
    s.add(5, a, 1)
    s.schedule()
    # 7 of the 8 blocks went to seq 4: the never-cached one, seq 2's three, then
    # a's tail three; a's leading block, freed last, survived
    assert s.seq_info(5)["n_cached_prompt"] == 4


def _decode_step(s, token: int = 0):
    """One step: schedule, commit, and a new token for every sequence past its prompt."""
    plan = s.schedule()
    s.commit()
    for sid in plan["seq_ids"]:
        info = s.seq_info(sid)
        if info["n_computed"] == info["n_tokens"]:
            s.append_token(sid, token)
    return plan


def test_chunked_prefill_interleaves_with_decodes():
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                  max_model_len=128)
    for i in range(3):
        s.add(i, [i + 1] * 5, 50)
    for _ in range(3):  # prefill them, then they decode
        _decode_step(s, 1)
    assert all(s.seq_info(i)["status"] == "running" for i in range(3))
    s.add(99, list(range(60)), 4)  # a long prompt: 60 tokens, budget 16
    chunks = []
    while s.seq_info(99)["n_computed"] < 60:
        plan = s.schedule()
        got = dict(zip(plan["seq_ids"], plan["num_new_tokens"]))
        assert all(got.get(i) == 1 for i in range(3)), got  # every decode keeps its token
        chunks.append(got.get(99, 0))
        assert plan["total_tokens"] <= 16
        s.commit()
        for sid in plan["seq_ids"]:
            info = s.seq_info(sid)
            if info["n_computed"] == info["n_tokens"]:
                s.append_token(sid, 1)
        s.check()
    assert sum(chunks) == 60 and max(chunks) == 13 and len(chunks) >= 5


def _decode_steps(s, steps):
    """Runs `steps` plans with a fake runner that samples token 1; returns the plans."""
    plans = []
    for _ in range(steps):
        plan = s.schedule()
        s.commit()
        for sid in plan["seq_ids"]:
            info = s.seq_info(sid)
            if info["n_computed"] == info["n_tokens"]:
                s.append_token(sid, 1)
        s.check()
        plans.append(plan)
    return plans


@pytest.mark.parametrize("cap", [1, 7, 32])
def test_prefill_capped_while_sequences_decode(cap):
    # 16 sequences decode; a 300-token prompt arrives. Budget 512 would take it in one
    # step; with the cap no step carries more than `cap` prompt tokens, and every
    # decode keeps its token each step.
    s = Scheduler(num_blocks=1600, block_size=4, max_num_seqs=32, max_num_batched_tokens=512,
                  max_model_len=512, max_prefill_tokens_while_decoding=cap)
    for i in range(16):
        s.add(i, [i % 5 + 1] * 6, 310)
    first = _decode_steps(s, 1)[0]  # nothing decodes yet: the prompts are not capped
    assert sorted(first["seq_ids"]) == list(range(16)) and first["total_tokens"] == 96
    s.add(99, [(t * 7) % 5 for t in range(300)], 4)
    steps = 0
    while s.seq_info(99)["n_computed"] < 300:
        plan = _decode_steps(s, 1)[0]
        got = dict(zip(plan["seq_ids"], plan["num_new_tokens"]))
        assert all(got.get(i) == 1 for i in range(16)), got
        assert got.get(99, 0) <= cap
        steps += 1
    assert steps == -(-300 // cap)


def test_prefill_cap_off_without_decodes_and_when_zero():
    # Nothing decodes: prompts take the whole budget. Cap 0: no cap at all.
    for cap, want in ((4, 100), (0, 100)):
        s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=128,
                      max_model_len=256, max_prefill_tokens_while_decoding=cap)
        s.add(1, [1] * 100, 4)
        assert s.schedule()["num_new_tokens"] == [want]
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=128,
                  max_model_len=256, max_prefill_tokens_while_decoding=0)
    s.add(1, [1] * 5, 50)
    _decode_steps(s, 1)
    s.add(2, [2] * 100, 4)
    assert s.schedule()["num_new_tokens"] == [1, 100]
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        Scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=128,
                  max_model_len=256, max_prefill_tokens_while_decoding=-1)


def test_chunked_prefill_off_waits_for_room():
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=64, enable_chunked_prefill=False)
    s.add(1, [1] * 40, 5)
    s.add(2, [2] * 40, 5)
    plan = s.schedule()
    assert plan["seq_ids"] == [1] and plan["num_new_tokens"] == [40]  # 2 does not fit the rest
    s.commit()
    s.append_token(1, 3)
    plan = s.schedule()
    assert plan["seq_ids"] == [1, 2] and plan["num_new_tokens"] == [1, 40]


def test_refusals_say_why():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(num_blocks=10, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(num_blocks=1, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(num_blocks=10, block_size=0, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64)
    with pytest.raises(ValueError, match="policy"):
        Scheduler(10, 4, 2, 16, 64, policy="lottery")
    s = Scheduler(num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                  max_model_len=64)
    with pytest.raises(ValueError, match=r"max_model_len 64") as e:
        s.add(1, [1] * 60, 10)
    assert "70" in str(e.value)
    with pytest.raises(ValueError, match=r"more blocks than the whole cache.*4 usable"):
        s.add(2, [1] * 10, 10)  # 20 tokens = 5 blocks of 4 > 4
    with pytest.raises(ValueError, match="empty"):
        s.add(3, [], 3)
    s.add(4, [1] * 10, 6)  # exactly 4 blocks: fine
    with pytest.raises(ValueError, match="already exists"):
        s.add(4, [1], 1)
    assert s.num_unfinished() == 1
    s.check()


def test_fork_shares_prompt_blocks():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64)
    s.add(1, list(range(10)), 5)  # blocks: [0..3] [4..7] [8, 9]
    s.schedule()
    s.commit()
    s.append_token(1, 42)
    s.fork(2, 1)
    parent, child = s.seq_info(1), s.seq_info(2)
    assert child["block_table"] == parent["block_table"][:2]
    refs = s.block_refcounts()
    assert [refs[b] for b in parent["block_table"]] == [2, 2, 1]
    assert child["n_computed"] == 8 and child["status"] == "waiting"
    s.check()
    plan = s.schedule()
    got = dict(zip(plan["seq_ids"], zip(plan["start_pos"], plan["num_new_tokens"])))
    assert got[2] == (8, 2)  # only the tail of the prompt
    assert got[1] == (10, 1)
    s.commit()
    s.check()
    s.abort(1)
    assert [s.block_refcounts()[b] for b in parent["block_table"][:2]] == [1, 1]
    s.abort(2)
    assert all(r == 0 for r in s.block_refcounts())
    s.check()


def test_fork_when_prompt_ends_on_block_boundary():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64)
    s.add(1, list(range(8)), 5)  # exactly 2 blocks: the child shares only the first
    s.schedule()
    s.commit()
    s.fork(2, 1)
    assert s.seq_info(2)["n_computed"] == 4
    plan = s.schedule()
    assert dict(zip(plan["seq_ids"], plan["num_new_tokens"]))[2] == 4


def test_static_waits_for_the_whole_batch():
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=64, policy="static")
    s.add(1, [1] * 4, 1)
    s.add(2, [2] * 4, 8)
    s.add(3, [3] * 4, 1)
    plan = s.schedule()
    assert plan["seq_ids"] == [1, 2]
    s.commit()
    s.append_token(1, 0)
    s.finish(1, "length")
    s.append_token(2, 0)
    for _ in range(3):  # a slot is free, but 3 waits for the batch to finish
        plan = s.schedule()
        assert plan["seq_ids"] == [2]
        s.commit()
        s.append_token(2, 0)
    s.finish(2, "stopped")
    assert s.schedule()["seq_ids"] == [3]


def test_continuous_fills_freed_slot_at_once():
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                  max_model_len=64)
    s.add(1, [1] * 4, 1)
    s.add(2, [2] * 4, 8)
    s.add(3, [3] * 4, 8)
    assert s.schedule()["seq_ids"] == [1, 2]
    s.commit()
    s.append_token(1, 0)
    s.finish(1, "length")
    s.append_token(2, 0)
    plan = s.schedule()
    assert plan["seq_ids"] == [2, 3] and plan["num_new_tokens"] == [1, 4]


@pytest.mark.parametrize("policy", ["continuous", "fcfs"])
def test_requests_arriving_together_start_shortest_first(policy):
    """The default policy starts the least expected work first (prompt + max_tokens before
    any output ended), which brings the median completion forward; fcfs keeps arrival order."""
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=64, policy=policy)
    work = {1: (8, 20), 2: (4, 2), 3: (4, 30), 4: (12, 1), 5: (4, 10)}  # sid: (prompt, max_tokens)
    for sid, (p, m) in work.items():
        s.add(sid, [sid] * p, m)
    order = []
    while s.num_unfinished():
        plan = s.schedule()
        s.commit()
        sid = plan["seq_ids"][0]
        if not order or order[-1] != sid:
            order.append(sid)
        s.append_token(sid, 0)
        info = s.seq_info(sid)
        if info["n_tokens"] >= info["max_total"]:
            s.finish(sid, "length")
        s.check()
    if policy == "fcfs":
        assert order == [1, 2, 3, 4, 5]
    else:
        assert order == sorted(work, key=lambda sid: (sum(work[sid]), sid)) == [2, 4, 5, 1, 3]


def test_long_request_waits_at_most_its_own_work_behind_later_arrivals():
    """A stream of short requests passes a long one only while they arrive within the
    long one's expected work of it (on the clock of tokens planned): it is never starved."""
    s = Scheduler(num_blocks=400, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=64)
    s.add(0, [9] * 4, 40)  # work 44
    planned, nxt, started_at = 0, 1, None
    for _ in range(400):
        s.add(nxt, [nxt % 7] * 4, 1)  # one short request (work 5) arrives every step
        nxt += 1
        plan = s.schedule()
        s.commit()
        if 0 in plan["seq_ids"]:
            started_at = planned
            break
        planned += plan["total_tokens"]
        for sid in plan["seq_ids"]:
            s.append_token(sid, 0)
            s.finish(sid, "length")
        s.check()
    assert started_at is not None, "the long request starved"
    # it is passed only by requests that arrived before the clock reached its key (44)
    assert 0 < started_at <= 44 + 5


def test_priority_policy_admits_by_priority():
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=64, policy="priority")
    s.add(1, [1] * 4, 1, priority=5)
    s.add(2, [2] * 4, 1, priority=0)
    s.add(3, [3] * 4, 1, priority=5)
    order = []
    for _ in range(3):
        plan = s.schedule()
        order += plan["seq_ids"]
        s.commit()
        for sid in plan["seq_ids"]:
            s.finish(sid, "length")
    assert order == [2, 1, 3]


def test_priority_policy_preempts_a_worse_running_sequence_for_a_better_waiting_one():
    s = Scheduler(num_blocks=200, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=64, policy="priority")
    s.add(1, [1] * 4, 40, priority=5)
    for _ in range(3):
        assert _decode_step(s)["seq_ids"] == [1]
    s.add(2, [2] * 4, 40, priority=5)  # equal priority: waits for the seat
    plan = _decode_step(s)
    assert plan["seq_ids"] == [1] and plan["preempted"] == []
    s.add(3, [3] * 4, 40, priority=0)  # better: takes the only seat
    plan = _decode_step(s)
    assert plan["preempted"] == [1] and plan["seq_ids"] == [3]  # in the same step
    info = s.seq_info(1)
    assert info["status"] == "waiting" and info["n_computed"] == 0 and info["n_preemptions"] == 1
    s.finish(3, "length")
    # then the preempted one (earlier arrival) before the other priority-5 one
    assert _decode_step(s)["seq_ids"] == [1]
    s.check()


def test_preemption_newest_first_and_lone_sequence_progresses():
    # 6 usable blocks of 2 tokens; two sequences that will each need 6.
    s = Scheduler(num_blocks=7, block_size=2, max_num_seqs=2, max_num_batched_tokens=32,
                  max_model_len=12, admission_reserve=-1)  # no margin: both start
    s.add(1, [1, 2, 3], 9)
    s.add(2, [4, 5, 6], 9)
    preempted = []
    for _ in range(200):
        if not s.num_unfinished():
            break
        plan = s.schedule()
        preempted += plan["preempted"]
        s.commit()
        for sid in plan["seq_ids"]:
            info = s.seq_info(sid)
            if info["n_computed"] == info["n_tokens"]:
                s.append_token(sid, 0)
                if info["n_tokens"] + 1 == info["max_total"]:
                    s.finish(sid, "length")
        s.check()
    assert s.num_unfinished() == 0
    assert preempted and preempted[0] == 2  # the newer one goes first
    assert s.seq_info(1)["n_preemptions"] == 0
    assert s.seq_info(2)["n_preemptions"] >= 1


def test_lone_sequence_gets_blocks_held_by_waiting_fork():
    """A waiting fork holding blocks must not starve a lone running sequence."""
    s = Scheduler(num_blocks=7, block_size=4, max_num_seqs=2, max_num_batched_tokens=4,
                  max_model_len=24, policy="priority")
    s.add(1, [5] * 9, 1)
    for _ in range(3):  # chunks 4 + 4 + 1
        s.schedule()
        s.commit()
    s.fork(2, 1)
    s.abort(1)  # the fork alone holds 2 blocks now, waiting
    assert s.stats()["blocks_used"] == 2
    s.add(3, [6] * 20, 4, priority=-1)  # needs all 6 usable blocks; admitted before the fork
    drain(s)
    assert s.seq_info(3)["status"] == "length" and s.seq_info(3)["n_preemptions"] == 0
    assert s.seq_info(2)["status"] == "length"


def test_waiting_fork_does_not_block_the_queue_head():
    """Nothing running, the head waits for blocks a waiting fork holds: release them."""
    s = Scheduler(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                  max_model_len=20, enable_prefix_caching=False, admission_reserve=-1)
    s.add(1, [5] * 9, 3)   # P: 3 blocks
    s.add(2, [6] * 18, 2)  # X: first chunk of 7 takes the last 2 blocks
    plan = s.schedule()
    assert plan["num_new_tokens"] == [9, 7]
    s.commit()
    s.append_token(1, 0)
    s.fork(3, 1)  # C shares P's first 2 blocks and waits
    plan = s.schedule()
    assert plan["preempted"] == [2]  # X needs 3 more blocks, none free: it is the newest
    s.commit()
    s.abort(1)  # C alone holds 2 blocks; X (at the head) needs 4 for its next chunk of 16
    assert s.stats()["n_running"] == 0 and s.stats()["blocks_used"] == 2
    drain(s)
    assert s.seq_info(2)["status"] == "length" and s.seq_info(3)["status"] == "length"


def test_finish_in_any_state_frees_blocks():
    s = Scheduler(num_blocks=20, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                  max_model_len=64)
    s.add(1, [1] * 9, 3)
    s.add(2, [2] * 9, 3)
    s.schedule()
    s.commit()
    s.abort(2)  # waiting
    s.abort(1)  # running
    s.abort(1)  # already finished: no-op
    assert s.seq_info(1)["status"] == "aborted"
    assert s.num_unfinished() == 0 and s.stats()["blocks_used"] == 0
    s.check()


def test_kv_waste_counts_shared_blocks_once():
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64)
    s.add(1, list(range(9)), 5)  # 9 tokens: 3 blocks, 3 empty slots
    s.schedule()
    s.commit()
    st = s.stats()
    assert st["blocks_used"] == 3 and st["tokens_in_kv"] == 9
    assert st["kv_waste"] == pytest.approx(1 - 9 / 12)
    s.add(2, list(range(9)), 5)  # shares 2 cached blocks, adds 1
    s.schedule()
    s.commit()
    st = s.stats()
    assert st["blocks_used"] == 4  # 2 shared + one tail block each
    assert st["tokens_in_kv"] == 10 and st["kv_waste"] == pytest.approx(1 - 10 / 16)


def test_plan_must_be_committed():
    s = Scheduler(10, 4, 2, 16, 32)
    with pytest.raises(RuntimeError):
        s.commit()
    s.add(1, [1, 2], 2)
    s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    with pytest.raises(ValueError, match="uncomputed"):
        s.append_token(1, 5)
    s.commit()
    s.append_token(1, 5)
    with pytest.raises(KeyError):
        s.seq_info(77)


def test_many_waiting_step_is_cheap_and_correct():
    """100k waiting behind a full running set: the plan touches only the running."""
    s = Scheduler(num_blocks=1 + 64 * 10, block_size=16, max_num_seqs=64,
                  max_num_batched_tokens=256, max_model_len=256)
    for i in range(20_000):
        s.add(i, [i % 7 + 1] * 8, 100)
    plans = s.bench_steps(5)
    assert len(plans) == 5
    st = s.stats()
    assert st["n_running"] == 64 and st["n_waiting"] == 20_000 - 64
    s.check()


def test_step_cost_model_recovers_a_linear_step_time_and_its_knee():
    """The engine's step-time model: steps timed as A + B_d * decodes + B_p * prompt tokens
    give back A, B_d and B_p, and the knee batch 4 * A / B_d (80% of the decode rate limit)."""
    from conveyor._testing import step_cost_knee

    A, Bd, Bp = 9e-3, 1.4e-3, 1.0e-3
    rows = [(d, p, A + Bd * d + Bp * p) for d, p in [(1 + i % 30, (i * 37) % 300 if i % 3 else 0)
                                                       for i in range(200)]]
    knee, fit = step_cost_knee(rows, 256)
    assert fit == pytest.approx((A, Bd, Bp, 0.0), rel=1e-6, abs=1e-12)  # no contexts given: no context term
    assert knee == math.ceil(4 * A / Bd) == 26
    assert step_cost_knee(rows, 16)[0] == 16  # never beyond the cap
    # decode-only steps (no prompt work): the two-term fit
    knee, fit = step_cost_knee([(d, 0, A + Bd * d) for d in range(1, 40)], 256)
    assert knee == 26 and fit[:2] == pytest.approx((A, Bd), rel=1e-6)
    # a decode's cost grows with the context it attends to: the knee is taken at the
    # contexts of the last step (B_d + B_c * context per decode)
    Bd0, Bc = 0.8e-3, 0.6e-3  # per decode, per kilo-token of its context
    ctx_rows = [(d, p, A + Bd0 * d + Bp * p + Bc * d * c / 1024, d * c)
                for d, p, c in [(1 + i % 30, (i * 37) % 300 if i % 3 else 0, 100 + (i * 53) % 900)
                                for i in range(200)]]
    knee, fit = step_cost_knee(ctx_rows, 256)
    assert fit == pytest.approx((A, Bd0, Bp, Bc), rel=1e-6)
    last_ctx = ctx_rows[-1][3] / ctx_rows[-1][0] / 1024
    assert knee == math.ceil(4 * A / (Bd0 + Bc * last_ctx))
    # not enough steps, or no spread in the decode count: no knee
    assert step_cost_knee(rows[:5], 256) == (None, None)
    assert step_cost_knee([(8, p, A + Bd * 8 + Bp * p) for p in range(100)], 256) == (None, None)
    # a step time that does not grow with the batch (memory-bound): no knee below the cap
    assert step_cost_knee([(d, 0, 0.02 + 1e-7 * d) for d in range(1, 60)], 256)[0] == 256


def noisy_steps(rng, decodes, prompts, A=9e-3, Bd=1.4e-3, Bp=1.0e-3, noise=0.03, contexts=None, Bc=0.0):
    """Steps timed A + B_d d + B_p p + B_c (d c / 1024) with relative noise; c: each
    step's context per decode (none: no context term)."""
    cs = contexts if contexts is not None else np.zeros(len(decodes))
    return [(int(d), int(p), (A + Bd * d + Bp * p + Bc * d * c / 1024) * (1 + noise * rng.standard_normal()),
             int(d * c)) for d, p, c in zip(decodes, prompts, cs)]


def test_step_cost_knee_waits_for_a_batch_of_another_size_and_one_held_back_step_in_eight_gives_it():
    """A batch that sits at one size (as while a long queue keeps it full) cannot tell the
    fixed cost of a step from the cost of each row, whatever the prompt work beside it: with
    3% timing noise the model gives no knee. The engine then holds back half of every eighth
    step's decodes; with those steps in the record the knee comes out near 4 * A / B_d."""
    from conveyor._testing import step_cost_knee

    rng = np.random.default_rng(0)
    n = 120
    steady_d = 56 + rng.integers(-1, 2, n)
    prompts = np.where(np.arange(n) % 5 == 0, rng.integers(0, 600, n), 0)
    assert step_cost_knee(noisy_steps(rng, steady_d, prompts), 256)[0] is None
    probed_d = np.where(np.arange(n) % 8 == 7, steady_d // 2, steady_d)
    hits = []
    for seed in range(10):
        knee, fit = step_cost_knee(noisy_steps(np.random.default_rng(seed), probed_d, prompts), 256)
        assert knee is not None
        hits.append(knee)
    assert 26 * 0.8 <= np.median(hits) <= 26 * 1.2, hits
    # the same batch while every context grows (one wave of sequences decoding together):
    # the context term takes the growth, and the knee is that of the contexts now
    Bd0, Bc = 1.0e-3, 2.0e-3
    growing = 128 + np.arange(n) * 1.0
    truth = math.ceil(4 * 9e-3 / (Bd0 + Bc * growing[-1] / 1024))
    hits = []
    for seed in range(10):
        rows = noisy_steps(np.random.default_rng(seed), probed_d, prompts, Bd=Bd0, Bc=Bc, contexts=growing, noise=0.02)
        knee, fit = step_cost_knee(rows, 256)
        assert knee is not None
        hits.append(knee)
    assert truth * 0.8 <= np.median(hits) <= truth * 1.2, (truth, hits)


def test_limit_next_decodes_holds_back_decodes_for_one_step_only():
    """The engine's probe: one step plans at most n decodes, the rest wait that step (no
    preemption, nothing lost), the next plans them all; prompt work is not limited."""
    s = Scheduler(num_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=512,
                  max_model_len=64)
    for sid in range(12):
        s.add(sid, [1, 2, 3, 4], 20)

    def step():
        plan = s.schedule()
        s.commit()
        advance(s, plan)
        s.check()
        return plan

    step()  # the prompts
    assert s.stats()["n_running"] == 12
    s.add(99, [4, 3, 2, 1, 4, 3, 2, 1], 20)
    s.limit_next_decodes(5)
    plan = step()
    assert sorted(plan["seq_ids"]) == [0, 1, 2, 3, 4, 99]  # the oldest five decode, the prompt runs
    assert s.stats()["n_held_back_steps"] == 1 and s.stats()["n_preempted_total"] == 0
    plan = step()
    assert sorted(plan["seq_ids"]) == list(range(12)) + [99]  # all of them again
    assert s.stats()["n_held_back_steps"] == 1
    assert {s.seq_info(sid)["n_tokens"] for sid in range(5)} == {7}
    assert {s.seq_info(sid)["n_tokens"] for sid in range(5, 12)} == {6}


def test_running_target_stops_admissions_but_not_a_lone_request():
    s = Scheduler(num_blocks=400, block_size=4, max_num_seqs=8, max_num_batched_tokens=256,
                  max_model_len=64)
    for sid in range(6):
        s.add(sid, [sid] * 4, 4)
    s.set_running_target(2)
    assert s.stats()["running_target"] == 2
    assert sorted(s.schedule()["seq_ids"]) == [0, 1]
    s.commit()
    s.set_running_target(0)  # no target: max_num_seqs again
    assert s.stats()["running_target"] == 8
    for sid in (0, 1):
        s.append_token(sid, 0)
    assert sorted(s.schedule()["seq_ids"]) == list(range(6))
