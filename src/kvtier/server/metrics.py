"""Prometheus metrics of one server (its own registry): vLLM's families (`vllm_metrics.py`, under
`vllm:` by default) and kvtier's own under `kvtier:` (per tier, transfers, hazards, quarantine,
refusals). Written only by the engine thread (after each step); prometheus-client's own locks make
scraping safe."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.server.vllm_metrics import DEFAULT_NAMES, MetricNames, RequestRecord, VllmMetrics

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore
    from kvtier.engine.stats import EngineStats
    from kvtier.offload.chain import TierStats


KERNEL_POOL_MODES = ("with_helpers", "alone")


class EngineMetrics:
    """Counters come with their denominators: prefix hits beside queries, usage beside blocks.
    `max_model_len` bounds vLLM's token-count buckets."""

    def __init__(self, max_model_len: int, names: MetricNames = DEFAULT_NAMES) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.vllm = VllmMetrics(r, names, max_model_len)
        tier = ["tier"]
        self.kv_usage = Gauge(
            "kvtier:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", tier, registry=r
        )
        self.kv_blocks = Gauge(
            "kvtier:kv_cache_num_blocks",
            "KV blocks in the tier (null block excluded)",
            tier,
            registry=r,
        )
        self.max_concurrency = Gauge(
            "kvtier:max_concurrency",
            "Requests of max_model_len tokens the tier holds at once, as admission charges them",
            tier,
            registry=r,
        )
        self.prefix_queries = Counter(
            "kvtier:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (denominator of hits)",
            tier,
            registry=r,
        )
        self.prefix_hits = Counter(
            "kvtier:prefix_cache_hits", "Prompt tokens found in the prefix cache", tier, registry=r
        )
        self.request_rejected = Counter(
            "kvtier:request_rejected",
            "Requests refused before admission, by HTTP status (400 bad input, 429 queue full)",
            ["status"],
            registry=r,
        )
        self.kv_event_batches = Counter(
            "kvtier:kv_event_batches",
            "KV cache event batches (--kv-events-config): sent on the PUB socket, or dropped by "
            "the publisher's full queue (max_queue_size; consumers see a sequence gap)",
            ["op"],
            registry=r,
        )
        self.quarantined = Gauge(
            "kvtier:kv_quarantined_block_refs",
            "Block references held by the quarantine until the last step that may touch them "
            "is processed",
            registry=r,
        )
        self.hazards = Counter(
            "kvtier:sanitizer_hazards",
            "Races reported by the happens-before sanitizer (0 when it is off)",
            ["kind"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvtier:kv_transfer_bytes",
            "Bytes copied between KV tiers (0 without a host tier)",
            ["direction"],
            registry=r,
        )
        self.pending_transfers = Gauge(
            "kvtier:kv_pending_transfers",
            "KV transfers planned, not yet complete (0 without a host tier)",
            registry=r,
        )
        self.tier_bytes = Counter(
            "kvtier:kv_tier_bytes",
            "Bytes of KV blocks read from (promoted) and queued to (demoted) the disk and remote "
            "tiers",
            ["tier", "direction"],
            registry=r,
        )
        self.tier_blocks = Counter(
            "kvtier:kv_tier_blocks",
            "KV blocks promoted from, demoted to, dropped (back-pressure) by, or refused (Redis "
            "out of memory) by a lower tier",
            ["tier", "op"],
            registry=r,
        )
        self.tier_errors = Counter(
            "kvtier:kv_tier_errors",
            "Failed I/O batches, batches past their deadline and corrupt values of a lower tier "
            "(each a miss, then recompute)",
            ["tier", "kind"],
            registry=r,
        )
        self.kernel_pool_calls = Counter(
            "kvtier:kernel_pool_calls",
            "Native kernel calls that could split across threads: run with the pool's helpers, "
            "or alone because helpers did not pay lately (another process on their cores)",
            ["mode"],
            registry=r,
        )
        self.kernel_pool_spells = Counter(
            "kvtier:kernel_pool_spells_alone",
            "Spells in which every native kernel call ran alone (docs/architecture.md §Threads)",
            registry=r,
        )
        self.tier_latency = _TierLatency()
        r.register(self.tier_latency)
        for direction in ("device_to_host", "host_to_device"):
            self.transfer_bytes.labels(direction)
        for kind in ("RAW", "WAR", "WAW"):
            self.hazards.labels(kind)
        for status in ("400", "429", "500"):  # a refusal-free server still shows its zeros
            self.request_rejected.labels(status)
        for mode in KERNEL_POOL_MODES:
            self.kernel_pool_calls.labels(mode)
        self._seen: dict[str, int] = {}

    def set_layout(self, engine: EngineCore) -> None:
        for t in engine.plan.tiers:
            self.kv_blocks.labels(t.name).set(t.num_blocks - 1)
            self.max_concurrency.labels(t.name).set(engine.plan.max_concurrency(t.name))
        self.update(engine.stats())

    # ---- engine thread ---------------------------------------------------------------------------

    def _delta(self, name: str, value: int) -> int:
        d = value - self._seen.get(name, 0)
        self._seen[name] = value
        return d

    def _prefix(self, tier: str, num_query_tokens: int, num_hit_tokens: int) -> tuple[int, int]:
        """Advance `tier`'s prefix-cache counters to the snapshot's totals; the increments."""
        queries = self._delta(f"{tier}:queries", num_query_tokens)
        hits = self._delta(f"{tier}:hits", num_hit_tokens)
        self.prefix_queries.labels(tier).inc(queries)
        self.prefix_hits.labels(tier).inc(hits)
        return queries, hits

    def update(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters to an engine snapshot (`EngineCore.stats`)."""
        prefix, v = stats.prefix_cache, self.vllm
        self.kv_usage.labels("device").set(stats.device.usage)
        v.kv_usage.set(stats.device.usage)
        v.gpu_usage.set(stats.device.usage)
        queries, hits = self._prefix("device", prefix.num_query_tokens, prefix.num_hit_tokens)
        v.prefix_queries.inc(queries)
        v.prefix_hits.inc(hits)
        v.running.set(stats.num_running)
        v.waiting.set(stats.num_waiting + stats.num_loading)
        v.preemptions.inc(self._delta("p", stats.num_preemptions))
        self.quarantined.set(stats.device.num_quarantined_refs)
        m = stats.host_metrics
        if stats.host is not None and m is not None:
            self.kv_usage.labels("host").set(stats.host.usage)
            queries, hits = self._prefix("host", m.num_query_tokens, m.num_hit_tokens)
            v.external_queries.inc(queries)
            v.external_hits.inc(hits)
            self.transfer_bytes.labels("device_to_host").inc(self._delta("sb", m.num_stored_bytes))
            self.transfer_bytes.labels("host_to_device").inc(self._delta("lb", m.num_loaded_bytes))
            self.pending_transfers.set(m.num_pending_loads + m.num_pending_stores)
        for kind, n in stats.hazards.items():
            self.hazards.labels(kind).inc(self._delta(kind, n))
        for t in stats.tiers:
            self._update_tier(t)
        pool = stats.kernel_pool
        for mode in KERNEL_POOL_MODES:
            self.kernel_pool_calls.labels(mode).inc(self._delta(f"pool:{mode}", pool.get(mode, 0)))
        self.kernel_pool_spells.inc(self._delta("pool:spells", pool.get("spells_alone", 0)))
        self.tier_latency.tiers = stats.tiers

    def _update_tier(self, t: TierStats) -> None:
        m, s, name = t.metrics, t.store, t.name
        self.prefix_queries.labels(name).inc(self._delta(f"{name}q", m.num_query_tokens))
        self.prefix_hits.labels(name).inc(self._delta(f"{name}h", m.num_hit_tokens))
        for direction, n in (("read", m.num_promoted_bytes), ("write", m.num_demoted_bytes)):
            self.tier_bytes.labels(name, direction).inc(self._delta(f"{name}b{direction}", n))
        blocks = (
            ("promoted", m.num_promoted_blocks),
            ("demoted", m.num_demoted_blocks),
            ("dropped", m.num_dropped_blocks + s.num_dropped),
            ("refused", s.num_refused),
        )
        for op, n in blocks:
            self.tier_blocks.labels(name, op).inc(self._delta(f"{name}k{op}", n))
        for kind, n in (
            ("error", s.num_errors),
            ("timeout", s.num_timeouts),
            ("corrupt", s.num_corrupt),
        ):
            self.tier_errors.labels(name, kind).inc(self._delta(f"{name}e{kind}", n))

    def kv_events(self, num_sent: int, num_dropped: int) -> None:
        """Advance the KV event counters to the publisher's totals."""
        self.kv_event_batches.labels("sent").inc(self._delta("kv_sent", num_sent))
        self.kv_event_batches.labels("dropped").inc(self._delta("kv_dropped", num_dropped))

    def admitted(self, num_prompt_tokens: int) -> None:
        self.vllm.prompt_tokens.inc(num_prompt_tokens)

    def rejected(self, status: int) -> None:
        self.request_rejected.labels(str(status)).inc()

    def tokens(self, arrival: float, last: float | None, now: float, n: int) -> None:
        """A request's output of one step: `n` tokens at `now`, its previous output at `last`."""
        self.vllm.tokens(arrival, last, now, n)

    def step(self, num_tokens: int) -> None:
        """An engine step processed with `num_tokens` scheduled."""
        self.vllm.iteration.observe(num_tokens)

    def finished(self, record: RequestRecord) -> None:
        self.vllm.finished(record)


class _TierLatency(Collector):
    """The lower tiers' store latency histograms (`StoreStats`), exported as the engine thread's
    last snapshot (`tiers`, replaced whole: a scrape reads one consistent tuple)."""

    def __init__(self) -> None:
        self.tiers: tuple[TierStats, ...] = ()

    def collect(self) -> Iterator[Metric]:
        for op in ("get", "put"):
            family = HistogramMetricFamily(
                f"kvtier:kv_tier_{op}_latency_seconds",
                f"Latency of one batch {op} on a lower KV tier's store",
                labels=["tier"],
            )
            for t in self.tiers:
                h = t.store.get_latency if op == "get" else t.store.put_latency
                buckets, total = [], 0
                for le, n in zip([*map(str, h.buckets), "+Inf"], h.counts, strict=True):
                    total += n
                    buckets.append((le, float(total)))
                family.add_metric([t.name], buckets, h.sum_s)
            yield family
