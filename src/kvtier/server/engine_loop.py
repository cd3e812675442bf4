"""The engine thread: the only thread that touches `EngineCore`. HTTP handlers (or, in an engine
process, its pipe reader) send it commands through a thread-safe queue and receive events through
their sinks (`server/events.py`); it never blocks on them, nor on a request's grammar compiling
(the request waits for it, off the thread, while the others step). It warms the engine up before
it says ready and stamps a heartbeat on every pass (`server/liveness.py`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import generate_latest

from kvtier.engine.core import EngineCore
from kvtier.engine.params import EngineArgs
from kvtier.engine.requests import FinishedRequest, StepOutput
from kvtier.model.tokenizer import Tokenizer
from kvtier.server.errors import APIError
from kvtier.server.events import (
    Delta,
    Event,
    Failed,
    Sink,
    Started,
    Submission,
    Usage,
    engine_failed,
    put_all,
)
from kvtier.server.liveness import ITERATION_TIMEOUT_S, Heartbeat, stall_reason, warm_up
from kvtier.server.logprobs import prompt_logprobs, token_logprobs
from kvtier.server.metrics import EngineMetrics
from kvtier.server.vllm_metrics import DEFAULT_NAMES, MetricNames, RequestRecord

if TYPE_CHECKING:  # KV events need the kv-events extra: imported when configured
    from kvtier.server.kv_events import KVEventsConfig
    from kvtier.server.kv_publisher import KVEventPublisher

log = logging.getLogger("kvtier.server")
T = TypeVar("T")


@dataclass(slots=True)
class _Live:
    sub: Submission
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None


METRICS_INTERVAL_S = 0.05  # the Prometheus gauges' staleness bound while requests run


class EngineLoop:
    """Owns an `EngineCore` on a daemon thread; `start()` builds and warms it up there and waits
    until ready. `heartbeat`: stamped on every pass (an engine process passes in the one its HTTP
    process reads); `iteration_timeout_s`: the longest pass `unhealthy` tolerates."""

    def __init__(
        self,
        args: EngineArgs,
        max_waiting_requests: int,
        fail_at_step: int | None = None,
        heartbeat: Heartbeat | None = None,
        iteration_timeout_s: float = ITERATION_TIMEOUT_S,
        metric_names: MetricNames = DEFAULT_NAMES,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        if kv_events is not None and kv_events.publishes != args.enable_kv_cache_events:
            raise ValueError("args.enable_kv_cache_events must match kv_events.publishes")
        self.args = args
        # Each pass's KV cache events go to this publisher (server/kv_publisher.py), built with
        # the engine on its thread; None without --kv-events-config.
        self.kv_events = kv_events
        self.kv_publisher: KVEventPublisher | None = None
        self.metric_names = metric_names
        self.max_waiting_requests = max_waiting_requests
        # Testing aid: the engine thread raises instead of running its `fail_at_step`-th step
        # (1-based), exactly where a real step failure would surface.
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self.metrics: EngineMetrics  # built with the engine (its buckets need max_model_len)
        self.error: BaseException | None = None
        self._on_failure: list[Callable[[BaseException], None]] = []
        # Read-only facts about the engine, set once before `start()` returns. The tokenizer is
        # shared with the engine thread: encode/decode are safe from any thread.
        self.max_model_len = 0
        self.vocab_size = 0
        self.tokenizer: Tokenizer | None = None
        self.layout_summary = ""
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._failure_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="kvtier-engine", daemon=True)
        self._live: dict[str, _Live] = {}
        # Submitted, waiting for their grammar to compile on a worker (`_submit`); admitted by
        # the "compiled" command the compile's future posts
        self._compiling: dict[str, Submission] = {}
        # Events made on the engine thread, handed to their outlets once per pass of the loop
        # (`_flush`): admissions' `Started` travel with the step's deltas, one message per step
        # through an engine process's pipe instead of one more per admitted request.
        self._outbox: list[tuple[Sink, Event]] = []
        self._metrics_due = 0.0  # monotonic time of the next metrics snapshot under load
        self.heartbeat = heartbeat or Heartbeat()
        self.iteration_timeout_s = iteration_timeout_s
        self._idle_wait_s = min(1.0, iteration_timeout_s / 4)  # an idle loop still beats
        self._last_step_seq = 0  # the last processed step counted in the metrics

    # ---- called from other threads ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    def on_failure(self, fn: Callable[[BaseException], None]) -> None:
        """Call `fn(error)` once the engine thread has failed and answered every request in
        flight (at once if it already has). `fn` runs on the engine thread: keep it short."""
        with self._failure_lock:
            if self.error is None:
                self._on_failure.append(fn)
                return
        fn(self.error)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def unhealthy(self) -> str | None:
        """Why `/health` should answer 503 (failed, gone, or no pass within the deadline); None
        when healthy."""
        if not self.is_alive:
            return f"engine is not running: {self.error}"
        return stall_reason(self.heartbeat, self.iteration_timeout_s)

    def submit(self, sub: Submission) -> None:
        with self._failure_lock:  # INVARIANT: nothing is queued after the failure drain
            if self.error is None:
                self._commands.put(("submit", sub))
                return
        sub.sink.put(Failed(engine_failed(self.error)))

    def abort(self, req_id: str) -> None:
        self._commands.put(("abort", req_id))

    def call(self, fn: Callable[[EngineCore], T], timeout: float = 30.0) -> T:
        """Run `fn(engine)` on the engine thread between steps (tests, debugging)."""
        return self.call_soon(fn).result(timeout)

    def call_soon(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """`call` without waiting: the future completes on the engine thread."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._failure_lock:
            if self.error is None:
                self._commands.put(("call", (fn, fut)))
                return fut
        fut.set_exception(self.error)
        return fut

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of this engine's metrics (safe from any thread)."""
        return generate_latest(self.metrics.registry)

    def rejected(self, status: int) -> None:
        self.metrics.rejected(status)  # a prometheus counter is safe from any thread

    # ---- the engine thread -----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            engine = EngineCore(self.args)  # sets torch's threads (args.torch_threads)
            self.max_model_len = engine.plan.max_model_len
            self.vocab_size = engine.model_config.vocab_size
            self.tokenizer = engine.tokenizer
            self.layout_summary = layout_summary(engine)
            self.metrics = EngineMetrics(engine.plan.max_model_len, self.metric_names)
            self.metrics.set_layout(engine)
        except BaseException as exc:
            self.error = exc
            self._ready.set()
            return
        try:
            warm_up(engine)
            self.kv_publisher = self._start_publisher(engine)
        except BaseException as exc:
            log.exception("the engine's warm-up forward failed")
            with contextlib.suppress(Exception):  # release the disk folder and connections
                engine.close()
            self.error = exc
            self._ready.set()
            return
        self.heartbeat.beat()
        self._ready.set()
        try:
            self._loop(engine)
            engine.close()  # the disk and remote tiers finish their queued writes
            self._publish_kv_events(engine)  # what their last writes reported
        except Exception as exc:
            log.exception("engine loop failed; failing every request in flight")
            self._flush()  # what was decided before the failure (a refusal, a Started) goes first
            with self._failure_lock:
                self.error = exc
                callbacks, self._on_failure = self._on_failure, []
            for live in self._live.values():
                live.sub.sink.put(Failed(engine_failed(exc)))
            for sub in self._compiling.values():
                sub.sink.put(Failed(engine_failed(exc)))
            self._live.clear()
            self._compiling.clear()
            self._fail_pending(exc)
            for fn in callbacks:
                fn(exc)
            with contextlib.suppress(Exception):  # release the disk folder and connections
                engine.close()
        finally:
            if self.kv_publisher is not None:
                self.kv_publisher.close()

    def _start_publisher(self, engine: EngineCore) -> KVEventPublisher | None:
        if self.kv_events is None or not self.kv_events.publishes:
            return None
        from kvtier.server.kv_events import KVEventEncoder
        from kvtier.server.kv_publisher import KVEventPublisher

        engine.take_kv_events()  # the warm-up's (it caches nothing; drained to be sure)
        url, pool = engine.args.cache.kv_remote_url, None
        if url is not None:  # the shared pool by its host:port/db, never its credentials
            from kvtier.stores.redis_store import redis_url

            pool = redis_url(url)[1]
        publisher = KVEventPublisher(self.kv_events, KVEventEncoder(remote_pool=pool))
        publisher.start()
        return publisher

    def _publish_kv_events(self, engine: EngineCore) -> None:
        if self.kv_publisher is not None:
            events = engine.take_kv_events()
            if events:
                self.kv_publisher.publish(events)

    def _fail_pending(self, exc: BaseException) -> None:
        """Answer commands that raced with a failure (later ones are refused by `submit`)."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                arg.sink.put(Failed(engine_failed(exc)))
            elif kind == "call":
                arg[1].set_exception(exc)

    def _loop(self, engine: EngineCore) -> None:
        while True:
            self.heartbeat.beat()
            busy = engine.has_unfinished_requests()
            try:
                wait = self._idle_wait_s
                cmd = self._commands.get_nowait() if busy else self._commands.get(timeout=wait)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._flush()
                    return
                self._handle(engine, cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            finished = False
            if engine.has_unfinished_requests():
                self.num_steps += 1
                if self.num_steps == self.fail_at_step:
                    raise RuntimeError(f"injected fault at engine step {self.num_steps}")
                finished = self._dispatch(engine, engine.step())
                step_seq, num_tokens = engine.last_step
                if step_seq != self._last_step_seq:
                    self._last_step_seq = step_seq
                    if num_tokens:
                        self.metrics.step(num_tokens)
            self._flush()
            self._publish_kv_events(engine)
            now = time.monotonic()
            # A snapshot reads every pool: under load, one per METRICS_INTERVAL_S, and at once
            # when a request finished or the engine went idle (so a scrape after a response
            # sees it counted).
            if finished or now >= self._metrics_due or not engine.has_unfinished_requests():
                self.metrics.update(engine.stats())
                if self.kv_publisher is not None:
                    pub = self.kv_publisher.stats()
                    self.metrics.kv_events(pub.num_batches, pub.num_dropped_batches)
                self._metrics_due = now + METRICS_INTERVAL_S

    def _handle(self, engine: EngineCore, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind in ("submit", "compiled"):
            if kind == "compiled" and self._compiling.pop(arg.req_id, None) is None:
                return  # aborted while its grammar compiled
            try:
                if kind == "submit":
                    self._submit(engine, arg)
                else:
                    self._admit(engine, arg)
            except APIError as exc:  # counted by the HTTP layer, once per HTTP request
                self._outbox.append((arg.sink, Failed(exc)))
            except Exception as exc:  # add_request raises before recording anything: carry on
                log.exception("request %s could not be admitted", arg.req_id)
                error = APIError(f"internal error: {exc}", 500, kind="server_error")
                self._outbox.append((arg.sink, Failed(error)))
        elif kind == "abort":
            if self._compiling.pop(arg, None) is not None:
                engine.abort(arg)  # drops the grammar held for it; it was never admitted
                return
            live = self._live.pop(arg, None)
            result = engine.abort(arg) if live is not None else None
            if live is not None and result is not None:
                self.metrics.finished(_record(live, result, time.monotonic()))
                usage = Usage(
                    live.num_prompt_tokens, len(result.token_ids), result.num_cached_tokens
                )
                self._outbox.append((live.sub.sink, Delta("", [], "abort", None, usage)))
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(engine))
            except Exception as exc:
                fut.set_exception(exc)

    def _submit(self, engine: EngineCore, sub: Submission) -> None:
        """Admit `sub`, or, while its grammar compiles on a worker, keep it aside until the
        compile's "compiled" command: the engine thread goes on stepping the others."""
        if self._backlog(engine) >= self.max_waiting_requests:
            raise APIError(
                f"the server is busy: {self.max_waiting_requests} requests already wait beyond "
                "its free running slots (--max-waiting-requests); retry later",
                429,
                kind="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        try:
            ready = engine.prepare_request(sub.req_id, sub.token_ids, sub.params, sub.priority)
        except ValueError as exc:
            raise APIError(str(exc)) from None
        if ready is None:
            self._admit(engine, sub)
            return
        self._compiling[sub.req_id] = sub
        ready.add_done_callback(lambda _: self._commands.put(("compiled", sub)))

    def _admit(self, engine: EngineCore, sub: Submission) -> None:
        n = len(sub.token_ids)
        try:
            engine.add_request(sub.req_id, sub.token_ids, sub.params, sub.priority)
        except ValueError as exc:  # a grammar that did not compile among them
            raise APIError(str(exc)) from None
        self._live[sub.req_id] = _Live(sub, n)
        self.metrics.admitted(n)
        self._outbox.append((sub.sink, Started(n)))

    def _backlog(self, engine: EngineCore) -> int:
        """Waiting requests (those whose grammar compiles among them) beyond the free running
        slots (negative: room to start more now). Slots only: a request held back by KV blocks
        still counts as able to run."""
        waiting = engine.num_unfinished_requests() + len(self._compiling)
        return waiting - engine.args.scheduler.max_num_seqs

    def _flush(self) -> None:
        events, self._outbox = self._outbox, []
        if events:
            put_all(events)

    def _dispatch(self, engine: EngineCore, outs: list[StepOutput]) -> bool:
        """Queue each output for its request's sink (sent with the pass's other events: one
        wake-up of the HTTP loop per step); True if a request finished."""
        now = time.monotonic()
        decode = engine.tokenizer.decode
        events = self._outbox
        finished = False
        for out in outs:
            live = self._live.get(out.req_id)
            if live is None:
                continue
            if out.new_token_ids:
                self.metrics.tokens(live.sub.arrival, live.last_token, now, len(out.new_token_ids))
                live.first_token = live.first_token or now
                live.last_token = now
            delta = Delta(out.new_text, list(out.new_token_ids))
            if out.new_logprobs is not None:
                delta.logprobs = token_logprobs(decode, out.new_token_ids, out.new_logprobs)
            if out.prompt_logprobs is not None:
                delta.prompt_logprobs = prompt_logprobs(
                    decode, live.sub.token_ids, out.prompt_logprobs
                )
            if out.result is not None:
                del self._live[out.req_id]
                result = out.result
                delta.finish_reason = result.finish_reason
                delta.stop_reason = result.stop_reason
                self.metrics.finished(_record(live, result, now))
                delta.usage = Usage(
                    live.num_prompt_tokens, len(result.token_ids), result.num_cached_tokens
                )
                finished = True
            events.append((live.sub.sink, delta))
        return finished


def _record(live: _Live, result: FinishedRequest, now: float) -> RequestRecord:
    return RequestRecord(
        arrival=live.sub.arrival,
        scheduled=result.scheduled_time,
        first_token=live.first_token,
        last_token=live.last_token,
        finished=now,
        reason=result.finish_reason,
        num_prompt_tokens=live.num_prompt_tokens,
        num_generation_tokens=len(result.token_ids),
        num_cached_tokens=result.num_cached_tokens,
        num_external_cached_tokens=result.num_external_cached_tokens,
        max_tokens=live.sub.params.max_tokens,
    )


def layout_summary(engine: EngineCore) -> str:
    """One line: groups (kind, window, layers), block size and bytes, blocks and bytes per tier."""
    plan = engine.plan
    groups = []
    for g in plan.groups:
        spec = g.spec
        window = getattr(spec, "window", None)
        chunk = getattr(spec, "chunk", None)
        name = type(spec).__name__
        name += f"(window={window})" if window else f"(chunk={chunk})" if chunk else ""
        groups.append(f"{name} layers {list(g.layer_indices)}")
    tiers = ", ".join(
        f"{t.name} {t.num_blocks} blocks × {t.bytes_per_block} B = {t.total_bytes / 2**20:.1f} MiB"
        for t in plan.tiers
    )
    return (
        f"KV layout: {len(plan.groups)} groups [{'; '.join(groups)}], block {plan.block_size} "
        f"tokens, max_model_len {plan.max_model_len}; tiers: {tiers}; max concurrency at max "
        f"length {plan.max_concurrency()} (admission {plan.admission.name})"
    )
