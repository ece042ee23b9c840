"""Engine metrics for BentoML's /metrics endpoint, through prometheus_client.

Create `EngineMetrics` inside the worker (the service's __init__), never at import time: BentoML sets
PROMETHEUS_MULTIPROC_DIR after importing the service module, and prometheus_client picks its storage when
first imported."""

import functools
import os
import shutil
import time
from pathlib import Path

from tiffin.engine.outputs import EngineStats

TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def own_prometheus_dir() -> Path | None:
    """Point BentoML at a Prometheus multiprocess directory of this server's own, `tiffin_prometheus/<pid>` under
    BENTOML_HOME, and remove those of servers that have exited; the directory, or None in a worker.

    BentoML empties one shared `<BENTOML_HOME>/prometheus_multiproc_dir` whenever a server starts, so a second
    server under the same home would wipe the first's files and the first's /metrics would then read the second's
    counters. `bentoml serve` imports the service module before it prepares that directory, so this runs at import;
    its workers inherit PROMETHEUS_MULTIPROC_DIR (set by then) and keep it."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return None
    from bentoml._internal.configuration.containers import BentoMLContainer

    root = Path(BentoMLContainer.bentoml_home.get()) / "tiffin_prometheus"
    for other in root.glob("*"):
        if other.name.isdigit() and not _alive(int(other.name)):
            shutil.rmtree(other, ignore_errors=True)
    own = root / str(os.getpid())
    BentoMLContainer.prometheus_multiproc_dir.set(str(own))
    return own


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class EngineMetrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        # livesum: each worker runs its own engine, the service's load is their sum
        gauge = lambda name, doc: Gauge(name, doc, multiprocess_mode="livesum")
        self.running = gauge("tiffin_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("tiffin_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_blocks_used = gauge("tiffin_kv_cache_blocks_used", "KV cache blocks held by sequences.")
        self.kv_blocks_total = gauge("tiffin_kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.embedding_kv_blocks_used = gauge(
            "tiffin_embedding_kv_cache_blocks_used", "KV cache blocks held by the embedding engine's sequences."
        )
        self.embedding_kv_blocks_total = gauge(
            "tiffin_embedding_kv_cache_blocks_total", "KV cache blocks in the embedding engine's pool."
        )
        self.requests_swapped = gauge("tiffin_requests_swapped", "Sequences preempted by swap, waiting to resume.")
        self.host_kv_bytes_used = gauge(
            "tiffin_host_kv_cache_bytes_used", "Host memory holding KV blocks: the prefix cache's host tier, swap."
        )
        # data parallelism: each replica's share of the sums above (which cover the live replicas), by `replica`
        replica = lambda name, doc: Gauge(name, doc, ["replica"], multiprocess_mode="livesum")
        self.replica_up = replica("tiffin_replica_up", "1 while the data-parallel replica serves, 0 once it died.")
        self.replica_running = replica("tiffin_replica_requests_running", "The replica's sequences in its batch.")
        self.replica_waiting = replica("tiffin_replica_requests_waiting", "The replica's sequences waiting.")
        self.replica_kv_blocks_used = replica(
            "tiffin_replica_kv_cache_blocks_used", "KV cache blocks held by the replica's sequences."
        )
        self.replica_load = replica(
            "tiffin_replica_load_tokens", "Tokens of the replica's requests in flight, as the router weighs them."
        )
        self.replica_restarts = Counter(  # prometheus_client appends _total
            "tiffin_replica_restarts", "Times the data-parallel replica was started again after it died.", ["replica"]
        )
        self.kv_bytes_per_token = Gauge(  # a property of the model: the same in every worker
            "tiffin_kv_cache_bytes_per_token",
            "KV cache bytes of one token, every layer (a rank's share under tensor parallelism).",
            multiprocess_mode="max",
        )
        self.step_age = Gauge(  # the engine watchdog's measure; the worst worker's
            "tiffin_engine_last_step_age_seconds",
            "Seconds the engine's step in progress has run, since the last one finished, while it holds requests (0 "
            "idle); past engine_stall_timeout the engine is stalled. engine: model or embedding.",
            ["engine"],
            multiprocess_mode="livemax",
        )
        # prometheus_client appends _total
        self.prefix_cache_queries = Counter(
            "tiffin_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = Counter("tiffin_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.host_tier_hits = Counter(
            "tiffin_prefix_cache_host_hits", "Prompt tokens loaded from the prefix cache's host tier (also hits)."
        )
        self.host_tier_evictions = Counter(
            "tiffin_prefix_cache_host_evictions", "Blocks dropped from the prefix cache's host tier to make room."
        )
        self.prefill_tokens = Counter(
            "tiffin_prefill_tokens", "Tokens computed before each sequence's newest one: prompts and recomputes."
        )
        self.swapped_out = Counter("tiffin_swapped_out_sequences", "Sequences preempted by swap (KV copied to host).")
        self.swapped_in = Counter("tiffin_swapped_in_sequences", "Swapped sequences resumed (KV copied back).")
        self.prompt_tokens = Counter("tiffin_prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = Counter("tiffin_generation_tokens", "Generated tokens.")
        self.preemptions = Counter("tiffin_preemptions", "Sequences preempted (recomputed or swapped).")
        self.embedding_requests = Counter(
            "tiffin_embedding_requests",
            "Inputs embedded or scored (pooling requests: /v1/embeddings, /v1/score, /v1/rerank, the typed APIs).",
        )
        self.embedding_tokens = Counter("tiffin_embedding_tokens", "Tokens of the inputs embedded or scored.")
        # vllm:spec_decode_*: acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts
        self.spec_drafts = Counter("tiffin_spec_decode_num_drafts", "Decodes that verified proposals.")
        self.spec_draft_tokens = Counter("tiffin_spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_accepted_tokens = Counter("tiffin_spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.spec_accepted_per_pos = Counter(  # per-position acceptance rate = this / drafts
            "tiffin_spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their position in the draft (0: the first).",
            ["position"],
        )
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
        self._seen: dict = {}  # (engine, counter) -> the engine total it was last advanced to

    def on_stats(self, stats: EngineStats) -> None:
        """The served model's AsyncLLMEngine `on_stats` hook (engine thread): gauges now, counters by their
        increase."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.requests_swapped.set(stats.num_swapped)
        self.host_kv_bytes_used.set(stats.host_kv_bytes_used)
        self.kv_bytes_per_token.set(stats.kv_bytes_per_token)
        self._advance("model", self.prompt_tokens, stats.prompt_tokens)
        self._advance("model", self.prefix_cache_queries, stats.prefix_cache_queries)
        self._advance("model", self.prefix_cache_hits, stats.prefix_cache_hits)
        self._advance("model", self.host_tier_hits, stats.host_tier_hits)
        self._advance("model", self.host_tier_evictions, stats.host_tier_evictions)
        self._advance("model", self.prefill_tokens, stats.prefill_tokens)
        self._advance("model", self.swapped_out, stats.swapped_out_seqs)
        self._advance("model", self.swapped_in, stats.swapped_in_seqs)
        self._advance("model", self.generation_tokens, stats.generation_tokens)
        self._advance("model", self.preemptions, stats.num_preemptions)
        self._advance("model", self.embedding_requests, stats.pooling_requests)  # the model may be a pooling one
        self._advance("model", self.embedding_tokens, stats.pooling_tokens)
        self._advance("model", self.spec_drafts, stats.spec_drafts)
        self._advance("model", self.spec_draft_tokens, stats.spec_draft_tokens)
        self._advance("model", self.spec_accepted_tokens, stats.spec_accepted_tokens)
        for position, total in enumerate(stats.spec_accepted_per_pos):
            self._advance("model", self.spec_accepted_per_pos.labels(position=str(position)), total)

    def on_replicas(self, health: list[dict]) -> None:
        """Each data-parallel replica's gauges, from the front's `replica_health()`."""
        for h in health:
            r = str(h["replica"])
            self.replica_up.labels(replica=r).set(int(h["alive"]))
            self.replica_running.labels(replica=r).set(h["num_running"])
            self.replica_waiting.labels(replica=r).set(h["num_waiting"])
            self.replica_kv_blocks_used.labels(replica=r).set(h["kv_blocks_used"])
            self.replica_load.labels(replica=r).set(h["load_tokens"])
            self._advance("model", self.replica_restarts.labels(replica=r), h["restarts"])

    def on_embedding_stats(self, stats: EngineStats) -> None:
        """The hook of the embedding engine beside the model: its pooling counters and KV gauges of its own (the
        others are the model's batch and KV cache)."""
        self.embedding_kv_blocks_used.set(stats.kv_blocks_used)
        self.embedding_kv_blocks_total.set(stats.kv_blocks_total)
        self._advance("embedding", self.embedding_requests, stats.pooling_requests)
        self._advance("embedding", self.embedding_tokens, stats.pooling_tokens)

    def on_step_age(self, engine: str, age: float) -> None:
        """An AsyncLLMEngine's `on_step_age` hook (its watchdog's thread), with `engine` bound: model or embedding."""
        self.step_age.labels(engine=engine).set(age)

    def _advance(self, engine: str, counter, total: int) -> None:
        seen = self._seen.get((engine, counter), 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[engine, counter] = total

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
