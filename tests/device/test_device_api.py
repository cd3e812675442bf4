"""The `Device` surface on every CPU-runnable backend: buffers, block copies, poison, the
sanitizer feed, and the ValueErrors that name bad input."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.device import (
    COMPUTE,
    LOAD,
    STORE,
    WHOLE,
    AccessSet,
    Device,
    KVLayout,
    OpMeta,
    RaceError,
    make_device,
)
from kvtier.ids import EventId, StreamId

LAYOUT = KVLayout(num_layer_slots=3, block_size=4, num_kv_heads=2, head_dim=8)
BACKENDS = ["sim", "cpu"]


def dev_of(backend: str, **kw: object) -> Device:
    return make_device(backend, LAYOUT, 6, 4, **kw)  # type: ignore[arg-type]


def forward(dev: Device, reads: list[int], writes: list[int], fn: Callable[[], object]) -> None:
    dev.launch(
        COMPUTE,
        fn,
        AccessSet.of(reads={"device": reads}, writes={"device": writes}),
        OpMeta("forward", step_seq=1, req_ids=("a",)),
    )


def test_layout_shapes_and_block_bytes() -> None:
    assert LAYOUT.slot_shape(6) == (6, 2, 4, 2, 8)
    assert LAYOUT.page_shape(6) == (6, 2 * 4 * 2 * 8)  # an attention page by default
    assert LAYOUT.block_bytes == 3 * 2 * 4 * 2 * 8 * 4
    assert KVLayout(1, 1, 1, 1, dtype="bfloat16").block_bytes == 4
    state = KVLayout(2, 4, 2, 8, page_bytes=1000)  # a page sized for a larger state
    assert state.page_shape(3) == (3, 250) and state.block_bytes == 2000


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_tiers_have_one_flat_tensor_per_layer_slot(backend: str) -> None:
    """A slot is flat pages; attention's view of it is exact (architecture.md §Pages)."""
    dev = dev_of(backend)
    assert [tuple(t.shape) for t in dev.kv("device")] == [LAYOUT.page_shape(6)] * 3
    assert [tuple(t.shape) for t in dev.kv("host")] == [LAYOUT.page_shape(4)] * 3
    view = dev.kv("device")[1].view(LAYOUT.slot_shape(6))
    view[2, 1].fill_(3.0)  # block 2's V
    assert float(dev.kv("device")[1][2].sum()) == 3.0 * 4 * 2 * 8
    assert dev.num_blocks("device") == 6 and dev.num_blocks("host") == 4
    assert dev.kv("device")[0].dtype == torch.float32
    assert dev.kv("device")[0].device == dev.torch_device == torch.device("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("src_ids", "dst_ids"), [([3, 1], [0, 5]), ([0, 1, 2], [3, 4, 5]), ([1, 2, 3, 0], [2, 3, 0, 1])]
)
def test_copy_blocks_moves_the_blocks_in_every_layer_slot_only(
    backend: str, src_ids: list[int], dst_ids: list[int]
) -> None:
    dev = dev_of(backend)
    for slot, t in enumerate(dev.kv("host")):
        for b in range(4):
            t[b].fill_(10 * slot + b + 1)
    dev.copy_blocks(LOAD, "host", "device", src_ids, dst_ids, OpMeta("load"))
    dev.synchronize()
    for slot, t in enumerate(dev.kv("device")):
        want = [0.0] * 6
        for s, d in zip(src_ids, dst_ids, strict=True):
            want[d] = 10 * slot + s + 1
        assert [float(t[b].mean()) for b in range(6)] == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_unordered_store_raises_race_error_on_every_backend(backend: str) -> None:
    dev = dev_of(backend)
    forward(dev, [], [2], lambda: dev.kv("device")[0][2].fill_(1.0))
    with pytest.raises(RaceError, match="RAW on device\\[2\\]"):
        dev.copy_blocks(STORE, "device", "host", [2], [0], OpMeta("store", step_seq=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_after_compute_done_event_is_clean_and_lands(backend: str) -> None:
    dev = dev_of(backend)
    forward(dev, [], [2], lambda: [t[2].fill_(7.0) for t in dev.kv("device")])
    dev.wait(STORE, dev.record(COMPUTE))
    dev.copy_blocks(STORE, "device", "host", [2], [0], OpMeta("store", step_seq=1))
    dev.synchronize()
    assert all(bool((t[0] == 7.0).all()) for t in dev.kv("host"))
    assert dev.hazards == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_released_event_leaves_no_snapshot_behind(backend: str) -> None:
    dev = dev_of(backend)
    done = dev.record(COMPUTE)
    assert dev.sanitizer is not None and len(dev.sanitizer._events) == 1
    dev.release_event(done)
    assert dev.sanitizer._events == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_poison_fills_only_the_given_blocks_with_nan(backend: str) -> None:
    dev = dev_of(backend, poison=True)
    assert dev.poison_blocks("device", [1, 4]) is not None
    dev.synchronize()
    for t in dev.kv("device"):
        assert [bool(t[b].isnan().all()) for b in range(6)] == [0, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_poison_switch_off_touches_nothing(backend: str) -> None:
    dev = dev_of(backend)
    assert dev.poison_blocks("device", [1]) is None
    assert not any(bool(t.isnan().any()) for t in dev.kv("device"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_poison_of_a_block_a_pending_forward_reads_is_caught(backend: str) -> None:
    dev = dev_of(backend, poison=True)
    forward(dev, [3], [], lambda: None)
    with pytest.raises(RaceError, match="WAR on device\\[3\\]"):
        dev.poison_blocks("device", [3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_poison_as_a_stream_op_is_ordered_like_any_write(backend: str) -> None:
    dev = dev_of(backend, poison=True)
    forward(dev, [3], [], lambda: None)
    dev.poison_blocks("device", [3], stream=COMPUTE)  # same stream: program order
    with pytest.raises(RaceError, match="WAW"):
        dev.poison_blocks("device", [3], stream=LOAD)


def test_a_forward_reading_a_recycled_block_on_sim_reads_nan_poison() -> None:
    dev = dev_of("sim", poison=True, sanitize="collect")
    seen: list[torch.Tensor] = []
    dev.launch(COMPUTE, lambda: None, AccessSet(), OpMeta("backlog"))
    forward(dev, [3], [], lambda: seen.append(dev.kv("device")[0][3].clone()))
    dev.poison_blocks("device", [3])  # reallocated while the forward is still queued
    dev.synchronize()
    assert bool(seen[0].isnan().all())
    assert [h.kind for h in dev.hazards] == ["WAR"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_tokens_read_on_the_host_after_sync(backend: str) -> None:
    dev = dev_of(backend)
    sampled = dev.alloc_buffer("sampled_tokens", [4], dtype="int64", tier="host")
    assert dev.buffer("sampled_tokens") is sampled
    dev.launch(
        COMPUTE,
        lambda: sampled.copy_(torch.arange(4)),
        AccessSet.of(writes={"sampled_tokens": None}),
        OpMeta("sample"),
    )
    done = dev.record(COMPUTE)
    dev.synchronize_event(done)
    assert dev.query(done) is True
    got: list[int] = []
    dev.host_op(
        lambda: got.extend(sampled.tolist()),
        AccessSet.of(reads={"sampled_tokens": None}),
        OpMeta("read"),
    )
    assert got == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_streams_are_created_by_name_once(backend: str) -> None:
    dev = dev_of(backend)
    assert (dev.stream("compute"), dev.stream("load"), dev.stream("store")) == (0, 1, 2)
    aux = dev.stream("aux")
    assert aux == dev.stream("aux") == StreamId(3) and dev.stream_name(aux) == "aux"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sanitizer_off_reports_nothing_and_still_runs_ops(backend: str) -> None:
    dev = dev_of(backend, sanitize=None)
    forward(dev, [], [2], lambda: dev.kv("device")[0][2].fill_(1.0))
    dev.copy_blocks(STORE, "device", "host", [2], [0], OpMeta("store"))
    dev.synchronize()
    assert dev.hazards == [] and dev.sanitizer is None
    assert not dev.checks_access  # callers may skip computing block sets nobody reads
    checked = dev_of(backend)
    assert checked.checks_access
    checked.close()


def test_access_set_of_marks_unpaged_buffers_whole() -> None:
    acc = AccessSet.of(reads={"device": [1, 2], "tok": None}, writes={"host": range(2)})
    assert acc.reads == (("device", (1, 2)), ("tok", (WHOLE,)))
    assert acc.writes == (("host", (0, 1)),)
    assert acc.buffers() == {"device", "tok", "host"} and acc.num_blocks() == 5


BAD_CALLS: list[tuple[str, Callable[[Device], object]]] = [
    (
        "unknown buffer 'kv'",
        lambda d: d.launch(COMPUTE, lambda: None, AccessSet.of(reads={"kv": [0]}), OpMeta("x")),
    ),
    (
        "out of range",
        lambda d: d.launch(
            COMPUTE, lambda: None, AccessSet.of(writes={"device": [6]}), OpMeta("x")
        ),
    ),
    (
        "unpaged",
        lambda d: (
            d.alloc_buffer("tok", [2]),
            d.launch(COMPUTE, lambda: None, AccessSet.of(reads={"tok": [0]}), OpMeta("x")),
        ),
    ),
    ("unknown stream", lambda d: d.record(StreamId(9))),
    ("unknown or released event", lambda d: d.wait(COMPUTE, EventId(5))),
    ("released event", lambda d: (d.release_event(e := d.record(COMPUTE)), d.query(e))),
    ("as many src_ids", lambda d: d.copy_blocks(LOAD, "host", "device", [0, 1], [0], OpMeta("x"))),
    ("tier must be", lambda d: d.kv("disk")),  # type: ignore[arg-type]
    ("taken", lambda d: d.alloc_buffer("device", [1])),
    ("dtype must be", lambda d: d.alloc_buffer("b", [1], dtype="int8")),
    ("no buffer named", lambda d: d.buffer("missing")),
]


@pytest.mark.parametrize(("match", "call"), BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_bad_input_is_a_value_error_naming_it(match: str, call: Callable[[Device], object]) -> None:
    with pytest.raises(ValueError, match=match):
        call(dev_of("sim"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layer_slots": 0}, "num_layer_slots"),
        ({"head_dim": -1}, "head_dim"),
        ({"dtype": "int64"}, "dtype"),
        ({"page_bytes": 6}, "page_bytes"),
        ({"page_bytes": -4}, "page_bytes"),
    ],
)
def test_bad_layout_is_a_value_error(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "num_layer_slots": 1,
        "block_size": 4,
        "num_kv_heads": 1,
        "head_dim": 4,
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        KVLayout(**args)  # type: ignore[arg-type]


def test_bad_backend_and_block_counts_are_value_errors() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        make_device("tpu", LAYOUT, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_host_blocks"):
        make_device("cpu", LAYOUT, 1, -1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_backend_without_a_gpu_says_what_to_use() -> None:
    with pytest.raises(ValueError, match="use backend 'sim' or 'cpu'"):
        make_device("cuda", LAYOUT, 1, 1)
