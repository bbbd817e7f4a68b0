"""KV manager: its operations against a Python model of the block accounting.

The model is written from the documented rules alone (kv_manager.h and
block_pool.h): blocks 1..n-1 start free in order; allocation takes the head
of the free queue, evicting the cached prefix it may hold; a block whose last
reference goes returns to the tail when it holds a cached prefix (LRU
eviction) and to the head otherwise; a full, computed, verified block is
registered under (parent key, tokens) unless that content is cached already.
A preempted sequence's blocks of computed KV go to the tail as well, noted
with the generation each had (how many times alloc handed it out); resuming
takes back its leading blocks whose generation is unchanged, or the prefix
cache's blocks when those hold more.
After every random operation the C manager must agree with the model on every
block table, every reference count, the free and cached-free counts, the
prefix hits and the prefix counters, and its own invariant check must pass.
"""
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conveyor._testing import KVManager

VOCAB = 3  # tiny, so blocks repeat inside and across sequences


class Seq:
    def __init__(self, tokens, skip=False):
        self.tokens = list(tokens)
        self.n_prompt = len(tokens)
        self.skip = skip
        self.table = []
        self.n_computed = 0
        self.n_cached = 0  # leading blocks registered in the prefix cache
        self.last_key = 0
        self.n_spec = 0
        self.n_cached_prompt = 0
        self.kept = []  # after a preemption: (block, generation) of its computed KV
        self.kept_computed = 0


class Model:
    """The block accounting, as documented."""

    def __init__(self, num_blocks, bs, caching):
        self.bs, self.caching = bs, caching
        self.free = list(range(1, num_blocks))  # head first
        self.ref = [0] * num_blocks
        self.key = [0] * num_blocks
        self.content = {}  # block -> (parent key, tokens)
        self.cache = {}  # (parent key, tokens) -> block
        self.next_key = 1
        self.touched = set()
        self.gen = [0] * num_blocks
        self.queries = self.hits = 0
        self.last_lookup = None  # (seq, blocks)

    def cached_free(self):
        return sum(1 for b in self.free if self.key[b])

    def alloc(self):
        b = self.free.pop(0)
        if self.key[b]:  # evicted
            del self.cache[self.content.pop(b)]
            self.key[b] = 0
        self.ref[b] = 1
        self.gen[b] += 1
        self.touched.add(b)
        return b

    def incref(self, b):
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1

    def decref(self, b, keep=False):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.key[b] or keep:
                self.free.append(b)
            else:
                self.free.insert(0, b)

    def register(self, b, parent, tokens):
        if self.key[b]:
            return self.key[b]
        other = self.cache.get((parent, tokens))
        if other is not None:
            return self.key[other]
        self.key[b] = self.next_key
        self.next_key += 1
        self.content[b] = (parent, tokens)
        self.cache[(parent, tokens)] = b
        return self.key[b]

    # ---- the KV manager's operations ----

    def allocate(self, q, n):
        if n > len(self.free):
            return False
        if n > 0:
            q.kept, q.kept_computed = [], 0
        q.table += [self.alloc() for _ in range(n)]
        return True

    def free_seq(self, q):
        for b in reversed(q.table):
            self.decref(b)
        q.table, q.n_cached, q.last_key, q.n_computed = [], 0, 0, 0
        q.kept, q.kept_computed = [], 0

    def preempt(self, q):
        keep = min(-(-q.n_computed // self.bs), len(q.table))
        kept = [(b, self.gen[b]) for b in q.table[:keep]]
        for b in reversed(q.table[keep:]):
            self.decref(b)
        for b in reversed(q.table[:keep]):
            self.decref(b, keep=True)
        computed = min(q.n_computed, keep * self.bs)
        q.table, q.n_cached, q.last_key, q.n_computed = [], 0, 0, 0
        q.kept, q.kept_computed = kept, computed

    def lookup_resume(self, q):
        limit = min(q.kept_computed, len(q.tokens) - 1)
        k = 0
        while k * self.bs < limit and k < len(q.kept) and self.gen[q.kept[k][0]] == q.kept[k][1]:
            k += 1
        own = min(k * self.bs, limit)
        if own % self.bs and self.ref[q.kept[own // self.bs][0]] > 0:
            own -= own % self.bs  # never end inside a block another sequence holds
        k = -(-own // self.bs)
        n_cached, cached_free = self.lookup(q)
        if n_cached * self.bs <= own:
            self.last_resume = (q, [b for b, _ in q.kept[:k]], own)
            return own, k, sum(1 for b, _ in q.kept[:k] if self.ref[b] == 0)
        self.last_resume = (q, self.last_lookup[1][:n_cached], n_cached * self.bs)
        return n_cached * self.bs, n_cached, cached_free

    def take_resume(self, q):
        who, blocks, tokens = self.last_resume
        assert who is q
        for b in blocks:
            self.incref(b)
        q.table, q.n_cached, q.last_key, q.n_computed = list(blocks), 0, 0, tokens
        q.kept, q.kept_computed = [], 0
        self.last_lookup = self.last_resume = None
        self.cache_full(q)

    def cache_full(self, q):
        if not self.caching:
            return
        verified = min(q.n_computed, len(q.tokens) - q.n_spec)
        while (q.n_cached + 1) * self.bs <= verified and q.n_cached < len(q.table):
            j = q.n_cached
            q.last_key = self.register(q.table[j], q.last_key, tuple(q.tokens[j * self.bs:(j + 1) * self.bs]))
            q.n_cached += 1

    def lookup(self, q):
        found = []
        if self.caching and not q.skip:
            parent = 0
            for n in range((len(q.tokens) - 1) // self.bs):
                b = self.cache.get((parent, tuple(q.tokens[n * self.bs:(n + 1) * self.bs])))
                if b is None:
                    break
                found.append(b)
                parent = self.key[b]
        self.last_lookup = (q, found)
        return len(found), sum(1 for b in found if self.ref[b] == 0)

    def take(self, q, n):
        if not self.caching:
            return
        found = self.last_lookup[1] if self.last_lookup and self.last_lookup[0] is q else []
        blocks = found[:n]
        q.kept, q.kept_computed = [], 0
        for b in blocks:
            self.incref(b)
        q.table = list(blocks)
        q.n_cached = len(blocks)
        q.last_key = self.key[blocks[-1]] if blocks else 0
        q.n_computed = len(blocks) * self.bs
        self.queries += len(q.tokens)
        self.hits += len(blocks) * self.bs
        q.n_cached_prompt = min(q.n_computed, q.n_prompt)
        self.last_lookup = None

    def fork(self, child, parent):
        shared = min((parent.n_prompt - 1) // self.bs, parent.n_computed // self.bs, len(parent.table))
        for b in parent.table[:shared]:
            self.incref(b)
        child.table = parent.table[:shared]
        child.n_computed = shared * self.bs
        child.n_cached_prompt = child.n_computed
        self.cache_full(child)

    def trim(self, q, n_tokens, n_valid):
        del q.tokens[n_tokens:]
        q.n_spec = 0
        q.n_computed = min(q.n_computed, n_valid, len(q.tokens))
        keep = -(-len(q.tokens) // self.bs)
        for b in reversed(q.table[keep:]):
            self.decref(b)
        del q.table[keep:]
        self.cache_full(q)


def assert_same(kv, m, seqs):
    st = kv.stats()
    assert st["num_free"] == len(m.free)
    assert st["num_cached_free"] == m.cached_free()
    assert st["num_touched"] == len(m.touched)
    assert (st["prefix_queries"], st["prefix_hits"]) == (m.queries, m.hits)
    assert kv.refcounts() == m.ref
    for sid, q in seqs.items():
        info = kv.seq_info(sid)
        assert info["block_table"] == q.table, f"sequence {sid}"
        assert info["tokens"] == q.tokens
        assert info["n_computed"] == q.n_computed
        assert info["n_cached_blocks"] == q.n_cached
        assert info["n_cached_prompt"] == q.n_cached_prompt
        assert (info["n_kept"], info["kept_computed"]) == (len(q.kept), q.kept_computed)
    kv.check()


OPS = ["add", "add", "allocate", "allocate", "compute", "compute", "append", "propose", "free",
       "fork", "trim", "prefix", "preempt", "preempt", "resume", "resume"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_operations_match_the_model(data):
    bs = data.draw(st.sampled_from([1, 2, 3, 4]), label="block_size")
    num_blocks = data.draw(st.integers(2, 24), label="num_blocks")
    caching = data.draw(st.sampled_from([True, True, False]), label="prefix caching")
    kv, m = KVManager(num_blocks, bs, enable_prefix_caching=caching), Model(num_blocks, bs, caching)
    seqs, next_id = {}, 0
    tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14)
    for _ in range(data.draw(st.integers(1, 40), label="operations")):
        op = data.draw(st.sampled_from(OPS))
        if op == "add" or not seqs:
            seqs[next_id] = Seq(data.draw(tokens_st), skip=data.draw(st.sampled_from([False] * 5 + [True])))
            kv.add(next_id, seqs[next_id].tokens, skip_prefix_cache=seqs[next_id].skip)
            next_id += 1
            continue
        if op == "resume":  # a preempted sequence, if any
            pool = sorted(i for i, x in seqs.items() if x.kept and not x.table)
            if not pool:
                continue
        else:
            pool = sorted(seqs)
        sid = data.draw(st.sampled_from(pool))
        q = seqs[sid]
        if op == "allocate":
            n = data.draw(st.integers(0, len(m.free) + 1))
            if m.allocate(q, n):
                kv.allocate(sid, n)
            else:
                with pytest.raises(ValueError, match="free"):
                    kv.allocate(sid, n)
        elif op == "compute":
            room = min(len(q.table) * bs, len(q.tokens)) - q.n_computed
            n = data.draw(st.integers(0, max(room, 0)))
            kv.compute(sid, n)
            q.n_computed += n
            m.cache_full(q)
        elif op in ("append", "propose"):
            new = data.draw(tokens_st)
            kv.append(sid, new, proposals=op == "propose")
            q.tokens += new
            if op == "propose":
                q.n_spec += len(new)
        elif op == "free":
            kv.free(sid)
            m.free_seq(q)
        elif op == "fork":
            kv.fork(next_id, sid)
            child = seqs[next_id] = Seq(q.tokens[: q.n_prompt])
            m.fork(child, q)
            next_id += 1
        elif op == "trim":
            # as after verification: only tokens past the prompt go, and
            # proposals never reach the cache, so neither the tokens kept nor
            # the valid KV cut into the prompt or a cached block
            low = max(q.n_cached * bs, q.n_prompt)
            if low > len(q.tokens):
                continue
            n_tokens = data.draw(st.integers(low, len(q.tokens)))
            n_valid = data.draw(st.integers(low, n_tokens))
            kv.trim(sid, n_tokens, n_valid)
            m.trim(q, n_tokens, n_valid)
        elif op == "prefix":
            if q.table:
                kv.free(sid)
                m.free_seq(q)
            expect = m.lookup(q)
            assert kv.lookup_prefix(sid) == expect
            n = data.draw(st.integers(0, expect[0]))
            kv.take_prefix(sid, n)
            m.take(q, n)
            if n:
                event("prefix hit")
        elif op == "preempt":
            kv.preempt(sid)
            m.preempt(q)
        elif op == "resume":
            expect = m.lookup_resume(q)
            assert kv.lookup_resume(sid) == expect
            kv.take_resume(sid)
            m.take_resume(q)
            event("resumed with kept KV" if expect[0] else "resumed with nothing kept")
        assert_same(kv, m, seqs)
    for sid, q in seqs.items():
        kv.free(sid)
        m.free_seq(q)
    assert_same(kv, m, seqs)
    assert len(m.free) == num_blocks - 1 and all(r == 0 for r in m.ref)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_preempt_and_resume_match_the_model(data):
    """Sequences grow, are preempted and resume while others take blocks: what each
    resume takes back (its own kept blocks not handed out since, or the prefix cache's
    when those hold more) and every count agree with the model."""
    bs = data.draw(st.sampled_from([1, 2, 3, 4]), label="block_size")
    num_blocks = data.draw(st.integers(2, 16), label="num_blocks")
    caching = data.draw(st.booleans(), label="prefix caching")
    kv, m = KVManager(num_blocks, bs, enable_prefix_caching=caching), Model(num_blocks, bs, caching)
    seqs = {}
    tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)
    took_back = 0
    for step in range(data.draw(st.integers(1, 40), label="operations")):
        op = data.draw(st.sampled_from(["add", "grow", "grow", "grow", "append", "preempt", "resume", "resume"]))
        if op == "add" or not seqs:
            sid = len(seqs)
            seqs[sid] = Seq(data.draw(tokens_st))
            kv.add(sid, seqs[sid].tokens)
            continue
        if op == "resume":
            pool = sorted(i for i, x in seqs.items() if x.kept and not x.table)
        elif op == "grow":
            pool = sorted(i for i, x in seqs.items() if not x.kept)
        else:
            pool = sorted(seqs)
        if not pool:
            continue
        sid = data.draw(st.sampled_from(pool))
        q = seqs[sid]
        if op == "grow":  # blocks for some more tokens, as the scheduler plans them, then computed
            n = data.draw(st.integers(0, len(q.tokens) - q.n_computed))
            need = max(0, -(-(q.n_computed + n) // bs) - len(q.table))
            if need > len(m.free):
                continue
            kv.allocate(sid, need)
            m.allocate(q, need)
            kv.compute(sid, n)
            q.n_computed += n
            m.cache_full(q)
        elif op == "append":
            new = data.draw(tokens_st)
            kv.append(sid, new)
            q.tokens += new
        elif op == "preempt":
            kv.preempt(sid)
            m.preempt(q)
        else:
            expect = m.lookup_resume(q)
            assert kv.lookup_resume(sid) == expect
            kv.take_resume(sid)
            m.take_resume(q)
            took_back += expect[0] > 0
        assert_same(kv, m, seqs)
    event("took kept or cached KV back" if took_back else "took nothing back")
    for sid, q in seqs.items():
        kv.free(sid)
        m.free_seq(q)
    assert_same(kv, m, seqs)
    assert len(m.free) == num_blocks - 1


def test_resume_takes_back_what_the_lru_did_not_reuse():
    kv = KVManager(7, 2, enable_prefix_caching=False)  # 6 usable blocks
    kv.add(1, [1, 2, 3, 4, 5, 6, 7])
    kv.allocate(1, 4)
    kv.compute(1, 7)  # 3 full blocks and one holding a token
    kv.preempt(1)
    info = kv.seq_info(1)
    assert info["block_table"] == [] and info["n_kept"] == 4 and info["kept_computed"] == 7
    assert kv.stats()["num_free"] == 6
    assert kv.lookup_resume(1) == (6, 3, 3)  # the last token's KV is computed again (logits need one)
    kv.add(2, [9] * 6)
    kv.allocate(2, 3)  # the 2 never-used blocks, then the head of the kept ones: block 4, its last
    assert kv.seq_info(2)["block_table"] == [5, 6, 4]
    assert kv.lookup_resume(1) == (6, 3, 3)  # block 4 held only position 6, which is recomputed anyway
    kv.allocate(2, 1)  # block 3: positions 4 and 5
    assert kv.lookup_resume(1) == (4, 2, 2)
    kv.take_resume(1)
    info = kv.seq_info(1)
    assert info["block_table"] == [1, 2] and info["n_computed"] == 4 and info["n_kept"] == 0
    kv.check()


def test_prefix_reuse_after_free_and_eviction_order():
    kv = KVManager(5, 2)
    kv.add(1, [1, 2, 3, 4, 5])
    kv.allocate(1, 3)
    kv.compute(1, 5)  # blocks [1, 2] full and cached; block 3 holds one token
    kv.free(1)
    st = kv.stats()
    assert st["num_free"] == 4 and st["num_cached_free"] == 2
    kv.add(2, [1, 2, 3, 4, 9])
    assert kv.lookup_prefix(2) == (2, 2)  # both cached blocks, both free
    kv.take_prefix(2, 2)
    info = kv.seq_info(2)
    assert info["block_table"] == [1, 2] and info["n_computed"] == 4 and info["n_cached_prompt"] == 4
    assert kv.stats()["prefix_hits"] == 4
    kv.free(2)
    # the uncached blocks come first; the cached prefix is evicted last, leading block last of all
    kv.add(3, [0, 0, 0, 0, 0, 0, 0, 0])
    kv.allocate(3, 2)
    assert kv.seq_info(3)["block_table"] == [3, 4]
    kv.allocate(3, 1)
    assert kv.seq_info(3)["block_table"] == [3, 4, 2]  # the tail block of the prefix goes first
    kv.add(4, [1, 2, 7])
    assert kv.lookup_prefix(4) == (1, 1)  # block 1 still cached
    kv.check()


def test_fork_shares_computed_prompt_blocks_and_trim_returns_the_tail():
    kv = KVManager(10, 2)
    kv.add(1, [1, 2, 3, 4, 5, 6])
    kv.allocate(1, 3)
    kv.compute(1, 6)
    kv.fork(2, 1)
    child = kv.seq_info(2)
    # the block of the last prompt token is recomputed by the child
    assert child["block_table"] == [1, 2] and child["n_computed"] == 4
    assert kv.refcounts()[1:4] == [2, 2, 1]
    kv.append(1, [7, 8, 9], proposals=True)
    kv.allocate(1, 2)
    kv.compute(1, 3)
    assert kv.seq_info(1)["n_cached_blocks"] == 3  # no block holding a proposal is cached
    kv.trim(1, 7, 6)  # one proposal accepted, its KV not yet valid
    info = kv.seq_info(1)
    assert info["block_table"] == [1, 2, 3, 4] and info["n_computed"] == 6 and info["n_tokens"] == 7
    assert kv.stats()["num_free"] == 9 - 4
    kv.check()


def test_allocate_beyond_the_free_blocks_takes_nothing():
    kv = KVManager(4, 4)
    kv.add(1, [1])
    with pytest.raises(ValueError, match="4 blocks asked, 3 free"):
        kv.allocate(1, 4)
    assert kv.seq_info(1)["block_table"] == [] and kv.stats()["num_free"] == 3
    with pytest.raises(ValueError, match="num_blocks"):
        KVManager(1, 4)
    with pytest.raises(ValueError, match="block_size"):
        KVManager(4, 0)
