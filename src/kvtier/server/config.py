"""The settings of `kvtier serve` (`ServerConfig`): listening, limits, deployment (keys, CORS, TLS,
root path), metrics naming, KV events and tool calling, with their checks. Each field carries its
flag's help (`config.setting`); the engine's settings stay in `kvtier.config`. Imports neither
FastAPI nor torch: `kvtier serve --help` is built from it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier.checks import check_field_types
from kvtier.config import setting
from kvtier.server.tool_parsers import PARSERS


def check_metrics_prefix(prefix: str) -> None:
    """ValueError unless `prefix` can start a Prometheus metric name and is not kvtier's own."""
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
        raise ValueError(
            f"--metrics-prefix must be a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*), got {prefix!r}"
        )
    if prefix == "kvtier":
        raise ValueError(
            "--metrics-prefix kvtier would clash with kvtier's own per-tier families "
            "(kvtier:kv_cache_usage_perc{tier=...}); pick another name, e.g. kvtier_vllm"
        )


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """ValueError naming the flag: an unknown parser, or auto tool choice without one."""
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(
            f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}"
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes for Qwen/Hermes, "
            "llama3_json for Llama 3.x, mistral for Mistral)"
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front of `kvtier serve`."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    served_model_name: str | None = setting(
        None,
        "model id clients send (default: --model, or kvtier-default)",
    )
    max_waiting_requests: int = setting(
        1024,
        "requests allowed to wait beyond the free running slots (--max-num-seqs); more get "
        "HTTP 429 with Retry-After. 0: only requests that can start at once",
    )
    max_request_body_bytes: int = setting(
        4 << 20,
        "largest request body (suffixes KiB/MiB accepted); larger get 413",
    )
    log_level: str = setting("info", "debug, info, warning or error")
    engine_process: bool = setting(
        True,
        "run the engine in a process of its own, beside the HTTP server's (default); "
        "--no-engine-process runs it on a thread of the server's process",
    )
    engine_iteration_timeout_s: float = setting(
        30.0,
        "/health answers 503 once the engine loop has not advanced for this many seconds (a "
        "hung step, a stopped or stuck engine process); longer than your slowest step",
    )
    metrics_prefix: str = setting(
        "vllm",
        "prefix of the metric families shaped as vLLM's (vllm: lets a vLLM Grafana board read"
        " this server unchanged); kvtier's own families keep kvtier:",
    )
    # Deployment, spelled as vLLM's (server/access.py): keys, CORS, TLS, a proxy's path prefix
    api_key: tuple[str, ...] = setting(
        (),
        "keys clients must send as `Authorization: Bearer KEY` on every route but /health, "
        "/metrics and /version (default: $KVTIER_API_KEY, then $VLLM_API_KEY; unset: no key)",
    )
    allowed_origins: tuple[str, ...] = setting(
        ("*",),
        "CORS: origins browsers may call from, a JSON list",
    )
    allowed_methods: tuple[str, ...] = setting(("*",), "CORS: methods allowed, a JSON list")
    allowed_headers: tuple[str, ...] = setting(("*",), "CORS: request headers allowed, a JSON list")
    allow_credentials: bool = setting(False, "CORS: let browsers send cookies and credentials")
    ssl_keyfile: str | None = setting(
        None,
        "TLS: the server's private key file (PEM); needs --ssl-certfile",
    )
    ssl_certfile: str | None = setting(
        None,
        "TLS: the server's certificate file (PEM); needs --ssl-keyfile",
    )
    ssl_ca_certs: str | None = setting(
        None,
        "TLS: CA certificates that client certificates are checked against",
    )
    ssl_cert_reqs: int = setting(0, "TLS: client certificates: 0 not asked, 1 optional, 2 required")
    root_path: str | None = setting(
        None,
        "path prefix a proxy strips before forwarding (FastAPI's root_path), e.g. /kv; the "
        "OpenAPI schema names it",
    )
    kv_events_config: str | None = setting(
        None,
        "publish KV cache events as vLLM does (ZMQ, msgpack), a JSON object such as "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\'; fields publisher, buffer_steps, hwm, max_queue_size, topic as '
        "vLLM's (docs/serving.md)",
    )
    # Tool calling, as vLLM's flags (server/tool_parsers.py has the parsers)
    enable_auto_tool_choice: bool = setting(
        False,
        'let tool_choice "auto" (the default when a request sends tools) parse tool calls out of '
        "the model's text with --tool-call-parser",
    )
    tool_call_parser: str | None = setting(
        None,
        "how this model writes tool calls: hermes (Hermes, Qwen2.5/3), llama3_json (Llama 3.x) "
        "or mistral",
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        check_metrics_prefix(self.metrics_prefix)
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        self._check_deployment()
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must be ≥ 0")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be ≥ 1")
        if not self.engine_iteration_timeout_s > 0:
            raise ValueError(
                "--engine-iteration-timeout-s must be positive seconds, got "
                f"{self.engine_iteration_timeout_s}"
            )
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(
                f"--log-level must be debug, info, warning or error, got {self.log_level!r}"
            )

    def _check_deployment(self) -> None:
        if any(not key.strip() for key in self.api_key):
            raise ValueError("--api-key must not be empty; pass the key clients send as Bearer")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile (or neither)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(
                f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got "
                f"{self.ssl_cert_reqs}"
            )
        if self.root_path is not None and not (
            self.root_path.startswith("/") and not self.root_path.endswith("/")
        ):
            fix = "/" + self.root_path.strip("/")
            raise ValueError(
                f"--root-path {self.root_path!r} must start with '/' and not end with one: "
                f"pass {fix!r}"
            )
