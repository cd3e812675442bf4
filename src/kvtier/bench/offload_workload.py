"""`kvtier bench offload`'s workload and client: multi-round shared-prefix conversations as
token ids, the blocks their working set needs, and a closed loop that keeps a fixed number of
requests in flight on one engine and records each request's first-token and end times on the
sim device's clock and the wall clock."""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.serve_data import Conversation, Prompt

if TYPE_CHECKING:
    from kvtier.device.sim import SimDevice
    from kvtier.engine.core import EngineCore


@dataclass(frozen=True)
class Workload:
    convs: list[Conversation]  # token-id prompts
    num_prefixes: int
    prefix_len: int
    rounds: int
    max_len: int  # longest prompt + answer of any round

    @staticmethod
    def final_len(conv: Conversation) -> int:
        """Tokens of a conversation's last prompt + answer (its history at the end)."""
        return len(conv.prefix) + sum(map(len, conv.questions)) + sum(conv.output_lens)


def build_workload(args: argparse.Namespace, model_path: Path) -> Workload:
    from kvtier.bench import serve_data

    if min(args.num_prefixes, args.prefix_len, args.users_per_prefix, args.rounds) < 1:
        raise SystemExit(
            "--num-prefixes, --prefix-len, --users-per-prefix and --rounds must be ≥ 1"
        )
    if min(args.question_len, args.answer_len) < 1:
        raise SystemExit("--question-len and --answer-len must be ≥ 1")
    spec = serve_data.Dataset(
        "shared-prefix",
        num_prompts=args.num_prefixes * args.users_per_prefix,
        input_len=args.question_len,
        output_len=args.answer_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
        num_rounds=args.rounds,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
    )
    convs = serve_data.build(spec, serve_data.Tok(model_path), use_ids=True)
    longest = max(map(Workload.final_len, convs))
    return Workload(convs, args.num_prefixes, args.prefix_len, args.rounds, longest)


def working_set_blocks(specs: list[Any], w: Workload) -> tuple[int, int]:
    """(working set, every block): blocks the device must keep for every conversation's next
    round to hit its whole history, and blocks of every token of every conversation in every
    group (what a host tier holding everything needs). Prefix blocks count once."""
    from kvtier.kv.specs import FullAttention, cdiv

    working = every = 0
    for spec in specs:
        bs = spec.block_size
        shared = (w.prefix_len // bs) * w.num_prefixes  # full prefix blocks, shared
        own = sum(cdiv(w.final_len(c), bs) - w.prefix_len // bs for c in w.convs)
        every += shared + own
        if isinstance(spec, FullAttention):
            working += shared + own
        else:  # window groups: the blocks at each history's end, and at each prefix's end
            working += sum(spec.steady_blocks(w.final_len(c)) for c in w.convs)
            working += spec.steady_blocks(w.prefix_len) * w.num_prefixes
    return working, every


@dataclass
class Record:
    """One request (a conversation's round) as the client saw it."""

    conv: int
    round: int
    prompt_tokens: int
    sent_ns: int
    sent_wall: float
    first_ns: int | None = None
    first_wall: float | None = None
    done_ns: int | None = None
    done_wall: float | None = None
    output: list[int] | None = None
    cached_tokens: int = 0  # device + host prefix hits at first admission
    host_tokens: int = 0  # of those, loaded from the host tier

    @property
    def ttft_device_ms(self) -> float:
        assert self.first_ns is not None, "every request yields at least one token"
        return (self.first_ns - self.sent_ns) / 1e6

    @property
    def ttft_wall_ms(self) -> float:
        assert self.first_wall is not None, "every request yields at least one token"
        return (self.first_wall - self.sent_wall) * 1e3


def sim_device(engine: EngineCore) -> SimDevice:
    from kvtier.device.sim import SimDevice

    device = engine.device
    if not isinstance(device, SimDevice):
        raise TypeError(f"bench offload measures on the sim device, got {type(device).__name__}")
    return device


def device_clock(engine: EngineCore) -> Callable[[], int]:
    """The sim device's modelled clock in ns; always 0 on the cpu and cuda backends (which the
    benchmarks measure on the wall clock only)."""
    from kvtier.device.sim import SimDevice

    device = engine.device
    if isinstance(device, SimDevice):
        return lambda: device.now_ns
    return lambda: 0


def drive(
    engine: EngineCore,
    w: Workload,
    concurrency: int,
    after_step: Callable[[], None] | None = None,
) -> list[Record]:
    """Run the closed loop to the end; return one record per request, in completion order.
    `after_step` is called after every engine step (e.g. to sample `engine.stats()`)."""
    from kvtier.engine import SamplingParams

    now_ns = device_clock(engine)
    ready: deque[tuple[Conversation, int]] = deque((c, 0) for c in w.convs)
    prompts = {c.index: ids(c.prefix) + ids(c.questions[0]) for c in w.convs}
    inflight: dict[str, Record] = {}
    done: list[Record] = []
    while ready or inflight:
        while ready and len(inflight) < concurrency:
            conv, rnd = ready.popleft()
            req_id = f"conv{conv.index}-round{rnd}"
            prompt = prompts[conv.index]
            params = SamplingParams(
                max_tokens=conv.output_lens[rnd], temperature=0.0, ignore_eos=True
            )
            engine.add_request(req_id, prompt, params)
            inflight[req_id] = Record(conv.index, rnd, len(prompt), now_ns(), time.perf_counter())
        for out in engine.step():
            rec = inflight.get(out.req_id)
            if rec is None:
                continue
            if rec.first_ns is None and out.new_token_ids:
                rec.first_ns, rec.first_wall = now_ns(), time.perf_counter()
            if out.result is None:
                continue
            rec.done_ns, rec.done_wall = now_ns(), time.perf_counter()
            rec.output = list(out.result.token_ids)
            rec.cached_tokens = out.result.num_cached_tokens
            rec.host_tokens = out.result.num_external_cached_tokens
            del inflight[out.req_id]
            done.append(rec)
            conv = w.convs[rec.conv]
            if rec.round + 1 < len(conv.questions):
                prompts[rec.conv] += rec.output + ids(conv.questions[rec.round + 1])
                ready.append((conv, rec.round + 1))
        if after_step is not None:
            after_step()
    while engine.has_unfinished_requests():  # stores still in flight (not in the measured span)
        engine.step()
        if after_step is not None:
            after_step()
    return done


def ids(prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        raise TypeError("bench offload builds token-id prompts")
    return list(prompt)
