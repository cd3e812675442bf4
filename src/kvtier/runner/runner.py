"""ModelRunner: one step = a forward op and a sampled-token copy on the compute stream.

The host prepares nothing the device computes: input ids, positions and slot mappings are built
inside the forward op from the device-side state (`state.py`), so step k+1 reads step k's sampled
tokens on the device, with no host round trip, even with speculative drafts rolled back.
Every op declares the blocks and buffers it touches, for the sanitizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.device import COMPUTE, AccessSet, Device, EventId, OpMeta, Work
from kvtier.model.attention import AttentionMetadata
from kvtier.model.sampler import SamplingBatch, gather_logprobs, sample
from kvtier.model.sampler import SamplingParams as ModelSamplingParams
from kvtier.model.transformer import CausalLM
from kvtier.runner.logprobs import LogprobRows, PromptLogprobs, TokenLogprobs
from kvtier.runner.state import DeviceRequest, apply_diffs
from kvtier.runner.transfers import TransferEngine
from kvtier.sched.ngram import NgramProposer
from kvtier.sched.output import RunnerOutput, SchedulerOutput

TOKEN_STATE = "token_state"  # the device-side request state (tokens, positions)
SAMPLED = "sampled_tokens"  # [max_num_seqs, 1 + k] device buffer the forward writes
LOGPROBS = "logprobs_{}"  # per ring slot: the logprob tensors a forward leaves for the host


@dataclass(slots=True)
class StepHandle:
    """A launched step: wait on it with `ModelRunner.wait`."""

    output: SchedulerOutput
    slot: int  # ring slot of its host buffer and completion event
    event: EventId
    rows: list[str] = field(default_factory=list)  # request of each sampled row, in order


class ModelRunner:
    """Executes steps of a `CausalLM` through a `Device` (KV in the device tier's layer slots)."""

    def __init__(
        self,
        model: CausalLM,
        device: Device,
        *,
        block_size: int,
        max_num_seqs: int,
        num_speculative_tokens: int = 0,
        max_async_depth: int = 3,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        order_copies_after_compute: bool = True,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        pool = device.kv("device")
        self.kv_caches = [pool[s] for s in model.layer_slots()]
        self.num_groups = len(model.kv_groups)
        self.state: dict[str, DeviceRequest] = {}  # device side: touched only inside ops
        self.params: dict[str, ModelSamplingParams] = {}  # host side: set before scheduling
        self.num_prompt_logprobs: dict[str, int] = {}  # host side: requests that ask for them
        self._tables: dict[str, list[list[int]]] = {}  # host mirror, for access sets only
        self.eos_token_ids = tuple(eos_token_ids)
        self.logprobs_mode = logprobs_mode  # as vLLM's: see model.sampler.LOGPROBS_MODES
        self.proposer = NgramProposer(max(1, num_speculative_tokens))
        self.generator = torch.Generator().manual_seed(seed)
        width = 1 + num_speculative_tokens
        device.alloc_buffer(TOKEN_STATE, (1,), "int64")
        self.sampled = device.alloc_buffer(SAMPLED, (max_num_seqs, width), "int64")
        self.ring = max_async_depth + 1
        self.host_out = [
            device.alloc_buffer(f"sampled_host_{i}", (max_num_seqs, width), "int64", tier="host")
            for i in range(self.ring)
        ]
        self.events = [device.new_event() for _ in range(self.ring)]
        self.transfers = TransferEngine(device, order_after_compute=order_copies_after_compute)
        for i in range(self.ring):
            device.alloc_buffer(LOGPROBS.format(i), (1,), "int64")  # names what _rows holds
        # Per slot, written inside the forward op: (sampled rows, prompt rows).
        self._rows: list[tuple[LogprobRows | None, LogprobRows | None]] = [
            (None, None) for _ in range(self.ring)
        ]
        self._logprobs: list[dict[str, list[TokenLogprobs]]] = [{} for _ in range(self.ring)]
        self._prompt_logprobs: list[dict[str, PromptLogprobs]] = [{} for _ in range(self.ring)]
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- host side -----------------------------------------------------------------------------

    def add_request(
        self, req_id: str, params: ModelSamplingParams, prompt_logprobs: int | None = None
    ) -> None:
        """Register a request's sampling parameters (and how many top candidates its prompt
        logprobs want, None: none) before it is first scheduled."""
        self.params[req_id] = params
        if prompt_logprobs is not None:
            self.num_prompt_logprobs[req_id] = prompt_logprobs

    def remove_request(self, req_id: str) -> None:
        """Forget host-side data of a finished or aborted request (safe at any time: steps
        already launched carry what they need; device state drops with its diff)."""
        self.params.pop(req_id, None)
        self.num_prompt_logprobs.pop(req_id, None)

    def execute(self, output: SchedulerOutput) -> StepHandle:
        """Launch step `output` and return at once; `wait` gives its `RunnerOutput`."""
        slot = output.step_seq % self.ring
        reads, writes = self._host_bookkeeping(output)
        meta = OpMeta("forward", output.step_seq, tuple(output.num_scheduled_tokens))
        rows: list[str] = []
        access = AccessSet.of(
            reads={"device": sorted(reads - writes)},
            writes={
                "device": sorted(writes),
                TOKEN_STATE: None,
                SAMPLED: None,
                LOGPROBS.format(slot): None,
            },
        )
        work = Work.forward(max(1, output.total_num_scheduled_tokens), self.model.config.num_layers)
        # Read on the host now: the op may run later (sim), after the request is forgotten here.
        params = {new.req_id: self.params[new.req_id] for new in output.scheduled_new_reqs}
        prompt_k = {
            new.req_id: self.num_prompt_logprobs[new.req_id]
            for new in output.scheduled_new_reqs
            if new.req_id in self.num_prompt_logprobs
        }
        self.transfers.launch_loads(output.planned_transfers, output.step_seq)
        self.device.launch(
            COMPUTE,
            lambda: self._forward(output, params, prompt_k, slot, rows),
            access,
            meta,
            work,
        )
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
        return StepHandle(output, slot, self.events[slot], rows)

    def wait(self, handle: StepHandle) -> RunnerOutput:
        """Block until the step's tokens are on the host; return them as a `RunnerOutput`."""
        self.device.synchronize_event(handle.event)
        host = self.host_out[handle.slot]
        sampled: dict[str, list[int]] = {}

        def read() -> None:
            for i, req_id in enumerate(handle.rows):
                sampled[req_id] = [t for t in host[i].tolist() if t >= 0]
            sampled_rows, prompt_rows = self._rows[handle.slot]
            self._rows[handle.slot] = (None, None)
            got = sampled_rows.read() if sampled_rows is not None else {}
            self._logprobs[handle.slot] = {req_id: lps for req_id, (_, lps) in got.items()}
            got = prompt_rows.read() if prompt_rows is not None else {}
            self._prompt_logprobs[handle.slot] = {
                req_id: PromptLogprobs(pos, lps) for req_id, (pos, lps) in got.items()
            }

        access = AccessSet.of(
            reads={f"sampled_host_{handle.slot}": None, LOGPROBS.format(handle.slot): None}
        )
        self.device.host_op(read, access, OpMeta("read-sampled", handle.output.step_seq))
        finished, failed = self.transfers.poll()
        return RunnerOutput(handle.output.step_seq, sampled, finished, failed)

    def logprobs(self, handle: StepHandle) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the step's sampled tokens for requests that asked (after `wait`)."""
        return self._logprobs[handle.slot]

    def prompt_logprobs(self, handle: StepHandle) -> dict[str, PromptLogprobs]:
        """Logprobs of the prompt tokens the step's chunks computed, for requests that asked
        (after `wait`)."""
        return self._prompt_logprobs[handle.slot]

    def _host_bookkeeping(self, output: SchedulerOutput) -> tuple[set[int], set[int]]:
        """Update the host mirror of tables, poison fresh blocks; return (reads, writes) ids."""
        tables = self._tables
        for req_id in (*output.preempted_req_ids, *output.finished_req_ids):
            tables.pop(req_id, None)
        fresh: list[int] = []
        starts: dict[str, int] = {}
        ends: dict[str, int] = {}  # the scheduler's start of each request's step
        for new in output.scheduled_new_reqs:
            tables[new.req_id] = [list(ids) for ids in new.block_ids]
            starts[new.req_id] = ends[new.req_id] = new.num_computed_tokens
            fresh += _new_ids(new.block_ids, new.num_computed_tokens, self.block_size)
        for cached in output.scheduled_cached_reqs:
            for table, ids in zip(tables[cached.req_id], cached.new_block_ids, strict=True):
                table.extend(ids)
                fresh += [b for b in ids if b]
            # drafts of earlier steps may still be rejected: it may start as low as this
            starts[cached.req_id] = cached.lowest_start
            ends[cached.req_id] = cached.num_computed_tokens
        if fresh:
            self.device.poison_blocks("device", fresh, meta=OpMeta("poison", output.step_seq))
        reads: set[int] = set()
        writes: set[int] = set()
        bs = self.block_size
        kinds = self.model.group_kinds
        for req_id, n in output.num_scheduled_tokens.items():
            lo = starts[req_id]
            hi = ends[req_id] + n  # the scheduler's end; the device's is never later
            for kind, table in zip(kinds, tables[req_id], strict=True):
                # What attention gathers: from the window (or chunk) start of the first query.
                reads.update(b for b in table[kind.kv_start(lo) // bs : -(-hi // bs)] if b)
                writes.update(b for b in table[lo // bs : -(-hi // bs)] if b)
        return reads, writes

    # ---- device side (runs inside the forward op) ---------------------------------------------

    @torch.inference_mode()
    def _forward(
        self,
        output: SchedulerOutput,
        params: dict[str, ModelSamplingParams],
        prompt_k: dict[str, int],
        slot: int,
        rows: list[str],
    ) -> None:
        apply_diffs(self.state, output, params, self.eos_token_ids, prompt_k)
        self._rows[slot] = (None, None)
        spec = output.scheduled_spec_decode_tokens
        plan: list[_Planned] = []
        input_ids: list[int] = []
        for req_id, n in output.num_scheduled_tokens.items():
            st = self.state[req_id]
            drafts = list(spec.get(req_id, ()))
            if drafts and drafts[0] == -1:  # async: propose on the device's tokens
                proposed = self.proposer.propose(st.token_ids, len(drafts))
                drafts = proposed + [st.token_ids[-1]] * (len(drafts) - len(proposed))
            start, num_real = st.position, n - len(drafts)
            input_ids += st.token_ids[start : start + num_real] + drafts
            samples = start + num_real >= len(st.token_ids)
            plan.append(_Planned(req_id, st, start, num_real, drafts, samples))
        self.sampled.fill_(-1)
        if not plan:
            return
        meta = AttentionMetadata.build(
            [p.start for p in plan],
            [p.num_real + len(p.drafts) for p in plan],
            [[p.state.tables[g] for p in plan] for g in range(self.num_groups)],
            self.block_size,
        )
        ids = torch.tensor(input_ids, dtype=torch.long)  # [num_tokens]
        hidden = self.model(ids, meta.query_positions(), self.kv_caches, meta)
        prompt_rows = self._prompt_logprob_rows(plan, meta, hidden)
        self._rows[slot] = (self._sample(plan, meta, hidden, rows), prompt_rows)

    def _prompt_logprob_rows(
        self, plan: list[_Planned], meta: AttentionMetadata, hidden: torch.Tensor
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
            targets += p.state.token_ids[p.start + 1 : last + 1]
        if not index:
            return None
        logits = self.model.compute_logits(hidden, torch.tensor(index))  # [rows, vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        wanted = torch.tensor(targets, device=logprobs.device)
        return LogprobRows(*gather_logprobs(logprobs, wanted, max(s[3] for s in spans)), spans)

    def _sample(
        self,
        plan: list[_Planned],
        meta: AttentionMetadata,
        hidden: torch.Tensor,
        rows: list[str],
    ) -> LogprobRows | None:
        """Sample every request whose step reaches its last known token, accept drafts and write
        the tokens to the sampled buffer; returns the logprob rows of requests that asked."""
        index: list[int] = []  # hidden-state row of every sampled position
        row_params: list[ModelSamplingParams] = []
        positions: list[int] = []
        sampling: list[tuple[_Planned, int]] = []  # request and its first row
        for p, end in zip(plan, meta.query_start_loc[1:], strict=True):
            if not p.samples:  # a prefill chunk that does not reach the end of the prompt
                p.state.position = p.start + p.num_real
                continue
            sampling.append((p, len(index)))
            for j in range(len(p.drafts) + 1):
                index.append(end - len(p.drafts) - 1 + j)
                row_params.append(p.state.params)
                positions.append(p.start + p.num_real + j)
        if not index:
            return None
        logits = self.model.compute_logits(hidden, torch.tensor(index))  # [rows, vocab]
        batch = SamplingBatch.from_params(row_params, positions, logits.shape[-1])
        banned = _banned_before_min_tokens(sampling)
        out = sample(logits, batch, self.generator, banned=banned, logprobs_mode=self.logprobs_mode)
        tokens = out.token_ids.tolist()
        spans: list[tuple[str, int, int, int, int]] = []  # rows of requests asking for logprobs
        width = self.sampled.shape[1]
        sampled_rows: list[list[int]] = []
        for p, first in sampling:
            accepted = 0  # drafts are deterministic: accept while the target agrees
            while accepted < len(p.drafts) and tokens[first + accepted] == p.drafts[accepted]:
                accepted += 1
            new = tokens[first : first + accepted + 1]
            self.num_draft_tokens += len(p.drafts)
            self.num_accepted_tokens += accepted
            p.state.token_ids.extend(new)
            p.state.position = len(p.state.token_ids) - 1
            sampled_rows.append(new + [-1] * (width - len(new)))
            rows.append(p.req_id)
            if p.state.params.logprobs is not None:
                spans.append((p.req_id, first, len(new), p.state.params.logprobs, 0))
        self.sampled[: len(sampled_rows)] = torch.tensor(sampled_rows, dtype=torch.int64)
        if not spans:
            return None
        assert out.sampled_logprobs is not None and out.top_logprobs is not None
        assert out.top_token_ids is not None
        return LogprobRows(out.sampled_logprobs, out.top_logprobs, out.top_token_ids, spans)


@dataclass(slots=True)
class _Planned:
    """One request's share of a forward."""

    req_id: str
    state: DeviceRequest
    start: int  # first query position (the device's, after any draft rollback)
    num_real: int  # tokens known before the step (prompt chunk or the last sampled token)
    drafts: list[int]
    samples: bool  # the step reaches the end of the known tokens: sample after it


def _banned_before_min_tokens(sampling: list[tuple[_Planned, int]]) -> tuple[list[int], list[int]]:
    """(rows, token ids): EOS and stop tokens cannot be sampled before `min_tokens` outputs."""
    rows: list[int] = []
    cols: list[int] = []
    for p, first in sampling:
        st = p.state
        num_out = len(st.token_ids) - st.num_prompt_tokens
        if not st.eos_ids or num_out >= st.min_tokens:
            continue
        for j in range(min(len(p.drafts) + 1, st.min_tokens - num_out)):
            rows += [first + j] * len(st.eos_ids)
            cols += st.eos_ids
    return rows, cols


def _new_ids(block_ids: tuple[list[int], ...], num_computed: int, bs: int) -> list[int]:
    """Blocks a new request's step will write (prefix hits before num_computed are shared)."""
    return [b for ids in block_ids for b in ids[num_computed // bs :] if b]
