"""The wall-clock cap on Python code a request or a model file controls
(conveyor.deadline): a loop past its deadline stops with a TimeoutError naming
what ran, a call that ends in time is untouched (nothing lands later), calls on
several threads each get their own deadline, and one watchdog thread serves them all."""
import threading
import time

import pytest

from conveyor.deadline import call_with_deadline


def spin(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def watchdogs():
    return [t for t in threading.enumerate() if t.name == "conveyor-deadline"]


def test_a_loop_past_its_deadline_stops_with_a_named_error():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rendering the test template took longer than 0.2 s"):
        call_with_deadline(0.2, "rendering the test template", spin, 30)
    assert time.monotonic() - t0 < 5


def test_a_call_in_time_returns_and_nothing_lands_later():
    assert call_with_deadline(0.3, "x", lambda a, b=0: a + b, 2, b=3) == 5
    # the deadline passes after the call ended: no exception may arrive in this thread
    assert spin(0.6) > 0
    with pytest.raises(ValueError, match="own error"):
        call_with_deadline(1.0, "x", lambda: (_ for _ in ()).throw(ValueError("own error")))
    assert spin(1.2) > 0


def test_the_capped_code_cannot_swallow_the_deadline():
    def stubborn():
        while True:
            try:
                spin(10)
            except Exception:  # a template's own handler: the deadline is not an Exception
                pass

    with pytest.raises(TimeoutError):
        call_with_deadline(0.2, "stubborn", stubborn)


def test_threads_get_their_own_deadlines_and_share_one_watchdog():
    results = {}

    def worker(name, deadline, work):
        try:
            results[name] = call_with_deadline(deadline, name, spin, work) > 0
        except TimeoutError as e:
            results[name] = str(e)

    threads = [threading.Thread(target=worker, args=("fast", 5.0, 0.3)),
               threading.Thread(target=worker, args=("slow", 0.3, 30)),
               threading.Thread(target=worker, args=("late", 0.5, 30))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {"fast": True, "slow": "slow took longer than 0.3 s", "late": "late took longer than 0.5 s"}
    for _ in range(50):
        call_with_deadline(1.0, "x", int)
    assert len(watchdogs()) == 1
