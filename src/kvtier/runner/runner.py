"""ModelRunner: one step = a forward op and a sampled-token copy on the compute stream. The op
plans each request's share, runs the model and hands the last positions to its `StepSampler`
(`sampling.py`: masks, penalties, the draw, draft acceptance, grammars advanced).

The host prepares nothing the device computes: input ids, positions and slot mappings are built
inside the forward op from the device-side state (`state.py`), so step k+1 reads step k's sampled
tokens on the device, with no host round trip, even with speculative drafts rolled back. Every
tensor an op uses lives on `device.torch_device`; the op never waits for the device to read a
value back (n-gram drafts and grammars excepted: drafts are proposed, and a grammar request's matcher
advanced, on the sampled tokens in Python; architecture.md §Grammar). The host
reads results only after the step's event, through declared host ops, and hands them back in the
`RunnerOutput` (tokens, logprobs, draft counts, finished copies). Every op declares the blocks and
buffers it touches, for the sanitizer; what a request needs (its draw parameters) arrives in the
step's `NewRequestData`, so the runner keeps no host-side request registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.config import MAX_ASYNC_DEPTH
from kvtier.device import COMPUTE, AccessSet, Device, OpMeta, Work
from kvtier.ids import EventId
from kvtier.model.attention import AttentionMetadata
from kvtier.model.grammar import Grammars
from kvtier.model.mamba2 import StateMetadata
from kvtier.model.sampler import gather_logprobs
from kvtier.model.served import ServedModel
from kvtier.runner.draft_states import DraftStates
from kvtier.runner.logprobs import LogprobRows
from kvtier.runner.sampling import Planned, StepSampler
from kvtier.runner.state import DeviceState, host_index, on_device
from kvtier.runner.transfers import TransferEngine
from kvtier.sched.ngram import NgramProposer
from kvtier.sched.output import PromptLogprobs, RunnerOutput, SchedulerOutput

TOKEN_STATE = "token_state"  # the device-side request state (tokens, positions)
SAMPLED = "sampled_tokens"  # [max_num_seqs, 1 + k] device buffer the forward writes
GENERATOR = "sampler_generator"  # the sampler's random state, advanced by every forward
RESULTS = "step_results_{}"  # per ring slot: what a forward leaves for the host besides tokens
GRAMMAR = "grammar_matchers"  # the matchers of structured-output requests, advanced by forwards


@dataclass(slots=True)
class _StepResults:
    """Written inside a forward op (buffer `step_results_{slot}`), read by the host op of
    `wait` once the step's event completed."""

    sampled: LogprobRows | None = None  # logprobs of sampled tokens, for requests that asked
    prompt: LogprobRows | None = None  # logprobs of prompt tokens, for requests that asked
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted


@dataclass(slots=True)
class StepHandle:
    """A launched step: wait on it with `ModelRunner.wait`."""

    output: SchedulerOutput
    slot: int  # ring slot of its host buffer and completion event
    event: EventId

    @property
    def rows(self) -> list[str]:
        """The request of each row of the sampled buffer: the step's requests, in order."""
        return list(self.output.num_scheduled_tokens)


STATE_PAGES_KEPT = 1 << 16  # steps whose declared state pages `ModelRunner.state_pages` keeps


class ModelRunner:
    """Executes steps of a model (`ServedModel`: a plain decoder or a Mamba2 hybrid) through a
    `Device` (KV and states in the device tier's layer slots).

    `group_block_sizes`: tokens per block of each KV group (default `block_size` for all; a
    state group without prefix caching has one page per request, architecture.md §Snapshots).
    `num_kv_blocks`: the device pool's blocks the KV manager owns (default all); a hybrid with
    drafts keeps its draft pages in the rows after them (`DraftStates.num_pages`).
    """

    def __init__(
        self,
        model: ServedModel,
        device: Device,
        *,
        block_size: int,
        group_block_sizes: Sequence[int] | None = None,
        num_kv_blocks: int | None = None,
        max_num_seqs: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        max_async_depth: int = MAX_ASYNC_DEPTH,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        order_copies_after_compute: bool = True,
        logprobs_mode: str = "raw_logprobs",
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.pool = device.kv("device")  # flat page slots
        self.caches = model.bind(self.pool, block_size)  # each layer's view of its slot
        self.num_groups = len(model.kv_groups)
        self.group_block_sizes = list(group_block_sizes or [block_size] * self.num_groups)
        if len(self.group_block_sizes) != self.num_groups:
            raise ValueError(
                f"group_block_sizes has {len(self.group_block_sizes)} sizes for "
                f"{self.num_groups} KV groups; give one per group"
            )
        self.state_groups = model.state_groups
        first = device.num_blocks("device") if num_kv_blocks is None else num_kv_blocks
        self.drafts = DraftStates(
            first, num_speculative_tokens, self.state_groups, self.group_block_sizes, max_num_seqs
        )
        if self.drafts.enabled:
            need = first + DraftStates.num_pages(
                len(self.state_groups), num_speculative_tokens, max_num_seqs
            )
            if device.num_blocks("device") < need:
                raise ValueError(
                    f"the device pool has {device.num_blocks('device')} blocks; a hybrid with "
                    f"{num_speculative_tokens} speculative tokens needs {need} (the KV "
                    "manager's and the draft pages, DraftStates.num_pages)"
                )
        self.torch_device = device.torch_device
        # device side, touched only inside ops; one spare row: see DeviceState.apply_diffs
        self.state = DeviceState(
            max_num_seqs + 1, max_model_len, self.torch_device, num_speculative_tokens > 0
        )
        self._tables: dict[str, list[list[int]]] = {}  # host mirror, for the sanitizer only
        # per recent step: the state pages its forward declares (hazard attribution, §State)
        self._state_pages: dict[int, frozenset[int]] = {}
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposer = NgramProposer(max(1, num_speculative_tokens))
        width = 1 + num_speculative_tokens
        device.alloc_buffer(TOKEN_STATE, (1,), "int64")  # names what `state` holds
        device.alloc_buffer(GENERATOR, (1,), "int64")  # names `sampler.generator`
        device.alloc_buffer(GRAMMAR, (1,), "int64")  # names the requests' `grammar` matchers
        self.sampled = device.alloc_buffer(SAMPLED, (max_num_seqs, width), "int64")
        self.sampler = StepSampler(
            model,
            self.state,
            self.sampled,
            self.torch_device,
            seed=seed,
            logprobs_mode=logprobs_mode,
            grammars=grammars,
        )
        self.ring = max_async_depth + 1
        self.host_out = [
            device.alloc_buffer(f"sampled_host_{i}", (max_num_seqs, width), "int64", tier="host")
            for i in range(self.ring)
        ]
        self.events = [device.new_event() for _ in range(self.ring)]
        self.transfers = TransferEngine(device, order_after_compute=order_copies_after_compute)
        for i in range(self.ring):
            device.alloc_buffer(RESULTS.format(i), (1,), "int64")  # names `_results[i]`
        self._results = [_StepResults() for _ in range(self.ring)]

    # ---- host side -----------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> StepHandle:
        """Launch step `output` and return at once; `wait` gives its `RunnerOutput`."""
        slot = output.step_seq % self.ring
        reads, writes = self._host_bookkeeping(output)
        meta = OpMeta("forward", output.step_seq, tuple(output.num_scheduled_tokens))
        access = AccessSet.of(
            reads={"device": sorted(reads - writes)},
            writes={
                "device": sorted(writes),
                TOKEN_STATE: None,
                GENERATOR: None,
                GRAMMAR: None,
                SAMPLED: None,
                RESULTS.format(slot): None,
            },
        )
        work = Work.forward(max(1, output.total_num_scheduled_tokens), self.model.config.num_layers)
        self.transfers.launch_loads(output.planned_transfers, output.step_seq)
        self.device.launch(COMPUTE, lambda: self._forward(output, slot), access, meta, work)
        self.transfers.forward_launched()
        self.transfers.launch_stores(output.planned_transfers, output.step_seq)
        host = self.host_out[slot]
        copy = AccessSet.of(reads={SAMPLED: None}, writes={f"sampled_host_{slot}": None})
        self.device.launch(
            COMPUTE,
            lambda: host.copy_(self.sampled, non_blocking=True),
            copy,
            OpMeta("sampled-copy", output.step_seq),
            Work.copy(host.numel() * 8),
        )
        self.device.record(COMPUTE, self.events[slot])
        return StepHandle(output, slot, self.events[slot])

    def wait(self, handle: StepHandle) -> RunnerOutput:
        """Block until the step's results are on the host; return them as a `RunnerOutput`
        (sampled tokens, logprobs of requests that asked, draft counts, finished copies)."""
        self.device.synchronize_event(handle.event)
        slot = handle.slot
        host = self.host_out[slot]
        out = RunnerOutput(handle.output.step_seq, {})

        def read() -> None:
            req_ids = handle.rows
            for req_id, row in zip(req_ids, host[: len(req_ids)].tolist(), strict=True):
                tokens = [t for t in row if t >= 0]
                if tokens:
                    out.sampled_token_ids[req_id] = tokens
            results, self._results[slot] = self._results[slot], _StepResults()
            got = results.sampled.read() if results.sampled is not None else {}
            out.logprobs = {req_id: lps for req_id, (_, lps) in got.items()}
            got = results.prompt.read() if results.prompt is not None else {}
            out.prompt_logprobs = {
                req_id: PromptLogprobs(pos, lps) for req_id, (pos, lps) in got.items()
            }
            out.num_draft_tokens = results.num_draft_tokens
            out.num_accepted_tokens = results.num_accepted_tokens

        access = AccessSet.of(
            reads={f"sampled_host_{slot}": None}, writes={RESULTS.format(slot): None}
        )
        self.device.host_op(read, access, OpMeta("read-sampled", handle.output.step_seq))
        out.finished_transfers, out.failed_transfers = self.transfers.poll()
        return out

    def _host_bookkeeping(self, output: SchedulerOutput) -> tuple[set[int], set[int]]:
        """Poison fresh blocks; return the (reads, writes) block ids the forward declares, which
        only the sanitizer reads: empty sets when the device checks no access sets."""
        sizes = self.group_block_sizes
        fresh: list[int] = []
        for new in output.scheduled_new_reqs:
            fresh += _new_ids(new.block_ids, new.num_computed_tokens, sizes)
        for cached in output.scheduled_cached_reqs:
            fresh += [b for ids in cached.new_block_ids for b in ids if b]
        if fresh:
            self.device.poison_blocks("device", fresh, meta=OpMeta("poison", output.step_seq))
        if not self.device.checks_access:
            return set(), set()
        return self._declared_blocks(output)

    def _declared_blocks(self, output: SchedulerOutput) -> tuple[set[int], set[int]]:
        """Update the host mirror of tables; return the (reads, writes) ids of the forward."""
        tables = self._tables
        sizes = self.group_block_sizes
        for req_id in (*output.preempted_req_ids, *output.finished_req_ids):
            tables.pop(req_id, None)
        lowest: dict[str, int] = {}  # the lowest start the device may have (rejected drafts)
        starts: dict[str, int] = {}  # the scheduler's (optimistic) start of each request's step
        for new in output.scheduled_new_reqs:
            tables[new.req_id] = [list(ids) for ids in new.block_ids]
            lowest[new.req_id] = starts[new.req_id] = new.num_computed_tokens
        for cached in output.scheduled_cached_reqs:
            for table, ids in zip(tables[cached.req_id], cached.new_block_ids, strict=True):
                table.extend(ids)
            # drafts of earlier steps may still be rejected: it may start as low as this
            lowest[cached.req_id] = cached.lowest_start
            starts[cached.req_id] = cached.num_computed_tokens
        reads: set[int] = set()
        writes: set[int] = set()
        state: set[int] = set()
        kinds = self.model.group_kinds
        for req_id, n in output.num_scheduled_tokens.items():
            lo, start = lowest[req_id], starts[req_id]
            hi = start + n  # the scheduler's end; the device's is never later
            for kind, table, bs in zip(kinds, tables[req_id], sizes, strict=True):
                if kind is None:  # a state group: the page of the start count, then of the end
                    if start:
                        first, last = (max(lo, 1) - 1) // bs, (start - 1) // bs
                        read = [b for b in table[first : last + 1] if b]
                        reads.update(read)
                        state.update(read)
                    pages = [b for b in table[lo // bs : (hi - 1) // bs + 1] if b]
                    writes.update(pages)
                    state.update(pages)
                    continue
                # What attention gathers: from the window (or chunk) start of the first query.
                reads.update(b for b in table[kind.kv_start(lo) // bs : -(-hi // bs)] if b)
                writes.update(b for b in table[lo // bs : -(-hi // bs)] if b)
        if self.drafts.enabled:  # the states after drafted tokens (architecture.md §Rollback)
            drafting = [
                r for r in output.num_scheduled_tokens if output.scheduled_spec_decode_tokens.get(r)
            ]
            state.update(self.drafts.all_pages(len(drafting)))
            writes.update(self.drafts.all_pages(len(drafting)))
        if state:
            self._state_pages[output.step_seq] = frozenset(state)
            if len(self._state_pages) > STATE_PAGES_KEPT:
                del self._state_pages[next(iter(self._state_pages))]
        return reads, writes

    def state_pages(self, step_seq: int) -> frozenset[int]:
        """The state (Mamba) pages the forward of step `step_seq` declared, for one of the last
        `STATE_PAGES_KEPT` steps (empty otherwise, and without a sanitizer): which hazards
        touch state pages."""
        return self._state_pages.get(step_seq, frozenset())

    # ---- device side (runs inside the forward op) ---------------------------------------------

    @torch.inference_mode()
    def _forward(self, output: SchedulerOutput, slot: int) -> None:
        state = self.state
        state.apply_diffs(output, self.eos_token_ids)
        self.sampler.start_matchers(output)
        results = self._results[slot] = _StepResults()
        spec = output.scheduled_spec_decode_tokens
        plan: list[Planned] = []
        row_idx: list[int] = []  # token buffer (row, position) of every input token
        pos_idx: list[int] = []
        draft_rows: list[int] = []  # drafts are written to the buffer, then read like the rest
        draft_pos: list[int] = []
        draft_ids: list[int] = []
        for req_id, n in output.num_scheduled_tokens.items():
            st = state[req_id]
            drafts = list(spec.get(req_id, ()))
            if drafts and drafts[0] == -1:  # async: propose on the device's tokens
                assert st.token_ids is not None, "drafts need track_tokens"
                proposed = self.proposer.propose(st.token_ids, len(drafts))
                drafts = proposed + [st.token_ids[-1]] * (len(drafts) - len(proposed))
            start, num_real = st.position, n - len(drafts)
            row_idx += [st.row] * n
            pos_idx += range(start, start + n)
            if drafts:
                draft_rows += [st.row] * len(drafts)
                draft_pos += range(start + num_real, start + n)
                draft_ids += drafts
            samples = start + num_real >= st.num_tokens
            plan.append(Planned(req_id, st, start, num_real, drafts, samples))
        self.sampled.fill_(-1)
        if not plan:
            return
        if draft_ids:
            state.scatter(draft_rows, draft_pos, self._index(draft_ids)[0])
        starts = [p.start for p in plan]
        counts = [p.num_real + len(p.drafts) for p in plan]
        tables = [[p.state.tables[g] for p in plan] for g in range(self.num_groups)]
        attention_tables = [None if g in self.state_groups else t for g, t in enumerate(tables)]
        meta = AttentionMetadata.build(starts, counts, attention_tables, self.block_size)
        state_meta = None
        drafting = [i for i, p in enumerate(plan) if p.drafts] if self.drafts.enabled else []
        if self.state_groups:  # each sequence's state page by the device's own start
            sizes = {g: self.group_block_sizes[g] for g in self.state_groups}
            state_tables = {g: tables[g] for g in self.state_groups}
            token_slots: dict[int, dict[int, list[int]]] = {g: {} for g in self.state_groups}
            for q, i in enumerate(drafting):  # drafts: the state after each token
                p = plan[i]
                got = self.drafts.token_slots(q, p.start, p.num_real, len(p.drafts), p.state.tables)
                for g, slots in got.items():
                    token_slots[g][i] = slots
            state_meta = StateMetadata.build(starts, counts, state_tables, sizes, token_slots)
        ids = state.gather(row_idx, pos_idx)  # [num_tokens]
        positions = on_device(meta.query_positions(), self.torch_device)
        masks = self.sampler.start_masks(plan)  # filled while the forward runs
        hidden = self.model.forward(ids, positions, self.caches, meta, state_meta)
        prompt_rows = self._prompt_logprob_rows(plan, meta, hidden)
        drawn = self.sampler.sample(plan, meta, hidden, masks.result())
        results.num_draft_tokens = drawn.num_draft_tokens
        results.num_accepted_tokens = drawn.num_accepted_tokens
        if drafting:
            self._land_draft_states(plan, drafting)
        # queued copies to host memory; the host reads them once the step's event completed
        results.sampled = None if drawn.logprobs is None else drawn.logprobs.to_host()
        results.prompt = None if prompt_rows is None else prompt_rows.to_host()

    def _land_draft_states(self, plan: list[Planned], drafting: list[int]) -> None:
        """After the drafts are accepted: each state page of the device's new count holds the
        state after exactly that many tokens (architecture.md §Rollback)."""
        landings = []
        for q, i in enumerate(drafting):
            p = plan[i]
            last = p.state.position - p.start - 1  # token index of the last accepted token
            if last < p.num_real + len(p.drafts) - 1:  # some rejected
                landings.append((q, p.start, max(p.num_real - 1, 0), last, p.state.tables))
        self.drafts.land(self.pool, landings, self.torch_device)

    def _index(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """Host-built int64 index tensors on the device (no wait: the host knows them)."""
        return tuple(host_index(v, self.torch_device) for v in lists)

    def _prompt_logprob_rows(
        self, plan: list[Planned], meta: AttentionMetadata, hidden: torch.Tensor
    ) -> LogprobRows | None:
        """Raw logprobs of the prompt tokens this step's chunks predict (the query at position
        q predicts the token at q + 1), for requests that asked; None if none did."""
        index: list[int] = []  # hidden-state rows
        targets: list[int] = []  # the prompt token each row predicts
        spans: list[tuple[str, int, int, int, int]] = []
        for p, end in zip(plan, meta.query_start_loc[1:], strict=True):
            k = p.state.num_prompt_logprobs
            last = min(p.start + p.num_real, p.state.num_prompt_tokens - 1)
            if k is None or last <= p.start:
                continue
            first_row = end - p.num_real - len(p.drafts)
            spans.append((p.req_id, len(index), last - p.start, k, p.start + 1))
            index += range(first_row, first_row + last - p.start)
            targets += p.state.known_ids[p.start + 1 : last + 1]
        if not index:
            return None
        rows_t, wanted = self._index(index, targets)
        logits = self.model.compute_logits(hidden, rows_t)  # [rows, vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return LogprobRows(*gather_logprobs(logprobs, wanted, max(s[3] for s in spans)), spans)


def _new_ids(
    block_ids: tuple[list[int], ...], num_computed: int, sizes: Sequence[int]
) -> list[int]:
    """Blocks a new request's step will write (prefix hits before num_computed are shared)."""
    return [
        b for ids, bs in zip(block_ids, sizes, strict=True) for b in ids[num_computed // bs :] if b
    ]
