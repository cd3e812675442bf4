"""Device-side request state of the runner: tokens the device knows, its position, block tables.

Mutated only inside ops on the compute stream (declared as the `token_state` buffer), so under
async scheduling it runs ahead of the host exactly as the device does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.model.sampler import SamplingParams as ModelSamplingParams
from kvtier.sched.output import SchedulerOutput


@dataclass(slots=True)
class DeviceRequest:
    token_ids: list[int]  # prompt + every token sampled on the device so far
    position: int  # tokens whose KV is written: the next query position
    tables: list[list[int]]  # block ids per KV-cache group (0 = null block)
    params: ModelSamplingParams
    num_prompt_tokens: int
    min_tokens: int = 0
    eos_ids: tuple[int, ...] = field(default_factory=tuple)  # banned until min_tokens outputs
    num_prompt_logprobs: int | None = None  # top candidates per prompt token; None: not asked


def apply_diffs(
    state: dict[str, DeviceRequest],
    output: SchedulerOutput,
    params: dict[str, ModelSamplingParams],
    eos_ids: tuple[int, ...],
    prompt_logprobs: dict[str, int],
) -> None:
    """Bring `state` to the tables of step `output` (drops, new requests, appended blocks).

    `prompt_logprobs` names the new requests that want them: not again when a request resumes
    with outputs (its prompt logprobs were delivered with its first output)."""
    for req_id in output.preempted_req_ids:
        state.pop(req_id, None)
    for req_id in output.finished_req_ids:
        state.pop(req_id, None)
    for new in output.scheduled_new_reqs:
        state[new.req_id] = DeviceRequest(
            token_ids=list(new.token_ids),
            position=new.num_computed_tokens,
            tables=[list(ids) for ids in new.block_ids],
            params=params[new.req_id],
            num_prompt_tokens=new.num_prompt_tokens,
            min_tokens=new.sampling.min_tokens,
            # as vLLM's all_stop_token_ids: EOS is banned before min_tokens even with ignore_eos
            eos_ids=eos_ids + new.sampling.stop_token_ids,
            num_prompt_logprobs=prompt_logprobs.get(new.req_id)
            if len(new.token_ids) == new.num_prompt_tokens
            else None,
        )
    for cached in output.scheduled_cached_reqs:
        st = state[cached.req_id]
        for table, ids in zip(st.tables, cached.new_block_ids, strict=True):
            table.extend(ids)
