"""GET /v1/engine/events: continuous batching as it happens, as server-sent events.

One broadcaster per server reads what the engine already records for
`conveyor bench timeline` (its step trace) and its statistics, at most every
`interval` seconds, and sends every listener the same summary of the steps since
the last event:

    {"type": "steps", "time": unix seconds, "interval_s": seconds since the last event,
     "steps": {"step": [n, ...], "ms": [duration, ...], "seqs": [sequences scheduled, ...],
               "prefill_tokens": [...], "decode_tokens": [...],
               "proposals": [speculative proposals verified, ...]},      one column per figure
     "slots": [[slot, request, first step, last step, prefill, tokens], ...],
     "steps_total": steps since the engine started, "steps_omitted": steps left out,
     "prefill_tokens": n, "decode_tokens": n, "preemptions": n,
     "spec_proposed": n, "spec_accepted": n,
     "kv": {"used": blocks, "cached": blocks, "free": blocks, "total": blocks},
     "running": sequences, "waiting": requests, "tokens_per_s": generated tokens per second,
     "max_num_seqs": n}

"slots" holds which sequence sat in which batch slot at each step, as runs: one entry
per sequence and stretch of consecutive steps in one slot doing one kind of work
(prefill 1: prompt tokens, 0: decode), with the tokens it scheduled over them; a
decoding batch of 64 over 100 steps is 64 entries, not 6,400. The totals
(prefill_tokens, decode_tokens, ...) count every step; the columns and the runs only
the latest MAX_STEPS_PER_EVENT ("steps_omitted" says how many went before them; a run
cut there keeps its whole token count).

A sequence holds a slot (the lowest free one) from the step it is first scheduled
while it is scheduled at every step; a step without it frees the slot. "request" is
the engine's number for the request (one colour per request in the live view).
Preemptions and speculative acceptances are the engine's counters over the event's
steps (the step trace does not break them down per step).

With no listener the step trace is off: the engine records nothing and nothing polls.
Listeners share one poller, so each one more costs one write of the same text.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from .protocol import dumps

EVENT_INTERVAL_S = 0.1  # the least time between two events
IDLE_EVENT_S = 1.0  # with no new step, an event at most this often (keeps the views' clocks moving)
MAX_STEPS_PER_EVENT = 1000  # the latest steps of an interval; the rest are counted in steps_omitted
LISTENER_BACKLOG = 20  # events a slow listener may have waiting before the oldest are dropped


class EngineEvents:
    """Turns the step trace on while someone listens and feeds each listener a queue of
    SSE-encoded events."""

    def __init__(self, engine, interval: float = EVENT_INTERVAL_S):
        self.engine = engine
        self.interval = interval
        self.listeners: set[asyncio.Queue] = set()
        self.events_built = 0  # summaries made (one per interval with listeners, not one per listener)
        self.busy_s = 0.0  # time the poller spent building and handing out events
        self._task: Optional[asyncio.Task] = None
        self._slots: dict[tuple, int] = {}  # (request, completion) -> slot, while scheduled every step
        self._last_stats: dict = {}
        self._last_time = 0.0
        self._last_sent = 0.0
        self._newcomer = False
        self.tracing = False  # whether the engine's step trace is on (only while someone listens)

    # -- listeners --------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        """A new listener's queue of SSE-encoded events."""
        if not self.listeners:
            self.engine.take_step_trace()  # what a previous session left, if anything
            self.engine.set_step_trace(True)
            self.tracing = True
            self._slots.clear()
            self._last_stats = self._stats()
            self._last_time = time.time()
            self._task = asyncio.get_running_loop().create_task(self._run())
        q: asyncio.Queue = asyncio.Queue(LISTENER_BACKLOG)
        self.listeners.add(q)
        self._newcomer = True  # the next poll sends, idle or not: its first event within one interval
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.listeners.discard(q)
        if self.listeners:
            return
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if not self.engine.closed:
            self.engine.set_step_trace(False)
            self.engine.take_step_trace()
        self.tracing = False
        self._slots.clear()

    def close_all(self) -> None:
        """Ends every listener's stream: the server is shutting down, and a stream of
        events never ends by itself."""
        for q in list(self.listeners):
            if q.full():
                q.get_nowait()
            q.put_nowait(None)

    # -- the poller -------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - the listeners keep their stream; the next poll tries again
                logging.getLogger("conveyor.serve").exception("engine events")

    def _poll(self) -> None:
        if self.engine.closed:
            return
        t0 = time.perf_counter()
        trace = self.engine.take_step_trace()
        now = time.time()
        if not trace and not self._newcomer and now - self._last_sent < IDLE_EVENT_S:
            self.busy_s += time.perf_counter() - t0
            return
        stats = self._stats()
        text = self._encode(self._summary(trace, self._last_stats, stats, self._last_time, now))
        self._last_stats, self._last_time, self._last_sent = stats, now, now
        self._newcomer = False
        self.events_built += 1
        for q in list(self.listeners):
            if q.full():  # a listener that does not read: it loses its oldest events, not the others
                q.get_nowait()
            q.put_nowait(text)
        self.busy_s += time.perf_counter() - t0

    def _stats(self) -> dict:
        try:
            return self.engine.stats()
        except Exception:  # noqa: BLE001 - a closed engine: no figures
            return {}

    @staticmethod
    def _encode(ev: dict) -> str:
        return f"data: {dumps(ev)}\n\n"

    def _summary(self, trace, before: dict, after: dict, t_before: float, t_after: float) -> dict:
        steps, slots, prefill, decode = self._steps(trace)
        omitted = max(0, len(steps["step"]) - MAX_STEPS_PER_EVENT)
        if omitted:
            first = steps["step"][omitted]
            steps = {k: v[omitted:] for k, v in steps.items()}
            slots = [[sl, rid, max(a, first), b, p, n] for sl, rid, a, b, p, n in slots if b >= first]

        def delta(key):
            return max(0, int(after.get(key, 0)) - int(before.get(key, 0)))

        dt = t_after - t_before
        return {
            "type": "steps", "time": t_after, "interval_s": round(dt, 4),
            "steps": steps, "slots": slots, "steps_total": int(after.get("steps", 0)), "steps_omitted": omitted,
            "prefill_tokens": prefill, "decode_tokens": decode,
            "preemptions": delta("num_preemptions"),
            "spec_proposed": delta("spec_proposed"), "spec_accepted": delta("spec_accepted"),
            "kv": {"used": int(after.get("blocks_used", 0)), "cached": int(after.get("blocks_cached_free", 0)),
                   "free": int(after.get("blocks_free", 0)), "total": int(after.get("blocks_total", 0))},
            "running": int(after.get("num_running", 0)), "waiting": int(after.get("num_waiting", 0)),
            "tokens_per_s": round(delta("generation_tokens") / dt, 1) if dt > 0 else 0.0,
            "max_num_seqs": int(after.get("max_num_seqs", 0)),
        }

    def _steps(self, trace):
        """The per-step columns, the slot runs and the token totals of a trace (entries
        in step order, as the engine records them)."""
        cols = {"step": [], "ms": [], "seqs": [], "prefill_tokens": [], "decode_tokens": [], "proposals": []}
        runs: list = []
        open_runs: dict[tuple, list] = {}  # the run each sequence is in (runs end with the event)
        slots = self._slots
        prefill_total = decode_total = 0
        i, n = 0, len(trace)
        while i < n:
            step, t0, t1 = trace[i][0], trace[i][1], trace[i][2]
            j = i
            while j < n and trace[j][0] == step:
                j += 1
            present = {(e[3], e[4]) for e in trace[i:j]}
            for key in [k for k in slots if k not in present]:  # not scheduled this step: its slot frees
                del slots[key]
                open_runs.pop(key, None)
            used = set(slots.values())
            prefill = decode = proposals = 0
            for _, _, _, rid, idx, n_new, n_prompt in trace[i:j]:
                key = (rid, idx)
                slot = slots.get(key)
                if slot is None:
                    slot = 0
                    while slot in used:
                        slot += 1
                    slots[key] = slot
                    used.add(slot)
                kind = 1 if n_prompt else 0
                if not kind and n_new > 1:  # a decode verifying speculative proposals
                    proposals += n_new - 1
                prefill += n_prompt
                decode += n_new - n_prompt
                run = open_runs.get(key)
                if run is not None and run[4] == kind and run[3] == step - 1 and run[0] == slot:
                    run[3] = step
                    run[5] += n_new
                else:
                    run = open_runs[key] = [slot, rid, step, step, kind, n_new]
                    runs.append(run)
            cols["step"].append(step)
            cols["ms"].append(round((t1 - t0) * 1e3, 3))
            cols["seqs"].append(j - i)
            cols["prefill_tokens"].append(prefill)
            cols["decode_tokens"].append(decode)
            cols["proposals"].append(proposals)
            prefill_total += prefill
            decode_total += decode
            i = j
        return cols, runs, prefill_total, decode_total


class _Listener:
    """One listener's events as an async iterator; closing it (the client went away, or
    the response ended) unsubscribes, even when no event was read yet."""

    def __init__(self, events: EngineEvents):
        self.events = events
        self.queue = events.subscribe()
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        if self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is None:  # close_all
            self.close()
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.events.unsubscribe(self.queue)

    async def aclose(self) -> None:
        self.close()


def events_endpoint(server, events: EngineEvents):
    """The handler of GET /v1/engine/events (behind the API key, like /v1/*)."""
    from .serving import SSEResponse

    async def engine_events(request):
        server.check_auth(request)
        if events.engine.closed:
            raise server.closed_error()
        listener = _Listener(events)
        return SSEResponse(listener, on_end=listener.close)

    return engine_events
