"""`kvtier serve`'s deployment flags, spelled as vLLM's, on a real server process: an API key on
every route but the probes (`--api-key`, or KVTIER_API_KEY / VLLM_API_KEY), CORS, TLS (with client
certificates) and `--root-path` behind a proxy that strips a prefix."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import AuthenticationError, OpenAI

from tests.server.conftest import MODEL, free_port, serve_command, wait_until

KEY = "sk-test-0123"
ORIGIN = "https://ui.example"


@contextmanager
def kvtier_serve(
    tmp_path: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
) -> Iterator[int]:
    """A `kvtier serve` process of the embedded model with `flags`; yields its port once /health
    answers (over TLS when `tls` is the client context to use)."""
    port = free_port()
    log = (tmp_path / f"serve-{port}.log").open("w+")
    environ = {**os.environ, **(env or {})}
    cmd = [*serve_command(port, 128, 64), "--no-engine-process", *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
    try:
        wait_until(lambda: probe(port, tls) == 200 or proc.poll() is not None, 120)
        assert proc.poll() is None, Path(log.name).read_text()
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def probe(port: int, tls: ssl.SSLContext | None) -> int:
    try:
        return request(port, "GET", "/health", tls=tls)[0]
    except (OSError, ssl.SSLError):
        return 0


def request(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if tls is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=tls)
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    conn.request(method, path, data, {**hdrs, **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


COMPLETION = {"model": MODEL, "prompt": "The with statement", "max_tokens": 2}


def test_api_key_cors_and_root_path_on_one_server(tmp_path: Path) -> None:
    origins = json.dumps([ORIGIN])
    flags = ("--api-key", KEY, "--allowed-origins", origins, "--root-path", "/kv")
    with kvtier_serve(tmp_path, *flags) as port:
        # the key guards the API; the probes a load balancer and Prometheus read stay open
        assert request(port, "GET", "/v1/models")[0] == 401
        assert request(port, "GET", "/v1/models", bearer("sk-wrong"))[0] == 401
        assert request(port, "GET", "/v1/models", {"Authorization": KEY})[0] == 401
        assert request(port, "POST", "/v1/completions", body=COMPLETION)[0] == 401
        assert request(port, "POST", "/tokenize", body={"prompt": "hi"})[0] == 401
        status, _, body = request(port, "GET", "/v1/models", bearer(KEY))
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        assert request(port, "GET", "/v1/models", {"Authorization": f"bearer {KEY}"})[0] == 200
        for open_path in ("/health", "/metrics", "/version"):
            assert request(port, "GET", open_path)[0] == 200, open_path
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(**COMPLETION).usage.completion_tokens == 2
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=client.base_url, api_key="sk-no", max_retries=0).models.list()

        # CORS: the browser's preflight needs no key; the allowed origin is echoed, others not
        preflight = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        status, headers, _ = request(port, "OPTIONS", "/v1/chat/completions", preflight)
        assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in headers["access-control-allow-methods"]
        status, headers, _ = request(
            port, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "https://evil.example"}
        )
        assert status == 400 and "access-control-allow-origin" not in headers
        # a refusal still carries the CORS header, so the page can read why
        status, headers, _ = request(port, "GET", "/v1/models", {"Origin": ORIGIN})
        assert status == 401 and headers["access-control-allow-origin"] == ORIGIN
        assert "access-control-allow-credentials" not in headers

        # --root-path: the app is mounted under /kv by a proxy that strips it; the schema's
        # server URL says so (the probes above stayed open: the key check strips the prefix
        # uvicorn puts back, as the router does)
        assert request(port, "GET", "/openapi.json")[0] == 401
        status, _, body = request(port, "GET", "/openapi.json", bearer(KEY))
        assert status == 200 and json.loads(body)["servers"] == [{"url": "/kv"}]


def test_api_key_from_the_environment_kvtier_before_vllm(tmp_path: Path) -> None:
    env = {"KVTIER_API_KEY": KEY, "VLLM_API_KEY": "sk-vllm"}
    with kvtier_serve(tmp_path, env=env) as port:
        assert request(port, "GET", "/v1/models")[0] == 401
        assert request(port, "GET", "/v1/models", bearer("sk-vllm"))[0] == 401
        assert request(port, "GET", "/v1/models", bearer(KEY))[0] == 200
        # without an Origin the default CORS (any origin, as vLLM) adds nothing
        assert "access-control-allow-origin" not in request(port, "GET", "/health")[1]
        status, headers, _ = request(port, "GET", "/health", {"Origin": "https://any.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "*"


def make_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (also its own CA) and its key, by the openssl CLI."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_client_certificates(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    flags = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    flags += ("--ssl-ca-certs", str(cert), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)))
    client_tls = ssl.create_default_context(cafile=str(cert))
    client_tls.load_cert_chain(str(cert), str(key))
    with kvtier_serve(tmp_path, *flags, env={"VLLM_API_KEY": KEY}, tls=client_tls) as port:
        status, _, body = request(port, "GET", "/v1/models", bearer(KEY), tls=client_tls)
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        # the server's certificate is checked by the client, the client's by the server
        anonymous = ssl.create_default_context(cafile=str(cert))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            request(port, "GET", "/v1/models", bearer(KEY), tls=anonymous)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            request(port, "GET", "/health")  # plain HTTP on the TLS port


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--ssl-keyfile", "{tmp}/key.pem"), "--ssl-certfile"),
        (("--ssl-certfile", "{tmp}/nope.pem", "--ssl-keyfile", "{tmp}/key.pem"), "nope.pem"),
        (("--allowed-origins", "https://a.example"), "--allowed-origins.*JSON"),
        (("--root-path", "kv"), "--root-path.*'/kv'"),
        (("--api-key", ""), "--api-key"),
    ],
)
def test_bad_deployment_flags_name_the_flag(
    tmp_path: Path, flags: tuple[str, ...], match: str
) -> None:
    (tmp_path / "key.pem").write_text("x")
    cmd = [*serve_command(free_port(), 128, 64)]
    cmd += [f.format(tmp=tmp_path) for f in flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert re.search(match, r.stderr), r.stderr
