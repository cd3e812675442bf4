"""The engine in a process of its own, `kvtier serve`'s default (vLLM splits its API server from
its engine core the same way). The HTTP process keeps the event loop, tokenizing and the shaping
of responses; the engine process runs an `EngineLoop`. The two no longer take turns on one
interpreter lock: a busy HTTP loop stops delaying the scheduler and the forward's Python.

One duplex pipe (`multiprocessing.connection`, pickled tuples) carries, from the HTTP process:
`("submit", req_id, token_ids, params, priority, arrival)`, `("abort", req_id)`,
`("call", call_id, fn)`, `("metrics", call_id)`, `("rejected", status)`, `("stop",)`; and back:
`("ready", facts)` or `("start_failed", error)` once, then `("events", [(req_id, event), ...])` once per engine step,
`("reply", call_id, ok, value)`, and `("failed", error)` after the engine loop has answered every
request in flight. Requests are routed back by id; the HTTP process holds their sinks. The engine
loop's heartbeat (`server/liveness.py`) lives in shared memory beside the pipe: a stopped or hung
engine process sends nothing, and its beat's age says so."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.cli_args import configure_logging
from kvtier.engine.core import EngineCore
from kvtier.engine.params import EngineArgs
from kvtier.model.tokenizer import Tokenizer
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.errors import APIError
from kvtier.server.events import Delta, Event, Failed, Sink, Submission, engine_failed, put_all
from kvtier.server.liveness import ITERATION_TIMEOUT_S, Heartbeat, stall_reason
from kvtier.server.vllm_metrics import DEFAULT_NAMES, MetricNames

if TYPE_CHECKING:
    from kvtier.server.kv_events import KVEventsConfig

log = logging.getLogger("kvtier.server")
T = TypeVar("T")
STOP_TIMEOUT_S = 60.0  # the engine closes its tiers (queued disk and remote writes) before exit


class EngineProcess:
    """An `EngineClient` whose engine runs in a child process (spawned, so no thread of this one
    is forked); `start()` returns once it is ready. If the child dies, every request in flight is
    answered with the error and the `on_failure` callbacks run, as when an engine thread fails."""

    def __init__(
        self,
        args: EngineArgs,
        max_waiting_requests: int,
        fail_at_step: int | None = None,
        log_level: str = "info",
        iteration_timeout_s: float = ITERATION_TIMEOUT_S,
        metric_names: MetricNames = DEFAULT_NAMES,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        self.args = args
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = 0
        self.vocab_size = 0
        self.tokenizer: Tokenizer | None = None
        self.layout_summary = ""
        self.error: BaseException | None = None
        self.iteration_timeout_s = iteration_timeout_s
        self._heartbeat = Heartbeat()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        liveness = (self._heartbeat, iteration_timeout_s)
        self._proc = ctx.Process(
            target=_child_main,
            args=(
                child_conn,
                args,
                max_waiting_requests,
                fail_at_step,
                log_level,
                liveness,
                metric_names,
                kv_events,
            ),
            name="kvtier-engine",
            daemon=True,  # never outlives this process
        )
        self._child_conn: Connection | None = child_conn
        # INVARIANT: `_lock` orders registering a sink (then sending) against the failure drain:
        # every sink is either answered by the engine or failed here, never forgotten.
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._on_failure: list[Callable[[BaseException], None]] = []
        self._stopping = False
        self._last_metrics = b""
        self._reader = threading.Thread(target=self._read, name="kvtier-engine-pipe", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._proc.start()
        assert self._child_conn is not None
        self._child_conn.close()  # the child holds its end now: its exit reads as EOF here
        self._child_conn = None
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(
                f"the engine process exited while starting (exit code {self._proc.exitcode}); "
                "its log above says why"
            ) from None
        if msg[0] == "start_failed":
            self._proc.join(STOP_TIMEOUT_S)
            self.error = msg[1]
            raise msg[1]
        facts = msg[1]
        self.max_model_len = facts["max_model_len"]
        self.vocab_size = facts["vocab_size"]
        self.tokenizer = facts["tokenizer"]
        self.layout_summary = facts["layout_summary"]
        self._reader.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        with self._lock:
            self._stopping = True
            with contextlib.suppress(OSError):
                self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():  # it ignores SIGTERM (see `_child_main`): kill it
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        if self._reader.is_alive():
            self._reader.join(5)
        self._conn.close()

    @property
    def is_alive(self) -> bool:
        return self._proc.is_alive() and self.error is None

    def unhealthy(self) -> str | None:
        """Why `/health` should answer 503 (failed, exited, or its loop silent past the
        deadline: hung or stopped); None when healthy."""
        if not self.is_alive:
            return f"engine is not running: {self.error or 'its process has exited'}"
        return stall_reason(self._heartbeat, self.iteration_timeout_s)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def on_failure(self, fn: Callable[[BaseException], None]) -> None:
        """As `EngineLoop.on_failure`; `fn` runs on this process's pipe-reading thread."""
        with self._lock:
            if self.error is None:
                self._on_failure.append(fn)
                return
        fn(self.error)

    # ---- requests --------------------------------------------------------------------------------

    def submit(self, sub: Submission) -> None:
        refusal: APIError | None = None
        with self._lock:  # the reader routes under it too: registering first is safe
            if self.error is not None:
                refusal = engine_failed(self.error)
            else:
                self._sinks[sub.req_id] = sub.sink
                msg = ("submit", sub.req_id, sub.token_ids, sub.params, sub.priority, sub.arrival)
                try:
                    self._send(msg)
                except OSError:  # the child is gone: the reader fails every registered sink
                    pass
                except Exception as exc:  # it did not pickle: nothing was written
                    del self._sinks[sub.req_id]
                    msg_ = f"the request could not be sent to the engine process: {exc}"
                    refusal = APIError(msg_, 500, kind="server_error")
        if refusal is not None:
            sub.sink.put(Failed(refusal))

    def abort(self, req_id: str) -> None:
        with self._lock:
            if self.error is None and req_id in self._sinks:
                with contextlib.suppress(OSError):
                    self._send(("abort", req_id))

    def call(self, fn: Callable[[EngineCore], T], timeout: float = 30.0) -> T:
        """Run `fn(engine)` in the engine process between steps; `fn` is pickled by reference,
        so it must be a module-level function (tests, debugging)."""
        return self._request(lambda cid: ("call", cid, fn), timeout)  # type: ignore[no-any-return]

    def metrics_text(self) -> bytes:
        """The engine process's Prometheus exposition (the last one seen once it has died)."""
        if self.error is None:
            with contextlib.suppress(Exception):
                self._last_metrics = self._request(lambda cid: ("metrics", cid), 10.0)
        return self._last_metrics

    def rejected(self, status: int) -> None:
        with self._lock:
            if self.error is None:
                with contextlib.suppress(OSError):
                    self._send(("rejected", status))

    def _request(self, make: Callable[[int], tuple[Any, ...]], timeout: float) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                raise self.error
            cid = next(self._call_ids)
            self._calls[cid] = fut
            try:
                self._send(make(cid))
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                del self._calls[cid]
                raise TypeError(
                    f"EngineProcess.call sends its function to the engine process by reference: "
                    f"{exc}; pass a module-level function"
                ) from exc
        return fut.result(timeout)

    def _send(self, msg: tuple[Any, ...]) -> None:
        self._conn.send(msg)  # callers hold `_lock`

    # ---- the pipe-reading thread -----------------------------------------------------------------

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "events":
                    self._route(msg[1])
                elif kind == "reply":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    if fut is not None:
                        if msg[2]:
                            fut.set_result(msg[3])
                        else:
                            fut.set_exception(msg[3])
                elif kind == "failed":
                    error = msg[1]
                    self._fail(msg[1])
        except (EOFError, OSError):
            pass
        self._proc.join(5)
        if error is not None:
            return
        if self._stopping:  # a stop, not a failure: answer what is left, record nothing
            self._fail(RuntimeError("the engine process has stopped"), record=False)
            return
        error = RuntimeError(
            f"the engine process exited unexpectedly (exit code {self._proc.exitcode})"
        )
        log.error("%s; failing every request in flight", error)
        self._fail(error)

    def _route(self, batch: list[tuple[str, Event]]) -> None:
        events: list[tuple[Sink, Event]] = []
        with self._lock:
            for req_id, event in batch:
                sink = self._sinks.get(req_id)
                if sink is None:
                    continue
                if isinstance(event, Failed) or (
                    isinstance(event, Delta) and event.finish_reason is not None
                ):
                    del self._sinks[req_id]
                events.append((sink, event))
        put_all(events)

    def _fail(self, exc: BaseException, record: bool = True) -> None:
        with self._lock:
            if self.error is not None:
                return
            if record:
                self.error = exc
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
            callbacks, self._on_failure = (self._on_failure, []) if record else ([], [])
        put_all([(sink, Failed(engine_failed(exc))) for sink in sinks.values()])
        for fut in calls.values():
            fut.set_exception(exc)
        for fn in callbacks:
            fn(exc)


# ---- the engine process ------------------------------------------------------------------------


class _PipeOutlet:
    """The engine thread's events for the HTTP process: one message per step."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._send = send

    def deliver(self, batch: list[tuple[Any, Event]]) -> None:
        with contextlib.suppress(OSError):  # the HTTP process is gone; the reader stops us
            self._send(("events", batch))


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child_main(
    conn: Connection,
    args: EngineArgs,
    max_waiting_requests: int,
    fail_at_step: int | None,
    log_level: str,
    liveness: tuple[Heartbeat, float],
    metric_names: MetricNames,
    kv_events: KVEventsConfig | None = None,
) -> None:
    # The HTTP process owns shutdown: a Ctrl-C or SIGTERM to the process group reaches it, and it
    # stops this one with "stop" after uvicorn has drained (the tiers then finish their writes).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(log_level)
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    loop = EngineLoop(
        args,
        max_waiting_requests,
        fail_at_step,
        *liveness,
        metric_names=metric_names,
        kv_events=kv_events,  # the publisher lives here, beside the engine's events
    )
    try:
        loop.start()
    except BaseException as exc:
        if not isinstance(exc, ValueError):  # a user error is one line in the HTTP process
            log.exception("the engine could not start")
        send(("start_failed", _picklable(exc)))
        return
    facts = {
        "max_model_len": loop.max_model_len,
        "vocab_size": loop.vocab_size,
        "tokenizer": loop.tokenizer,
        "layout_summary": loop.layout_summary,
    }
    send(("ready", facts))
    outlet = _PipeOutlet(send)
    loop.on_failure(lambda exc: send(("failed", _picklable(exc))))

    def reply(call_id: int, fut: concurrent.futures.Future[Any]) -> None:
        exc = fut.exception()
        ok = exc is None
        try:
            send(("reply", call_id, ok, fut.result() if exc is None else _picklable(exc)))
        except OSError:  # the HTTP process is gone
            pass
        except Exception as err:  # the result does not pickle
            with contextlib.suppress(OSError):
                send(("reply", call_id, False, TypeError(f"the call's result: {err}")))

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone
            break
        kind = msg[0]
        if kind == "submit":
            _, req_id, token_ids, params, priority, arrival = msg
            loop.submit(
                Submission(req_id, token_ids, params, Sink(outlet, req_id), priority, arrival)
            )
        elif kind == "abort":
            loop.abort(msg[1])
        elif kind == "call":
            loop.call_soon(msg[2]).add_done_callback(functools.partial(reply, msg[1]))
        elif kind == "rejected":
            loop.rejected(msg[1])
        elif kind == "metrics":
            with contextlib.suppress(OSError):
                send(("reply", msg[1], True, loop.metrics_text()))
        elif kind == "stop":
            break
    loop.stop(STOP_TIMEOUT_S)
    conn.close()
