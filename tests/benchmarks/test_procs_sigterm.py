"""`benchmarks/peers/procs.py`: a benchmark that started peer servers and is stopped by SIGTERM (a
`timeout`, a CI job's end) still stops them — their `finally` blocks run — instead of leaving
servers in their own sessions behind it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the lab is `benchmarks/` there

HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

BENCH = """
import os, sys, time
from pathlib import Path
from benchmarks.peers import procs
port = procs.free_port()
srv = procs.Server([sys.executable, "-c", sys.argv[1], str(port)], port, dict(os.environ),
                   Path(sys.argv[2]), 60)
try:
    print(srv.proc.pid, flush=True)
    time.sleep(120)
finally:
    srv.close()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ", 1)[1][0] != "Z"


def test_sigterm_stops_the_peer_servers(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, HEALTH_SERVER, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path])),
    )
    assert bench.stdout is not None
    server_pid = int(bench.stdout.readline())
    assert alive(server_pid)
    bench.send_signal(signal.SIGTERM)
    bench.wait(60)
    deadline = time.monotonic() + 30
    while alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = not alive(server_pid)
    if not gone:
        os.killpg(server_pid, signal.SIGKILL)
    assert gone, "the peer server outlived the benchmark that started it"
