"""The server's Prometheus metrics (GET /metrics)."""
from __future__ import annotations

import math
from typing import Optional

# ---------------------------------------------------------------------------- metrics

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
                120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets):
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float):
        if v is None or not math.isfinite(v):
            return
        v = max(v, 0.0)
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v
        self.count += 1

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{{labels},le="{b!r}"}} {acc}')
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{self.name}_count{{{labels}}} {self.count}")
        return out


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """Server-side counters and latency histograms; engine figures come from engine.stats()."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{_label(model_name)}"'
        self.ttft = Histogram("conveyor_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", _TTFT_BUCKETS)
        self.tpot = Histogram("conveyor_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", _TPOT_BUCKETS)
        self.e2e = Histogram("conveyor_e2e_request_latency_seconds",
                             "Time from arrival to the last token.", _E2E_BUCKETS)
        self.finished: dict[str, int] = {}
        self.rejected = 0
        self.http_errors: dict[int, int] = {}
        self.disconnects = 0

    def record(self, metrics, n_tokens: int, finish_reason: Optional[str]):
        if finish_reason:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
        if metrics is None:
            return
        a, ft, fin = metrics.arrival_time, metrics.first_token_time, metrics.finished_time
        if ft is not None:
            self.ttft.observe(ft - a)
        if fin is not None:
            self.e2e.observe(fin - a)
        if ft is not None and fin is not None and n_tokens > 1:
            self.tpot.observe((fin - ft) / (n_tokens - 1))

    def render(self, stats: dict, in_flight: int) -> str:
        L = self.labels
        lines: list[str] = []

        def metric(name, kind, help_, value, extra=""):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lab = L + ("," + extra if extra else "")
            lines.append(f"{name}{{{lab}}} {value!r}" if isinstance(value, float) else f"{name}{{{lab}}} {value}")

        g = stats.get
        total = g("blocks_total", 0) or 0
        used = g("blocks_used", 0) or 0
        q = g("prefix_queries", 0) or 0
        h = g("prefix_hits", 0) or 0
        metric("conveyor_num_requests_running", "gauge", "Requests in the running batch.", g("num_running", 0))
        metric("conveyor_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", g("num_waiting", 0))
        metric("conveyor_num_requests_queued", "gauge",
               "Requests not yet scheduled once (what max_queued_requests limits).", g("num_queued", 0))
        metric("conveyor_num_preemptions_total", "counter", "Preemptions since start.", g("num_preemptions", 0))
        metric("conveyor_num_recomputed_tokens_total", "counter",
               "Tokens of KV computed again after a preemption (the LRU had reused their blocks).",
               g("num_recomputed_tokens", 0))
        metric("conveyor_num_resumed_tokens_total", "counter",
               "Tokens of KV a preempted request took back on resuming instead of recomputing them.",
               g("num_resumed_tokens", 0))
        metric("conveyor_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full).",
               float(used / total) if total else 0.0)
        metric("conveyor_kv_cache_blocks_used", "gauge", "KV blocks held by requests.", used)
        metric("conveyor_kv_cache_blocks_total", "gauge", "KV blocks in the pool.", total)
        metric("conveyor_kv_cache_blocks_touched", "gauge",
               "KV blocks ever handed out (on the CPU the pool is committed as used: its resident part).",
               g("blocks_touched", 0))
        metric("conveyor_kv_cache_blocks_cached_free", "gauge", "Free KV blocks still holding cached prefixes.",
               g("blocks_cached_free", 0))
        metric("conveyor_kv_cache_waste", "gauge", "1 - tokens held / allocated slots.", float(g("kv_waste", 0.0)))
        metric("conveyor_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", q)
        metric("conveyor_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", h)
        metric("conveyor_prefix_cache_hit_rate", "gauge", "prefix_cache_hits / prefix_cache_queries.",
               float(h / q) if q else 0.0)
        metric("conveyor_prompt_tokens_total", "counter", "Prompt tokens processed.", g("prompt_tokens", 0))
        metric("conveyor_generation_tokens_total", "counter", "Tokens generated.", g("generation_tokens", 0))
        metric("conveyor_spec_decode_num_draft_tokens_total", "counter",
               "Speculative proposals verified.", g("spec_proposed", 0))
        metric("conveyor_spec_decode_num_accepted_tokens_total", "counter",
               "Speculative proposals accepted.", g("spec_accepted", 0))
        metric("conveyor_spec_decode_acceptance_rate", "gauge", "spec_accepted / spec_proposed.",
               float(g("spec_acceptance_rate", 0.0)))
        for name, key, help_ in (("conveyor_spec_decode_num_draft_tokens_per_pos_total", "spec_proposed_at",
                                  "Speculative proposals verified, by position in the proposal."),
                                 ("conveyor_spec_decode_num_accepted_tokens_per_pos_total", "spec_accepted_at",
                                  "Speculative proposals accepted, by position in the proposal.")):
            if g(key):
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} counter")
                for pos, v in enumerate(g(key)):
                    lines.append(f'{name}{{{L},position="{pos}"}} {v}')
        if "lora_swaps" in stats:
            self._render_lora(stats, metric, lines)
        metric("conveyor_requests_finished_total", "counter", "Engine requests finished.",
               g("requests_finished", 0))
        metric("conveyor_requests_aborted_total", "counter", "Engine requests aborted (e.g. disconnects).",
               g("requests_aborted", 0))
        lines.append("# HELP conveyor_request_success_total Requests answered, by finish reason.")
        lines.append("# TYPE conveyor_request_success_total counter")
        for reason in sorted(set(self.finished) | {"stop", "length"}):
            lines.append(f'conveyor_request_success_total{{{L},finished_reason="{_label(reason)}"}} '
                         f"{self.finished.get(reason, 0)}")
        metric("conveyor_requests_rejected_total", "counter",
               "Requests refused with 503 (queue full: max_queued_requests).", self.rejected)
        metric("conveyor_requests_timed_out_total", "counter",
               "Engine requests ended past their deadline (timeout, --request-timeout).",
               g("requests_timed_out", 0))
        metric("conveyor_client_disconnects_total", "counter", "Requests whose client went away before the end.",
               self.disconnects)
        metric("conveyor_server_requests_in_flight", "gauge", "HTTP generation requests being served.", in_flight)
        lines.append("# HELP conveyor_http_errors_total Error answers, by HTTP status.")
        lines.append("# TYPE conveyor_http_errors_total counter")
        for status in sorted(self.http_errors):
            lines.append(f'conveyor_http_errors_total{{{L},status="{status}"}} {self.http_errors[status]}')
        for hist in (self.ttft, self.tpot, self.e2e):
            lines.extend(hist.render(L))
        return "\n".join(lines) + "\n"

    def _render_lora(self, stats: dict, metric, lines: list) -> None:
        """LoRA adapters (an engine made with enable_lora): slot loads and evictions, and the
        requests finished and tokens generated under each adapter, labelled by its name."""
        g = stats.get
        metric("conveyor_lora_adapter_loads_total", "counter", "LoRA adapters loaded into a slot.",
               g("lora_swaps", 0))
        metric("conveyor_lora_adapter_evictions_total", "counter",
               "LoRA adapter loads that evicted an idle adapter from its slot.", g("lora_evictions", 0))
        metric("conveyor_lora_adapters_resident", "gauge", "LoRA adapters in slots.", g("lora_resident", 0))
        metric("conveyor_lora_requests_waiting", "gauge", "Requests waiting for their adapter's slot.",
               g("lora_requests_waiting", 0))
        for name, key, help_ in (("conveyor_lora_requests_total", "lora_requests",
                                  "Requests finished under a LoRA adapter, by adapter."),
                                 ("conveyor_lora_generation_tokens_total", "lora_tokens",
                                  "Tokens generated under a LoRA adapter, by adapter.")):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} counter")
            for adapter, v in sorted((g(key) or {}).items()):
                lines.append(f'{name}{{{self.labels},adapter="{_label(adapter)}"}} {v}')


