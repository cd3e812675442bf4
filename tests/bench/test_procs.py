"""The processes' ports (kvtier.bench.procs.free_port): free when asked, and never from the range
the OS hands out to outgoing connections, where a replica's or a client's connection could take
a server's port before it binds (seen: sglang-router "Address already in use" in CI)."""

from __future__ import annotations

import socket

from kvtier.bench.procs import LOWEST_PORT, ephemeral_ports, free_port


def test_free_ports_bind_and_lie_outside_the_ephemeral_range() -> None:
    lo, hi = ephemeral_ports()
    for _ in range(200):
        port = free_port()
        assert LOWEST_PORT <= port <= 65535 and not lo <= port <= hi, (port, lo, hi)
    with socket.socket() as s:  # free: a server can take it
        s.bind(("127.0.0.1", free_port()))


def test_a_port_taken_is_not_handed_out() -> None:
    held = []
    try:
        for _ in range(50):  # hold ports as servers would; none is handed out twice
            port = free_port()
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == len(held)
    finally:
        for s in held:
            s.close()
