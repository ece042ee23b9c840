"""Engine metrics for BentoML's /metrics endpoint, through prometheus_client.

Create `EngineMetrics` inside the worker (the service's __init__), never at import time: BentoML sets
PROMETHEUS_MULTIPROC_DIR after importing the service module, and prometheus_client picks its storage when
first imported."""

import functools
import time

TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineMetrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        # livesum: each worker runs its own engine, the service's load is their sum
        gauge = lambda name, doc: Gauge(name, doc, multiprocess_mode="livesum")
        self.gauges = {
            "num_running": gauge("tiffin_requests_running", "Sequences in the running batch."),
            "num_waiting": gauge("tiffin_requests_waiting", "Sequences waiting to be scheduled."),
            "kv_blocks_used": gauge("tiffin_kv_cache_blocks_used", "KV cache blocks held by sequences."),
            "kv_blocks_total": gauge("tiffin_kv_cache_blocks_total", "KV cache blocks in the pool."),
        }
        self.counters = {  # prometheus_client appends _total
            "prompt_tokens": Counter("tiffin_prompt_tokens", "Prompt tokens of accepted requests."),
            "generation_tokens": Counter("tiffin_generation_tokens", "Generated tokens."),
            "num_preemptions": Counter("tiffin_preemptions", "Sequences preempted (recomputed later)."),
        }
        self.ttft = Histogram(
            "tiffin_time_to_first_token_seconds", "Time to first token.", buckets=REQUEST_LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "tiffin_time_per_output_token_seconds",
            "Time per output token after the first.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "tiffin_e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self._seen = dict.fromkeys(self.counters, 0)

    def on_stats(self, stats: dict) -> None:
        """AsyncLLMEngine's `on_stats` hook (engine thread): gauges now, counters by their increase."""
        for key, gauge in self.gauges.items():
            gauge.set(stats[key])
        for key, counter in self.counters.items():
            if stats[key] > self._seen[key]:
                counter.inc(stats[key] - self._seen[key])
                self._seen[key] = stats[key]

    def on_finished(self, stream, output) -> None:
        """A request finished: latencies as its reader saw them (RequestStream timestamps)."""
        now = time.monotonic()
        self.e2e.observe(now - stream.arrival_time)
        if stream.first_token_time is None:
            return
        self.ttft.observe(stream.first_token_time - stream.arrival_time)
        num_tokens = max(len(o.token_ids) for o in output.outputs)
        if num_tokens > 1:
            self.tpot.observe((now - stream.first_token_time) / (num_tokens - 1))


@functools.cache
def engine_metrics() -> EngineMetrics:
    """One set per process (prometheus_client refuses duplicate names)."""
    return EngineMetrics()
