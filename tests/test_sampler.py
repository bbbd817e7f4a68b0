"""The sampler (csrc/core/sampler.c) through conveyor._testing.sample / process_logits.

A numpy reference of the documented semantics (vLLM / OpenAI) is the oracle:
logprobs from the raw logits; repetition, frequency, presence penalties; bans;
temperature; top_k, top_p, min_p; one uniform draw per token inverted over the
surviving tokens in increasing id order.
"""
import math

import numpy as np
import pytest

from conveyor import _testing

NEG_INF = -np.inf


# ---- numpy reference ------------------------------------------------------

def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def ref_penalize(logits, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 prompt=(), output=(), banned=()):
    """Penalties in float32, the same operations in the same order as the C code."""
    l = np.array(logits, np.float32)
    l[np.isnan(l)] = -np.inf
    l[l == np.inf] = np.finfo(np.float32).max
    rep = np.float32(repetition_penalty)
    if rep != 1:
        for t in set(prompt) | set(output):
            l[t] = l[t] / rep if l[t] > 0 else l[t] * rep
    if frequency_penalty or presence_penalty:
        counts = {}
        for t in output:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            l[t] = l[t] - np.float32(frequency_penalty) * np.float32(c)
            l[t] = l[t] - np.float32(presence_penalty)
    for t in banned:
        l[t] = -np.inf
    return l


def ref_support(l, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Boolean mask of the tokens a draw may pick, and their probabilities (float64)."""
    l = np.asarray(l, np.float64)
    v = len(l)
    ids = np.arange(v)
    finite = l > -np.inf
    x = np.where(finite, l / np.float64(np.float32(temperature)), -np.inf)
    keep = finite.copy()
    if 0 < top_k < v:
        order = np.lexsort((ids, -l))  # largest logit first, lower id on ties
        mask = np.zeros(v, bool)
        mask[order[:top_k]] = True
        keep &= mask
    w = np.where(keep, np.exp(x - np.max(x[keep])), 0.0)
    top_p = float(np.float32(top_p))
    if top_p < 1:
        order = np.lexsort((ids, -w))
        cum = np.cumsum(w[order]) / np.sum(w)
        n = int(np.searchsorted(cum, top_p)) + 1  # first prefix whose mass >= top_p
        mask = np.zeros(v, bool)
        mask[order[:n]] = True
        keep &= mask
    min_p = float(np.float32(min_p))
    if min_p > 0:
        keep &= w >= min_p * np.max(w)
    w = np.where(keep, w, 0.0)
    return keep, w / np.sum(w)


def support(out):
    return np.isfinite(out)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def tokens(res):
    return np.array([r[0] for r in res])


def freqs(res, v):
    return np.bincount(tokens(res), minlength=v) / len(res)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- greedy ---------------------------------------------------------------

def test_greedy_is_argmax(rng):
    for _ in range(20):
        l = rng.normal(size=257).astype(np.float32)
        (tok, lp, top), = _testing.sample(l, temperature=0.0, seed=7)
        assert tok == int(np.argmax(l))
        assert lp is None and top == []


def test_greedy_ties_pick_lowest_id():
    l = np.array([0.5, 3.0, -1.0, 3.0, 3.0], np.float32)
    assert _testing.sample(l, temperature=0.0)[0][0] == 1
    assert _testing.sample(l, top_k=1, temperature=0.7)[0][0] == 1
    assert _testing.sample(np.zeros(9, np.float32), temperature=0.0)[0][0] == 0


def test_top_k_1_equals_greedy(rng):
    for seed in range(10):
        l = rng.normal(size=100).astype(np.float32)
        res = _testing.sample(l, top_k=1, temperature=1.3, seed=seed, n_draws=20)
        assert set(tokens(res)) == {int(np.argmax(l))}


def test_greedy_process_logits_is_one_hot():
    l = np.array([1.0, 4.0, 2.0], np.float32)
    out = _testing.process_logits(l, temperature=0.0)
    assert out.dtype == np.float32
    assert list(np.isfinite(out)) == [False, True, False]
    assert out[1] == 4.0


# ---- the random stream ----------------------------------------------------

# Published test vectors: splitmix64 seeded with 1234567 (the reference
# generator's first outputs, as listed e.g. on Rosetta Code), and xoshiro256**
# from the state {1, 2, 3, 4} (the sequence the reference implementation's
# ports, such as Rust's rand_xoshiro, test against).
SPLITMIX64_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                      4593380528125082431, 16408922859458223821]
XOSHIRO256SS_1234 = [11520, 0, 1509978240, 1215971899390074240, 1216172134540287360,
                     607988272756665600, 16172922978634559625, 8476171486693032832,
                     10595114339597558777, 2904607092377533576]


def test_splitmix64_matches_published_vector():
    assert [int(v) for v in _testing.splitmix64(1234567, 5)] == SPLITMIX64_1234567


def test_xoshiro256starstar_matches_published_vector():
    assert [int(v) for v in _testing.xoshiro256ss([1, 2, 3, 4], 10)] == XOSHIRO256SS_1234


@pytest.mark.parametrize("seed", [0, 1, 42, 2**63 + 5, 2**64 - 1])
def test_rng_is_xoshiro256starstar_seeded_by_splitmix64(seed):
    """A sequence's stream: xoshiro256** from four splitmix64 outputs of its seed."""
    got = [int(v) for v in _testing.rng_uint64(seed, 50)]
    state = [int(v) for v in _testing.splitmix64(seed, 4)]
    assert got == [int(v) for v in _testing.xoshiro256ss(state, 50)]
    u = _testing.rng_uniform(seed, 50)
    assert np.array_equal(u, np.array([(v >> 11) / 2.0**53 for v in got]))
    assert np.all((u >= 0) & (u < 1))


def test_same_seed_same_tokens_different_seed_different(rng):
    l = rng.normal(size=50).astype(np.float32)
    a = tokens(_testing.sample(l, seed=5, n_draws=200))
    b = tokens(_testing.sample(l, seed=5, n_draws=200))
    c = tokens(_testing.sample(l, seed=6, n_draws=200))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def inverse_cdf(p, u):
    """Token for uniform u over probabilities p in increasing id order, or None
    when u falls so close to a boundary that float rounding may decide it."""
    cum = np.cumsum(p)
    cum = cum / cum[-1]
    if np.min(np.abs(cum - u)) < 1e-6:
        return None
    return int(np.searchsorted(cum, u, side="right"))


@pytest.mark.parametrize("v, params", [
    (1000, {}),
    (1000, {"temperature": 0.6}),
    (1000, {"top_k": 7}),
    (1000, {"top_k": 300}),
    (1000, {"top_p": 0.8}),
    (1000, {"min_p": 0.05}),
    (1000, {"top_k": 40, "top_p": 0.9, "min_p": 0.02, "temperature": 1.5}),
    (20000, {"top_k": 100}),
    (20000, {"top_p": 0.5, "temperature": 3.0}),
    (1000, {"top_k": 400, "min_p": 0.01, "banned": list(range(0, 1000, 3))}),
    # top_k above the finite count is a no-op, then top_p
    (1000, {"top_k": 400, "top_p": 0.8, "banned": list(range(0, 1000, 2)) + list(range(1, 1000, 4))}),
])
def test_each_token_is_one_uniform_inverted_in_id_order(rng, v, params):
    """The i-th token comes from the i-th uniform of the stream, whatever the
    filters: exactly one draw per token, a canonical CDF walk."""
    l = rng.normal(scale=2.0, size=v).astype(np.float32)
    masked = l.copy()
    masked[params.get("banned", [])] = -np.inf
    _, p = ref_support(masked, **{k: x for k, x in params.items() if k != "banned"})
    n = 500
    res = _testing.sample(l, seed=99, n_draws=n, **params)
    u = _testing.rng_uniform(99, n)
    checked = 0
    for (tok, _, _), ui in zip(res, u):
        want = inverse_cdf(p, ui)
        if want is not None:
            assert tok == want
            checked += 1
    assert checked > 0.9 * n


# ---- temperature and filters: exact support, empirical distribution -------

N_DRAWS = 20000
TOL = 0.02  # > 5 standard deviations of a frequency estimated from 20k draws


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    l = np.array([1.0, 2.0, 0.5, -1.0, 1.5, 0.0], np.float32)
    want = softmax(l.astype(np.float64) / temperature)
    got = freqs(_testing.sample(l, temperature=temperature, seed=3, n_draws=N_DRAWS), len(l))
    assert np.max(np.abs(got - want)) < TOL
    # chi-square against the expected counts, 5 degrees of freedom (p ~ 1e-4 cut)
    exp = want * N_DRAWS
    chi2 = np.sum((got * N_DRAWS - exp) ** 2 / exp)
    assert chi2 < 25.7


def test_temperature_changes_the_distribution():
    l = np.array([2.0, 1.0, 0.0], np.float32)
    cold = freqs(_testing.sample(l, temperature=0.25, seed=1, n_draws=5000), 3)
    hot = freqs(_testing.sample(l, temperature=4.0, seed=1, n_draws=5000), 3)
    assert cold[0] > 0.95 and hot[0] < 0.5


@pytest.mark.parametrize("params", [
    {"top_k": 3},
    {"top_p": 0.6},
    {"min_p": 0.2},
    {"top_k": 4, "top_p": 0.7, "temperature": 0.8},
    {"top_p": 0.9, "min_p": 0.1, "temperature": 2.0},
])
def test_filters_restrict_support_and_renormalize(params):
    l = np.array([2.0, 1.2, -0.3, 0.9, 1.7, -2.0, 0.1, 1.0], np.float32)
    keep, p = ref_support(l, **params)
    assert 0 < keep.sum() < len(l)
    out = _testing.process_logits(l, **params)
    assert np.array_equal(support(out), keep)
    assert np.allclose(softmax(out), p, atol=1e-6)
    got = freqs(_testing.sample(l, seed=11, n_draws=N_DRAWS, **params), len(l))
    assert np.all(got[~keep] == 0)
    assert np.max(np.abs(got - p)) < TOL


def test_top_k_keeps_the_k_largest():
    l = np.array([0.0, 5.0, 1.0, 4.0, 2.0, 3.0], np.float32)
    assert np.flatnonzero(support(_testing.process_logits(l, top_k=3))).tolist() == [1, 3, 5]
    # ties at the cut: lower ids win
    l = np.array([1.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    assert np.flatnonzero(support(_testing.process_logits(l, top_k=2))).tolist() == [1, 2]
    # 0, -1 and k >= vocab are off
    for k in (0, -1, 5, 100):
        assert support(_testing.process_logits(l, top_k=k)).all()


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = np.array([0.05, 0.5, 0.3, 0.15])
    l = np.log(p).astype(np.float32)
    sup = lambda tp: np.flatnonzero(support(_testing.process_logits(l, top_p=tp))).tolist()
    assert sup(0.45) == [1]
    assert sup(0.55) == [1, 2]
    assert sup(0.9) == [1, 2, 3]
    assert sup(0.99) == [0, 1, 2, 3]
    assert sup(1e-6) == [1]  # always at least one token


def test_top_p_with_a_heavy_tail():
    """One big token, a middle group and a long light tail: the nucleus needs
    part of the middle group even though the tail is most of the tokens."""
    w = np.array([1.0] + [0.5] * 9 + [0.02] * 90)
    l = np.log(w).astype(np.float32)
    keep, p = ref_support(l, top_p=0.3)
    assert np.flatnonzero(keep).tolist() == [0, 1, 2, 3]
    out = _testing.process_logits(l, top_p=0.3)
    assert np.array_equal(support(out), keep)
    assert np.allclose(softmax(out), p, atol=1e-6)


def test_top_k_with_heavy_ties_at_the_cut():
    v, k = 8192, 300
    l = np.ones(v, np.float32)
    twos = np.arange(100) * 79 + 5
    l[twos] = 2.0
    keep = np.zeros(v, bool)
    keep[twos] = True
    keep[np.flatnonzero(l == 1.0)[: k - 100]] = True  # the lowest ids among the tied
    assert np.array_equal(support(_testing.process_logits(l, top_k=k)), keep)
    for kk in (100, 101, 1000, 5000):
        assert support(_testing.process_logits(l, top_k=kk)).sum() == kk


def test_min_p_drops_tokens_below_fraction_of_max():
    p = np.array([0.4, 0.3, 0.1, 0.19, 0.01])
    l = np.log(p).astype(np.float32)
    out = _testing.process_logits(l, min_p=0.3)  # threshold 0.12
    assert np.flatnonzero(support(out)).tolist() == [0, 1, 3]
    assert np.allclose(softmax(out)[[0, 1, 3]], p[[0, 1, 3]] / 0.89)


@pytest.mark.parametrize("v", [5, 64, 1000, 5000, 60000])
def test_filters_match_reference_on_random_rows(rng, v):
    for _ in range(15 if v < 5000 else 6):
        l = rng.normal(scale=rng.uniform(0.2, 4.0), size=v).astype(np.float32)
        if rng.uniform() < 0.3:  # ties and banned-like holes
            l = np.round(l).astype(np.float32)
            l[rng.integers(0, v, size=v // 5)] = -np.inf
        params = {
            "temperature": float(rng.choice([0.5, 1.0, 1.7])),
            "top_k": int(rng.choice([0, -1, 1 + int(rng.integers(0, v)), 2, 300])),
            "top_p": float(rng.choice([1.0, 0.5, 0.9, 0.97])),
            "min_p": float(rng.choice([0.0, 0.01, 0.3])),
        }
        if params["top_k"] == 1:
            continue
        keep, p = ref_support(l, **params)
        out = _testing.process_logits(l, **params)
        assert np.array_equal(support(out), keep), params
        assert np.allclose(softmax(out), p, atol=1e-6)


# ---- penalties and bans ---------------------------------------------------

def test_repetition_penalty_divides_positive_multiplies_negative():
    l = np.array([2.0, -2.0, 1.0, -1.0, 0.5], np.float32)
    out = _testing.process_logits(l, repetition_penalty=2.0, prompt=[0, 1], output=[1, 2])
    assert out.tolist() == [1.0, -4.0, 0.5, -1.0, 0.5]  # each token once, prompt and output
    out = _testing.process_logits(l, repetition_penalty=0.5, prompt=[0, 1])
    assert out.tolist() == [4.0, -1.0, 1.0, -1.0, 0.5]


def test_frequency_and_presence_penalties_count_output_only():
    l = np.zeros(5, np.float32)
    out = _testing.process_logits(l, frequency_penalty=0.5, prompt=[4, 4, 4], output=[1, 1, 1, 2])
    assert out.tolist() == [0.0, -1.5, -0.5, 0.0, 0.0]
    out = _testing.process_logits(l, presence_penalty=0.75, prompt=[4], output=[1, 1, 1, 2])
    assert out.tolist() == [0.0, -0.75, -0.75, 0.0, 0.0]
    out = _testing.process_logits(l, presence_penalty=-1.0, frequency_penalty=-0.5, output=[3, 3])
    assert out.tolist() == [0.0, 0.0, 0.0, 2.0, 0.0]


def test_penalties_match_reference(rng):
    v = 300
    for _ in range(20):
        l = rng.normal(scale=3, size=v).astype(np.float32)
        kw = dict(
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            prompt=rng.integers(0, v, size=int(rng.integers(0, 50))).tolist(),
            output=rng.integers(0, v, size=int(rng.integers(0, 80))).tolist(),
            banned=rng.integers(0, v, size=int(rng.integers(0, 5))).tolist(),
        )
        want = ref_penalize(l, **kw)
        got = _testing.process_logits(l, **kw)
        assert np.array_equal(got, want)


def test_penalties_change_the_sampled_distribution():
    l = np.zeros(4, np.float32)
    p = freqs(_testing.sample(l, frequency_penalty=1.0, output=[0, 0, 1], seed=2, n_draws=N_DRAWS), 4)
    want = softmax(np.array([-2.0, -1.0, 0.0, 0.0]))
    assert np.max(np.abs(p - want)) < TOL


def test_banned_tokens_are_never_drawn(rng):
    l = np.array([5.0, 4.0, 0.0, 0.0, 0.5], np.float32)
    res = _testing.sample(l, banned=[0, 1], seed=8, n_draws=N_DRAWS)
    f = freqs(res, 5)
    assert f[0] == 0 and f[1] == 0
    assert np.max(np.abs(f - softmax(np.array([-np.inf, -np.inf, 0.0, 0.0, 0.5])))) < TOL
    assert _testing.sample(l, temperature=0.0, banned=[0])[0][0] == 1


def test_penalties_that_lower_the_best_token_move_the_choice():
    """The maximum the weights are taken against is the one after the penalties: a
    penalized best token leaves the next one best, greedy and sampled alike."""
    l = np.array([5.0, 4.0, 0.0, 1.0], np.float32)
    cases = [dict(repetition_penalty=2.0, prompt=[0]),             # 5 -> 2.5
             dict(presence_penalty=2.0, output=[0]),               # 5 -> 3
             dict(frequency_penalty=1.5, output=[0, 0])]           # 5 -> 2
    for kw in cases:
        assert _testing.sample(l, temperature=0.0, **kw)[0][0] == 1, kw
        res = _testing.sample(l, temperature=1.0, seed=3, n_draws=N_DRAWS, **kw)
        assert np.max(np.abs(freqs(res, 4) - softmax(ref_penalize(l, **kw)))) < TOL, kw


# ---- logprobs -------------------------------------------------------------

def test_logprobs_are_log_softmax_of_raw_logits(rng):
    v = 500
    l = rng.normal(scale=2, size=v).astype(np.float32)
    want = log_softmax(l)
    res = _testing.sample(l, n_logprobs=5, seed=4, n_draws=50, temperature=0.7, top_k=20,
                       repetition_penalty=1.5, presence_penalty=1.0, output=[0, 1, 2, 3],
                       banned=[int(np.argmax(l))])
    top_ids = np.lexsort((np.arange(v), -l))[:5]
    for tok, lp, top in res:
        assert lp == pytest.approx(want[tok], abs=1e-5)
        assert [t for t, _ in top] == top_ids.tolist()
        assert np.allclose([x for _, x in top], want[top_ids], atol=1e-5)
        assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))


@pytest.mark.parametrize("n", [0, 1, 20])
def test_logprob_count(n):
    l = np.arange(30, dtype=np.float32)
    (tok, lp, top), = _testing.sample(l, n_logprobs=n, temperature=0.0)
    assert tok == 29 and len(top) == n
    assert [t for t, _ in top] == list(range(29, 29 - n, -1))
    assert lp == pytest.approx(log_softmax(l)[29], abs=1e-6)
    (tok, lp, top), = _testing.sample(np.zeros(3, np.float32), n_logprobs=20)
    assert len(top) == 3 and [t for t, _ in top] == [0, 1, 2]


# ---- NaN and inf ----------------------------------------------------------

def test_nan_logits_are_never_drawn():
    l = np.array([np.nan, 1.0, np.nan, 1.0], np.float32)
    res = _testing.sample(l, seed=1, n_draws=2000, n_logprobs=2)
    assert set(tokens(res)) == {1, 3}
    assert all(math.isfinite(lp) for _, lp, _ in res)
    assert _testing.sample(l, temperature=0.0)[0][0] == 1


def test_all_nan_or_masked_gives_token_0_with_logprob_minus_inf():
    for l, kw in [(np.full(6, np.nan, np.float32), {}),
                  (np.full(6, -np.inf, np.float32), {"top_p": 0.5}),
                  (np.ones(3, np.float32), {"banned": [0, 1, 2], "top_k": 2})]:
        for temperature in (0.0, 1.0):
            (tok, lp, _), = _testing.sample(l, temperature=temperature, n_logprobs=1, **kw)
            assert tok == 0
            if not kw.get("banned"):
                assert lp == -math.inf


def test_positive_inf_wins():
    l = np.array([0.0, np.inf, 3.0, -np.inf], np.float32)
    res = _testing.sample(l, seed=2, n_draws=200, n_logprobs=1, temperature=0.5)
    assert set(tokens(res)) == {1}
    assert res[0][1] == 0.0
    assert _testing.sample(l, temperature=0.0)[0][0] == 1
    assert _testing.sample(l, repetition_penalty=0.1, output=[1], seed=3)[0][0] == 1


def test_extreme_values_do_not_break(rng):
    big = np.finfo(np.float32).max
    l = np.array([big, -big, big, 0.0, -big], np.float32)
    for params in ({}, {"temperature": 1e-30}, {"temperature": 1e30}, {"top_p": 0.5},
                   {"top_k": 2}, {"min_p": 1.0}, {"repetition_penalty": 1e-3, "output": [0, 1]}):
        out = _testing.process_logits(l, **params)
        assert not np.any(np.isnan(out))
        toks = tokens(_testing.sample(l, seed=1, n_draws=50, **params))
        assert set(toks) <= {0, 1, 2, 3, 4}


# ---- input checking -------------------------------------------------------

@pytest.mark.parametrize("bad, exc", [
    ([1.0, 2.0], TypeError),
    (np.zeros(3, np.float64), TypeError),
    (np.zeros(3, ">f4"), TypeError),
    (np.zeros((2, 3), np.float32), ValueError),
    (np.zeros(0, np.float32), ValueError),
    (np.float32(1.0), TypeError),
])
def test_bad_logits(bad, exc):
    with pytest.raises(exc):
        _testing.sample(bad)


@pytest.mark.parametrize("kw", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_p": 1.01}, {"min_p": -0.1}, {"min_p": 1.5},
    {"top_k": -2}, {"top_k": 2**40}, {"repetition_penalty": 0.0},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
    {"n_logprobs": 21}, {"n_logprobs": -2}, {"n_draws": 0},
    {"prompt": [0, 7]}, {"output": [-1]}, {"banned": [2**40]}, {"seed": -1}, {"seed": 2**64},
])
def test_bad_params_raise_value_error(kw):
    with pytest.raises(ValueError):
        _testing.sample(np.zeros(7, np.float32), **kw)


@pytest.mark.parametrize("kw", [
    {"prompt": [1.5]}, {"output": "ab"}, {"banned": 3}, {"seed": 1.0}, {"temperature": "hot"},
])
def test_bad_param_types_raise_type_error(kw):
    with pytest.raises(TypeError):
        _testing.sample(np.zeros(7, np.float32), **kw)


def test_strided_logits_and_numpy_ids_accepted():
    base = np.array([0.0, 9.0, 1.0, 8.0, 2.0, 7.0], np.float32)
    l = base[::2]  # [0, 1, 2]
    assert _testing.sample(l, temperature=0.0)[0][0] == 2
    out = _testing.process_logits(l, banned=np.array([2], np.int64), output=np.array([1], np.int32),
                               presence_penalty=0.5)
    assert out.tolist() == [0.0, 0.5, -np.inf]
