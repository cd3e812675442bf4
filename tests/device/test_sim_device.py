"""The sim backend: its timing model, its real data corruption in racy orders (scenarios 62 and 63
of architecture.md §Scenarios) and Trio-style determinism (same seed same trace, other seeds
differ)."""

from __future__ import annotations

import torch

from kvtier.device import COMPUTE, LOAD, STORE, AccessSet, CostModel, KVLayout, OpMeta, Work
from kvtier.device.sim import SimDevice, TraceEntry

LAYOUT = KVLayout(num_layer_slots=2, block_size=4, num_kv_heads=2, head_dim=8)
EXACT = CostModel(launch_ns=10, event_ns=1, kernel_ns=100, jitter=0.0)


def sim(cost: CostModel = EXACT, **kw: object) -> SimDevice:
    return SimDevice(LAYOUT, 8, 8, cost_model=cost, **kw)  # type: ignore[arg-type]


def noop(dev: SimDevice, stream: int, label: str, ns: int) -> None:
    dev.launch(stream, lambda: None, AccessSet(), OpMeta(label), Work.fixed(ns))  # type: ignore[arg-type]


def span(entry: TraceEntry) -> tuple[str, int, int, int]:
    return (entry.label, entry.launch_ns, entry.start_ns, entry.end_ns)


def test_op_starts_at_the_latest_of_host_launch_stream_free_and_awaited_event() -> None:
    dev = sim()
    noop(dev, COMPUTE, "forward", 1000)  # host 0 -> 10, starts 10, ends 1010
    noop(dev, COMPUTE, "next-forward", 50)  # FIFO: waits for the stream
    done = dev.record(COMPUTE)  # host 21, done at 1060
    dev.wait(LOAD, done)  # host 22
    noop(dev, LOAD, "load", 5)  # host 32, starts at the event
    noop(dev, STORE, "store", 5)  # idle stream: starts at host time
    assert [span(e) for e in dev.trace] == [
        ("forward", 0, 10, 1010),
        ("next-forward", 10, 1010, 1060),
        ("load", 22, 1060, 1065),
        ("store", 32, 42, 47),
    ]


def test_effects_apply_in_start_time_order_not_launch_or_end_order() -> None:
    dev = sim()
    log: list[str] = []
    for stream, label, ns in [
        (COMPUTE, "a", 500),
        (COMPUTE, "p", 1000),
        (LOAD, "q", 5),
        (STORE, "r", 2000),
    ]:
        dev.launch(
            stream, lambda lb=label: log.append(lb), AccessSet(), OpMeta(label), Work.fixed(ns)
        )
    dev.synchronize()
    assert [e.label for e in sorted(dev.trace, key=lambda e: e.end_ns)] == ["q", "a", "p", "r"]
    assert log == ["a", "q", "r", "p"]


def test_waiting_on_an_event_moves_host_time_to_the_event() -> None:
    dev = sim()
    noop(dev, COMPUTE, "forward", 1000)
    done = dev.record(COMPUTE)
    assert dev.query(done) is False
    dev.synchronize_event(done)
    assert dev.now_ns == 1010 and dev.query(done) is True
    dev.synchronize()  # nothing left: host time does not move back or forward
    assert dev.now_ns == 1011  # the query above cost event_ns


def test_query_of_a_never_recorded_event_says_done() -> None:
    dev = sim()
    assert dev.query(dev.new_event()) is True


def test_cost_model_prices_forwards_per_token_and_layer_and_copies_by_bytes() -> None:
    cost = CostModel(
        forward_layer_ns=10, forward_token_layer_ns=2, copy_latency_ns=7, copy_bytes_per_ns=4.0
    )
    assert cost.base_ns(Work.forward(num_tokens=5, num_layers=3)) == 3 * (10 + 2 * 5)
    assert cost.base_ns(Work.copy(num_bytes=400)) == 7 + 100
    assert cost.base_ns(None) == cost.kernel_ns


def test_copy_blocks_costs_block_bytes_over_bandwidth() -> None:
    dev = sim(CostModel(launch_ns=0, copy_latency_ns=0, copy_bytes_per_ns=1.0))
    dev.copy_blocks(LOAD, "host", "device", [0, 1], [2, 3], OpMeta("load"))
    entry = dev.trace[0]
    assert entry.end_ns - entry.start_ns == 2 * LAYOUT.block_bytes


def test_host_op_sees_only_ops_that_started_by_host_time() -> None:
    dev = sim(sanitize="collect")
    out = dev.alloc_buffer("out", [1])
    noop(dev, COMPUTE, "busy", 1000)
    dev.launch(
        COMPUTE, lambda: out.fill_(1.0), AccessSet.of(writes={"out": None}), OpMeta("write-out")
    )
    seen: list[float] = []
    dev.host_op(
        lambda: seen.append(out.item()), AccessSet.of(reads={"out": None}), OpMeta("read-out")
    )
    dev.synchronize()
    dev.host_op(
        lambda: seen.append(out.item()), AccessSet.of(reads={"out": None}), OpMeta("read-out")
    )
    assert seen == [0.0, 1.0]
    assert [(h.kind, h.first.meta.label) for h in dev.hazards] == [("RAW", "write-out")]


def store_race(wait_for_compute: bool, iters: int = 30) -> tuple[int, list[str]]:
    """Scenario 62: compute sleeps then fills every block with i; a store copies them to host."""
    dev = SimDevice(LAYOUT, 64, 64, sanitize="collect", cost_model=CostModel(jitter=0.1), seed=3)
    blocks = list(range(64))
    corrupt = 0
    for i in range(1, iters + 1):
        noop(dev, COMPUTE, "sleep", 50_000)
        dev.launch(
            COMPUTE,
            lambda i=i: [t.fill_(float(i)) for t in dev.kv("device")],
            AccessSet.of(writes={"device": blocks}),
            OpMeta("fill", step_seq=i),
        )
        if wait_for_compute:
            dev.wait(STORE, dev.record(COMPUTE))
        dev.copy_blocks(STORE, "device", "host", blocks, blocks, OpMeta("store", step_seq=i))
        dev.synchronize()
        corrupt += int(any(bool((t != i).any()) for t in dev.kv("host")))
    return corrupt, sorted({h.kind for h in dev.hazards})


def test_store_without_compute_done_wait_really_corrupts_host_copies() -> None:
    corrupt, kinds = store_race(wait_for_compute=False)
    assert corrupt == 30 and kinds == ["RAW"]


def test_store_waiting_on_compute_done_copies_every_iteration_intact() -> None:
    assert store_race(wait_for_compute=True) == (0, [])


def load_race(wait_for_compute: bool, iters: int = 30) -> tuple[int, list[str]]:
    """Scenario 63: compute fills a block with old, sleeps, probes it; a load writes new into it."""
    dev = SimDevice(LAYOUT, 4, 4, sanitize="collect", cost_model=CostModel(jitter=0.1), seed=5)
    probe = dev.alloc_buffer("probe", LAYOUT.page_shape(1)[1:])
    old, new = 1.0, 2.0
    dev.kv("host")[0][2].fill_(new)
    torn = 0
    for i in range(iters):
        dev.launch(
            COMPUTE,
            lambda: dev.kv("device")[0][1].fill_(old),
            AccessSet.of(writes={"device": [1]}),
            OpMeta("fill-old", step_seq=i),
        )
        noop(dev, COMPUTE, "sleep", 50_000)
        dev.launch(
            COMPUTE,
            lambda: probe.copy_(dev.kv("device")[0][1]),
            AccessSet.of(reads={"device": [1]}, writes={"probe": None}),
            OpMeta("probe", step_seq=i),
        )
        if wait_for_compute:
            dev.wait(LOAD, dev.record(COMPUTE))
        dev.copy_blocks(LOAD, "host", "device", [2], [1], OpMeta("load", step_seq=i))
        dev.synchronize()
        dev.host_op(lambda: None, AccessSet.of(reads={"probe": None}), OpMeta("check"))
        torn += int(bool((probe != old).any()))
    return torn, sorted({h.kind for h in dev.hazards})


def test_load_without_compute_done_wait_overwrites_the_block_before_the_probe_reads_it() -> None:
    torn, kinds = load_race(wait_for_compute=False)
    assert torn == 30
    assert kinds == ["WAR", "WAW"]  # the load races the probe's read and the fill's write


def test_load_waiting_on_compute_done_leaves_every_probe_intact() -> None:
    assert load_race(wait_for_compute=True) == (0, [])


def run_program(seed: int, jitter: float = 0.3) -> tuple[list[TraceEntry], torch.Tensor]:
    """Three steps of load / forward / store with events and host syncs; returns trace and data."""
    dev = SimDevice(LAYOUT, 8, 8, cost_model=CostModel(jitter=jitter), seed=seed)
    done = None
    for step in range(3):
        if done is not None:
            dev.wait(LOAD, done)
        dev.copy_blocks(LOAD, "host", "device", [step], [step], OpMeta("load", step))
        dev.wait(COMPUTE, dev.record(LOAD))
        dev.launch(
            COMPUTE,
            lambda s=step: dev.kv("device")[1][s].add_(s + 1.0),
            AccessSet.of(writes={"device": [step]}),
            OpMeta("forward", step),
            Work.forward(num_tokens=16 * (step + 1), num_layers=2),
        )
        done = dev.record(COMPUTE)
        dev.wait(STORE, done)
        dev.copy_blocks(STORE, "device", "host", [step], [step + 4], OpMeta("store", step))
        if step >= 1:
            dev.synchronize_event(done)
    dev.synchronize()
    return list(dev.trace), dev.kv("host")[1].clone()


def test_same_seed_gives_the_same_trace_and_data() -> None:
    trace_a, data_a = run_program(seed=11)
    trace_b, data_b = run_program(seed=11)
    assert trace_a == trace_b and torch.equal(data_a, data_b)


def test_different_jitter_seeds_give_different_traces_but_the_same_ordered_result() -> None:
    traces = [run_program(seed)[0] for seed in range(4)]
    assert len({tuple(t) for t in traces}) == 4
    results = [run_program(seed)[1] for seed in range(4)]
    assert all(torch.equal(results[0], r) for r in results)


def test_trace_keeps_only_the_latest_max_trace_ops() -> None:
    dev = SimDevice(LAYOUT, 2, 2, max_trace=2)
    for label in ("a", "b", "c"):
        noop(dev, COMPUTE, label, 1)
    assert [e.label for e in dev.trace] == ["b", "c"]


def test_without_jitter_the_seed_does_not_matter() -> None:
    assert run_program(seed=1, jitter=0.0)[0] == run_program(seed=2, jitter=0.0)[0]
