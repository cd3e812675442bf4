"""EngineCore: scheduler + runner + device for one model, with the synchronous loop and the async
batch-queue loop side by side (the difference between them is the `step_async` method).

Its callers use a small surface: `add_request`, `step` (a `StepOutput` per request that gained
something, a `FinishedRequest` on its last), `abort`, `drain`, `stats()` and the read-only facts
(`tokenizer`, `model_config`, `plan`, `args`). The engine keeps its own books: it forgets a request
when it hands out its `FinishedRequest`."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from kvtier.device import KVLayout, SanitizerMode, make_device
from kvtier.engine import allocator
from kvtier.engine.params import EngineArgs, SamplingParams, check_request
from kvtier.engine.prompts import bad_words_token_ids
from kvtier.engine.requests import (
    FINISH_REASONS,
    FinishedRequest,
    RequestBook,
    RequestState,
    StepOutput,
)
from kvtier.engine.sizing import plan_engine
from kvtier.engine.stats import EngineStats, collect_stats
from kvtier.engine.threads import configure_torch_threads
from kvtier.engine.tiers import build_chain
from kvtier.ids import ReqId
from kvtier.kv.events import KVEvent
from kvtier.kv.manager import KVCacheManager
from kvtier.model import IncrementalDetokenizer, load_tokenizer, native
from kvtier.model.grammar import Grammars
from kvtier.model.hf_config import load_model_config
from kvtier.model.loader import model_folder, resolve_dtype
from kvtier.model.served import load_served
from kvtier.offload import HostTier, lazy_scan_blocks_for
from kvtier.runner import ModelRunner, StepHandle
from kvtier.runner.draft_states import DraftStates
from kvtier.runner.transfers import TransferFaults
from kvtier.sched.batch_queue import BatchQueue
from kvtier.sched.output import SchedulerOutput, TokenLogprobs
from kvtier.sched.request import Request, RequestStatus
from kvtier.sched.scheduler import Scheduler

log = logging.getLogger("kvtier.engine")
# How long one step waits for a disk or remote read when no request can run without one.
TIER_POLL_S = 0.01


class EngineCore:
    """Owns the model, KV cache manager, scheduler, device and runner of one engine."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        path = model_folder(args.model_path)  # a GGUF or other file gets its own clear error
        self.model_config = load_model_config(path)
        args.check_model(self.model_config)
        self.torch_threads = configure_torch_threads(args.torch_threads, path)
        allocator.keep_freed_memory()  # a step's activations reuse memory, no page faults
        dtype = resolve_dtype(
            args.dtype, path, checkpoint=self.model_config.dtype, device=args.device
        )
        self.tokenizer = load_tokenizer(path)
        torch.manual_seed(args.seed)
        self.model = load_served(path, dtype, args.quantization)  # a decoder or a Mamba2 hybrid
        dtype_name = str(dtype).removeprefix("torch.")
        # the arguments with their defaults resolved: the budget, max_model_len, the KV dtype
        self.args, self.plan = plan_engine(args, self.model_config, self.model, dtype_name)
        kv_dtype = self.args.cache.kv_dtype(dtype_name)  # what the plan sized the blocks in
        sched_cfg = args.scheduler
        num_blocks = self.plan.tiers[0].num_blocks
        self.kv = KVCacheManager(
            self.plan.specs,
            num_blocks,
            max_model_len=self.plan.max_model_len,
            enable_caching=args.cache.enable_prefix_caching,
            enable_quarantine="quarantine" in args.protect,
            max_in_flight_tokens=sched_cfg.max_in_flight_tokens,
            hash_fn=args.cache.prefix_caching_hash_algo,
            admission=self.plan.admission,
            admit_whole_prompt=sched_cfg.scheduler_reserve_full_isl,
            enable_kv_events=args.enable_kv_cache_events,
        )
        host = [t for t in self.plan.tiers if t.name == "host"]
        num_host_blocks = host[0].num_blocks if host else 0
        cfg = self.model_config
        layout = KVLayout(
            self.plan.layers_per_group,
            self.plan.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype,
            page_bytes=self.plan.page_bytes if self.plan.state_page_bytes else 0,
        )
        sanitize = args.sanitize if args.sanitize is not None else args.device == "sim"
        modes: dict[object, SanitizerMode | None] = {True: "raise", "raise": "raise"}
        mode = modes.get(sanitize, "collect" if sanitize == "collect" else None)
        # a hybrid verifying drafts keeps the states after drafted tokens in pool rows beyond the
        # KV manager's blocks (runner/draft_states.py)
        draft_pages = DraftStates.num_pages(
            len(self.model.state_groups), args.num_speculative_tokens, sched_cfg.max_num_seqs
        )
        self.device = make_device(
            args.device,  # type: ignore[arg-type]
            layout,
            num_blocks + draft_pages,
            num_host_blocks,
            sanitize=mode,
            poison=args.poison,
            seed=args.seed,
        )
        self.host_tier = (
            HostTier(
                self.kv,
                num_host_blocks,
                store_mode=args.cache.kv_offload_store_mode,
                lazy_scan_blocks=lazy_scan_blocks_for(
                    self.plan.specs, sched_cfg.max_num_batched_tokens
                ),
                bytes_per_block=self.plan.bytes_per_block,
                store_from_settled="settled" in args.protect,
                enable_kv_events=args.enable_kv_cache_events,
                record_published=args.cache.has_lower_tiers,
            )
            if num_host_blocks
            else None
        )
        self.tier_chain = (
            build_chain(args.cache, self.host_tier, self.device, path, kv_dtype)
            if self.host_tier is not None and args.cache.has_lower_tiers
            else None
        )
        self.scheduler = Scheduler.from_config(
            sched_cfg,
            self.kv,
            tier=self.tier_chain or self.host_tier,
            num_speculative_tokens=args.num_speculative_tokens,
            settled="settled" in args.protect,
            policy=args.policy,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        )
        self.model.to(self.device.torch_device)  # weights and rope tables where the KV lives
        self.eos_token_id = self.tokenizer.eos_token_id
        eos_ids = () if self.eos_token_id is None else (self.eos_token_id,)
        # a grammar may end only where the scheduler stops: on the one EOS it knows
        self.grammars = Grammars(
            self.tokenizer, self.model_config.vocab_size, eos_ids, args.structured_outputs
        )
        self.runner = ModelRunner(
            self.model,
            self.device,
            block_size=self.plan.block_size,
            group_block_sizes=[spec.block_size for spec in self.plan.specs],
            num_kv_blocks=num_blocks,
            max_num_seqs=sched_cfg.max_num_seqs,
            max_model_len=self.plan.max_model_len,
            num_speculative_tokens=args.num_speculative_tokens,
            max_async_depth=sched_cfg.depth,
            eos_token_ids=eos_ids,
            seed=args.seed,
            order_copies_after_compute="event" in args.protect,
            logprobs_mode=args.logprobs_mode,
            grammars=self.grammars,
        )
        self.book = RequestBook()  # requests added and not handed back, grammars prepared
        self.num_draft_tokens = 0  # drafts verified, over every step processed
        # (step_seq, total_num_scheduled_tokens) of the last step processed: the server's
        # tokens-per-step histogram reads it after each `step()`
        self.last_step = (0, 0)
        self.num_accepted_tokens = 0
        self.queue: BatchQueue[StepHandle] = BatchQueue(self.scheduler, self._launch)

    # ---- requests ------------------------------------------------------------------------------

    def check_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> list[int]:
        """What `add_request` checks before recording anything, without side effects: returns
        the prompt as a list of ints; TypeError / ValueError naming the field otherwise. (Limits
        of the scheduler, such as max_model_len, and whether a grammar compiles are checked only
        by `add_request`.)"""
        if not isinstance(req_id, str):
            raise TypeError(f"request id must be a string, got {type(req_id).__name__}")
        if self.book.in_use(req_id):
            raise ValueError(f"request id {req_id!r} is already in use")
        try:
            tokens = check_request(
                prompt_token_ids,
                params,
                priority,
                vocab_size=self.model_config.vocab_size,
                max_logprobs=self.args.max_logprobs,
            )
            if params.structured_outputs is not None:
                self.grammars.check_size(params.structured_outputs.grammar_spec())
            return tokens
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"request {req_id!r}: {exc}") from None

    def prepare_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Future[None] | None:
        """Check a request as `check_request` does and start compiling its grammar on a worker,
        so that `add_request` of it never waits for a compile (architecture.md §Grammar).
        Returns None when it may be added at once, else a future done (on a worker thread) once
        it may: the grammar compiled, or refused (then `add_request` raises the ValueError).
        The grammar stays cached until `add_request` or `abort` of `req_id`."""
        self.check_request(req_id, prompt_token_ids, params, priority)
        so = params.structured_outputs
        spec = None if so is None else so.grammar_spec()
        self.book.prepare(req_id, spec)
        if spec is None:
            return None
        self.grammars.hold(spec)  # before the compile: held, it cannot be evicted once cached
        ready = self.grammars.compile_async(spec)  # its size was checked: it does not raise
        return None if ready.done() else ready

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Queue a request; TypeError / ValueError (nothing queued) if it can never run here.
        Its grammar is compiled here unless `prepare_request` compiled it."""
        prepared = self.book.take_prepared(req_id) if isinstance(req_id, str) else None
        try:
            self._add(req_id, prompt_token_ids, params, priority)
        finally:
            if prepared is not None:  # the request holds it now, or was refused
                self.grammars.release(prepared)

    def _add(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> None:
        prompt_token_ids = self.check_request(req_id, prompt_token_ids, params, priority)
        if params.structured_outputs is not None:  # a cache hit once prepared
            try:
                self.grammars.compile(params.structured_outputs.grammar_spec())
            except ValueError as exc:
                raise ValueError(f"request {req_id!r}: {exc}") from None
        use_ngram = self.args.num_speculative_tokens > 0
        stop = params.stop_conditions(self.eos_token_id, use_ngram)
        words = bad_words_token_ids(self.tokenizer, tuple(params.bad_words or ()))
        draw = params.draw_params(words)
        sched_id = self.book.sched_id(req_id, self._id_held)
        request = Request(sched_id, prompt_token_ids, stop, draw=draw, priority=int(priority))
        self.scheduler.add_request(request)  # raises before anything is recorded
        detok = IncrementalDetokenizer(
            self.tokenizer,
            params.stop_strings,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
            prompt_token_ids,
            params.min_tokens,
        )
        state = RequestState(req_id, request, params, detok)
        if draw.grammar is not None:
            self.grammars.hold(draw.grammar)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        self.book.add(state)

    def _release_grammar(self, state: RequestState) -> None:
        grammar = state.request.draw.grammar
        if grammar is not None:
            self.grammars.release(grammar)

    def _id_held(self, sched_id: ReqId) -> bool:
        """Whether the layers below still go by `sched_id`: a new request then takes a fresh id,
        so the caller may reuse an id as soon as `abort` hands the request back
        (architecture.md §Progress)."""
        if sched_id in self.scheduler.requests:  # unfinished, or finished with steps in flight
            return True
        # a cancelled load in flight still claims its prefix under the old request's id
        return self.host_tier is not None and self.host_tier.is_loading(sched_id)

    def abort(self, req_id: str) -> FinishedRequest | None:
        """Stop a request now and forget it; returns it as it ended (None: unknown, or already
        handed out as finished). Its blocks return once no step in flight can touch them."""
        prepared = self.book.take_prepared(req_id)
        if prepared is not None:  # prepared, never added: only its grammar's hold to drop
            self.grammars.release(prepared)
        state = self.book.pop_caller(req_id)
        if state is None:
            return None
        self._release_grammar(state)
        self.scheduler.abort(state.request.request_id)
        state.finish_reason = "abort"
        return state.finished()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.queue)

    def num_unfinished_requests(self) -> int:
        """Requests waiting, loading or running: `stats().num_unfinished_requests` without the
        snapshot of every pool (the server asks on every admission)."""
        return self.scheduler.num_unfinished_requests

    # ---- the two loops ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One engine step: the synchronous loop at depth 1, the batch queue otherwise."""
        if not self._ready_past_tiers():
            return []  # every request waits for a disk or remote read: no empty forward
        if self.scheduler.async_depth == 1:
            return self.step_sync()
        return self.step_async()

    def _ready_past_tiers(self) -> bool:
        """False when every unfinished request waits for a disk or remote read that has neither
        landed nor missed its deadline after `TIER_POLL_S` more: a step would be an empty forward
        (modelled time on the sim, a wasted forward elsewhere), and returning keeps the caller
        (the server's loop) free to take new requests."""
        chain = self.tier_chain
        if chain is None or self.scheduler.running or len(self.queue):
            return True
        blocked = chain.waiting_on_io()
        if not blocked or any(r.request_id not in blocked for r in self.scheduler.waiting):
            return True
        return chain.wait_for_io(TIER_POLL_S)

    def step_sync(self) -> list[StepOutput]:
        """schedule → execute → wait → update."""
        output = self.scheduler.schedule()
        handle = self._launch(output)
        self.queue.num_steps += 1
        return self._process(output, handle)

    def step_async(self) -> list[StepOutput]:
        """Fill the batch queue first (schedule while the device runs); then process the oldest."""
        item = self.queue.advance()
        return [] if item is None else self._process(*item)

    def _launch(self, output: SchedulerOutput) -> StepHandle:
        """Execute a scheduled step; stamps the requests it schedules for the first time."""
        now = time.monotonic()
        for new in output.scheduled_new_reqs:
            state = self.book.get(new.req_id)
            if state is not None and state.scheduled_time is None:
                state.scheduled_time = now
        return self.runner.execute(output)

    def _process(self, output: SchedulerOutput, handle: StepHandle) -> list[StepOutput]:
        result = self.runner.wait(handle)
        self.last_step = (output.step_seq, output.total_num_scheduled_tokens)
        self.num_draft_tokens += result.num_draft_tokens
        self.num_accepted_tokens += result.num_accepted_tokens
        for req_id, chunk in result.prompt_logprobs.items():
            state = self.book.get(req_id)
            if state is not None and state.finish_reason is None:
                state.add_prompt_logprobs(chunk)
        outs: list[StepOutput] = []
        for out in self.scheduler.update(output, result):
            state = self.book.get(out.req_id)
            if state is None or (state.finish_reason is not None and not out.finished):
                continue
            by_token = out.finished is RequestStatus.FINISHED_STOPPED
            num_logprobs = len(state.logprobs)
            logprobs = result.logprobs.get(out.req_id, [])
            kept, new_text = self._append(state, out.new_token_ids, logprobs, by_token)
            finished = out.finished is not None or state.finish_reason is not None
            if out.finished is not None and state.finish_reason is None:
                state.finish_reason = FINISH_REASONS[out.finished]
                if by_token:
                    state.stop_reason = self._stop_token_reason(state)
            if finished:
                new_text += state.detok.flush()
            step_out = StepOutput(state.req_id, kept, new_text, finished)
            if state.params.logprobs is not None:
                step_out.new_logprobs = state.logprobs[num_logprobs:]
            if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                state.prompt_logprobs_sent = True  # complete: the prefill ended with this token
                step_out.prompt_logprobs = list(state.prompt_logprobs)
            if finished:
                self.book.remove(state)
                self._release_grammar(state)
                step_out.result = state.finished()
            outs.append(step_out)
        if self.args.check_integrity:
            self.check_integrity()
        return outs

    def _append(
        self,
        state: RequestState,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
        ends_with_stop_token: bool,
    ) -> tuple[list[int], str]:
        """Record the step's tokens up to a stop string; returns (the tokens kept, new text).

        A stop token's text is left out unless include_stop_str_in_output (as vLLM)."""
        text = ""
        num_kept = 0
        for i, tok in enumerate(token_ids):
            if state.finish_reason is not None:
                break
            state.token_ids.append(tok)
            num_kept += 1
            if i < len(logprobs):
                state.logprobs.append(logprobs[i])
            stop_token = ends_with_stop_token and i == len(token_ids) - 1
            if not stop_token or state.params.include_stop_str_in_output:
                text += state.detok.push(tok)
            if state.detok.stop_reason is not None:  # a stop string: finish here, free blocks
                state.finish_reason, state.stop_reason = "stop", state.detok.stop_reason
                self.scheduler.abort(state.request.request_id)
        return token_ids[:num_kept], text

    def _stop_token_reason(self, state: RequestState) -> int | None:
        """vLLM's stop_reason for a stop token: None for the model's EOS (unless ignore_eos made
        it count only as a listed stop token), else the token."""
        last = state.token_ids[-1]
        return None if last == self.eos_token_id and not state.params.ignore_eos else last

    def check_integrity(self) -> None:
        """Check the KV pools' invariants (every device reference has a holder); raises
        `IntegrityError` (`kv/block_pool.py`) naming the first broken one."""
        pins = self.host_tier.device_pins() if self.host_tier is not None else None
        self.kv.check_integrity(num_pinned=pins)
        if self.host_tier is not None:
            self.host_tier.check_integrity()

    def drain(self) -> dict[str, FinishedRequest]:
        """Step until no request is unfinished and no step or copy is in flight; returns the
        requests that finished meanwhile, by id."""
        done: dict[str, FinishedRequest] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.result is not None:
                    done[out.req_id] = out.result
        return done

    # ---- inspection and fault injection ----------------------------------------------------------

    def stats(self) -> EngineStats:
        """A frozen snapshot of requests, steps, copies in flight and every KV pool (blocks free,
        used, cached, quarantined by release step, pinned by loads and stores) and the counters.
        `stats().is_idle` holds once a drained engine left nothing behind. Changes nothing."""
        return collect_stats(
            self.scheduler,
            self.kv,
            self.host_tier,
            num_requests=len(self.book),
            num_pending_copies=self.runner.transfers.num_pending,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            hazards=self._hazard_counts(),
            device_time_ns=getattr(self.device, "now_ns", None),
            tiers=() if self.tier_chain is None else tuple(self.tier_chain.tier_stats()),
            kernel_pool=native.pool_stats(),
        )

    def _hazard_counts(self) -> dict[str, int]:
        sanitizer = self.device.sanitizer
        return {} if sanitizer is None else {str(k): n for k, n in sanitizer.counts.items()}

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued to the disk and remote tiers are written (tests, before a
        restart); False if `timeout` seconds passed first. True at once without those tiers."""
        return self.tier_chain is None or self.tier_chain.flush(timeout)

    def close(self) -> None:
        """Release what outlives a step: the disk and remote tiers (queued writes finish, the
        disk folder is unlocked) and the device's stream threads. Idempotent; the engine is
        unusable afterwards."""
        if self.tier_chain is not None:
            self.tier_chain.close()
        self.device.close()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV cache events since the last call, the device pool's first, then the host
        tier's and the lower tiers' (mutates; empty without `enable_kv_cache_events`). A
        block's tier copies come after its device event, so a consumer knows its parent."""
        events = self.kv.take_events()
        if self.tier_chain is not None:
            events += self.tier_chain.take_events()
        elif self.host_tier is not None:
            events += self.host_tier.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget the device prefix cache (the host tier keeps its entries); False, changing
        nothing, while any device block is in use."""
        return self.kv.reset_prefix_cache()

    def set_transfer_faults(self, faults: TransferFaults) -> None:
        """Inject failing, corrupting or slow host ↔ device copies from now on (see
        `TransferFaults`; `TransferFaults()` stops). For tests and chaos runs."""
        self.runner.transfers.set_faults(faults)
