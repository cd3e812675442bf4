"""The metric families vLLM's server exports, with its names, `model_name` and `engine` labels and
bucket bounds, under a chosen prefix (`vllm` by default): a dashboard built for vLLM reads kvtier
unchanged. Written only by the engine thread; kvtier's own families live in `metrics.py`."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.server.config import check_metrics_prefix

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py, as its 0.29 server exposes them): data, kept
# equal so that a histogram_quantile over a fleet of vLLM and kvtier servers stays meaningful.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True, slots=True)
class MetricNames:
    """What names the vLLM-shaped series: the served model (`model_name` label) and the prefix."""

    model_name: str = "kvtier-default"  # the server's default served name (server/cli.py)
    prefix: str = "vllm"

    def __post_init__(self) -> None:
        check_metrics_prefix(self.prefix)


DEFAULT_NAMES = MetricNames()


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request as vLLM's request histograms see it; instants are time.monotonic()."""

    arrival: float
    scheduled: float | None  # first scheduled (None: aborted before any step took it)
    first_token: float | None
    last_token: float | None
    finished: float
    reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int  # prefix hit at first admission, lower tiers included
    num_external_cached_tokens: int  # of which loaded from a tier below the device
    max_tokens: int | None


class VllmMetrics:
    """vLLM's families in `registry`, every series labelled with the model name and engine 0."""

    def __init__(self, registry: CollectorRegistry, names: MetricNames, max_model_len: int):
        p, labels = names.prefix, ["model_name", "engine"]
        self._labels = (names.model_name, "0")
        r = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{p}:{name}", doc, labels, registry=r).labels(*self._labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{p}:{name}", doc, labels, registry=r).labels(*self._labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(f"{p}:{name}", doc, labels, registry=r, buckets=buckets)
            return h.labels(*self._labels)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting (loading ones included)")
        self.kv_usage = gauge("kv_cache_usage_perc", "Device KV-cache usage (1 = full)")
        # vLLM's name before 0.9, still read by its example dashboard
        self.gpu_usage = gauge("gpu_cache_usage_perc", "Device KV-cache usage (1 = full)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up on device")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found on device")
        self.external_queries = counter(
            "external_prefix_cache_queries", "Prompt tokens looked up below the device (host tier)"
        )
        self.external_hits = counter(
            "external_prefix_cache_hits", "Prompt tokens found below the device (host and lower)"
        )
        self.preemptions = counter("num_preemptions", "Requests preempted")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens served by the cache")
        by_source = Counter(
            f"{p}:prompt_tokens_by_source",
            "Prompt tokens by source",
            [*labels, "source"],
            registry=r,
        )
        self.by_source = {s: by_source.labels(*self._labels, s) for s in PROMPT_SOURCES}
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        success = Counter(
            f"{p}:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.success = {f: success.labels(*self._labels, f) for f in FINISH_REASONS}
        counts = one_two_five_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request", counts)
        self.gen_len = histogram(
            "request_generation_tokens", "Tokens generated per request", counts
        )
        self.max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter", counts
        )
        self.max_gen = histogram(
            "request_max_num_generation_tokens", "Most tokens a request may generate", counts
        )
        self.computed = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens computed (not cached)", counts
        )
        self.iteration = histogram(
            "iteration_tokens_total", "Tokens per engine step", ITERATION_TOKENS_BUCKETS
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Between a request's outputs", TOKEN_LATENCY_BUCKETS
        )
        # vLLM's earlier name of the same observations, still read by its example dashboard
        self.tpot = histogram(
            "time_per_output_token_seconds", "Between a request's outputs", TOKEN_LATENCY_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first, per request",
            TOKEN_LATENCY_BUCKETS,
        )
        self.phases = {
            name: histogram(name, doc, REQUEST_LATENCY_BUCKETS)
            for name, doc in (
                ("e2e_request_latency_seconds", "Arrival to finish"),
                ("request_queue_time_seconds", "Arrival to first scheduled (WAITING)"),
                ("request_inference_time_seconds", "First scheduled to last token (RUNNING)"),
                ("request_prefill_time_seconds", "First scheduled to first token (PREFILL)"),
                ("request_decode_time_seconds", "First token to last token (DECODE)"),
            )
        }

    def tokens(self, arrival: float, last: float | None, now: float, n: int) -> None:
        """A request's output of one step: `n` tokens at `now`, its previous at `last`."""
        self.generation_tokens.inc(n)
        if last is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - last)
            self.tpot.observe(now - last)

    def finished(self, rec: RequestRecord) -> None:
        self.success[rec.reason].inc()
        self.phases["e2e_request_latency_seconds"].observe(rec.finished - rec.arrival)
        self.prompt_len.observe(rec.num_prompt_tokens)
        self.gen_len.observe(rec.num_generation_tokens)
        if rec.max_tokens is not None:
            self.max_tokens.observe(rec.max_tokens)
            self.max_gen.observe(rec.max_tokens)
        computed = rec.num_prompt_tokens - rec.num_cached_tokens
        self.computed.observe(computed)
        self.cached_tokens.inc(rec.num_cached_tokens)
        self.by_source["local_compute"].inc(computed)
        self.by_source["local_cache_hit"].inc(
            rec.num_cached_tokens - rec.num_external_cached_tokens
        )
        self.by_source["external_kv_transfer"].inc(rec.num_external_cached_tokens)
        if rec.scheduled is None:
            return
        self.phases["request_queue_time_seconds"].observe(rec.scheduled - rec.arrival)
        if rec.first_token is None or rec.last_token is None:
            return
        decode = rec.last_token - rec.first_token
        self.phases["request_prefill_time_seconds"].observe(rec.first_token - rec.scheduled)
        self.phases["request_decode_time_seconds"].observe(decode)
        self.phases["request_inference_time_seconds"].observe(rec.last_token - rec.scheduled)
        n = rec.num_generation_tokens
        self.request_tpot.observe(decode / (n - 1) if n > 1 else 0.0)
