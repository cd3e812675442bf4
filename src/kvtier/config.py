"""Frozen configuration dataclasses: the model's shape every layer plans with (`ModelConfig`, read
from a HF `config.json` by `model/hf_config.py`) and the engine's settings (`CacheConfig`,
`SchedulerConfig`, `StructuredOutputsConfig`). Validation errors name the flag and the fix. The
server's settings live in its own layer (`server/config.py`).

Each setting carries the help text of its flag (`setting`): the CLI (`cli_args.py`) reads it from
the field, so what a flag means is written once, beside its default and its checks. Values known
only at run time (blocks after sizing) are returned by planners, never written back. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvtier.checks import check_field_types, flag

# Bytes per element of every dtype kvtier sizes or stores: the one table, the device layer reads
# it too. A dtype enters it only with a buffer that holds it (the plan sizes what is allocated).
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
}
KV_DTYPES = ("float64", "float32", "bfloat16", "float16")  # a model's or KV pool's dtype
# 8-bit KV pools (docs/kernels.md, "8-bit KV"): vLLM's --kv-cache-dtype spellings → the dtype the
# pool holds. Per-tensor k/v scales live with the model's layers, not in the pages.
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# --kv-cache-dtype: auto is the model's (run) dtype; the resolved fp8 names are accepted too
KV_CACHE_DTYPES = ("auto", *KV_DTYPES, *FP8_KV_DTYPES, *sorted(set(FP8_KV_DTYPES.values())))
QUANTIZATIONS = (
    "compressed-tensors",
    "int8",
    "w8a8",
)  # --quantization (model/quant.py); None: config's

LAYER_KINDS = ("full", "sliding", "chunked", "mamba")
MAX_ASYNC_DEPTH = 3  # unprocessed steps at once (the runner's result ring is sized by it)
DEFAULT_ASYNC_DEPTH = 2
PROTECTIONS = ("event", "settled", "quarantine")  # architecture.md §Protections
STORE_MODES = ("eager", "lazy")  # when the host tier stores device blocks (vLLM's lazy_offload)
HASH_ALGOS = ("sha256", "xxhash")  # prefix-cache block hashes (kv/hashing.py's HASH_FUNCTIONS)
# What admission charges window groups for tokens in flight (kv.specs.AdmissionPolicy)
ADMISSION_POLICIES = ("shared", "per-request", "optimistic")
# URL schemes of --kv-remote-url (the ones `stores.redis_store.redis_url` accepts; config imports
# no other layer, so the list is repeated here)
REMOTE_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
DEFAULT_DISK_GIB = 16.0  # --kv-disk-size when --kv-disk-path is given alone


def parse_protect(text: str) -> tuple[str, ...]:
    """'event,settled' → ('event', 'settled'); 'none' → (). Unknown names are left to validation."""
    return () if text == "none" else tuple(p for p in text.split(",") if p)


def setting(default: Any = dataclasses.MISSING, text: str = "") -> Any:
    """A dataclass field whose flag's help is `text` (no default: a required field)."""
    return field(default=default, metadata={"help": text})


def flag_help(cls: type, name: str) -> str:
    """The help text of field `name` of config dataclass `cls` (KeyError for an unknown name)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return str(fields[name].metadata.get("help", ""))


@dataclass(frozen=True)
class MambaShape:
    """Geometry of one Mamba2 mixer: what its conv and SSM state hold per request."""

    num_heads: int
    head_dim: int
    state_size: int  # N: the SSM state of one head is [head_dim, state_size]
    num_groups: int  # B and C are shared by num_heads // num_groups heads
    conv_kernel: int  # the conv state keeps the last conv_kernel - 1 inputs

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"mamba {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"mamba_n_heads {self.num_heads} must be a multiple of mamba_n_groups "
                f"{self.num_groups}"
            )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_state_elems(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def ssm_state_elems(self) -> int:
        return self.num_heads * self.head_dim * self.state_size

    @property
    def state_elems(self) -> int:
        """Elements of one request's state in one layer (conv + SSM)."""
        return self.conv_state_elems + self.ssm_state_elems


@dataclass(frozen=True)
class ModelConfig:
    """What the KV cache and the model need to know about an architecture."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]  # one of LAYER_KINDS per layer
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    dtype: str = "float32"
    source: str = ""  # where the configuration came from (folder, file or preset name)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    mamba: MambaShape | None = None  # the Mamba2 mixers' geometry (hybrid models)
    parallel_mamba: bool = False  # every layer also runs a Mamba2 mixer beside its attention

    def cache_layers(self) -> tuple[tuple[int, str], ...]:
        """(layer index, kind) of every sublayer that keeps a cache: each layer's attention or
        mixer, plus the parallel Mamba2 mixer of every layer when `parallel_mamba` (Falcon-H1)."""
        kinds = tuple(enumerate(self.layer_kinds))
        if self.parallel_mamba:
            kinds += tuple((i, "mamba") for i in range(self.num_layers))
        return kinds

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(
                f"{self.source}: {len(self.layer_kinds)} layer types for {self.num_layers} layers"
            )
        bad = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"{self.source}: unknown layer types {bad}; known: {LAYER_KINDS}")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ValueError(f"{self.source}: sliding-window layers but no `sliding_window` size")
        if "chunked" in self.layer_kinds and not self.attention_chunk_size:
            raise ValueError(f"{self.source}: chunked layers but no `attention_chunk_size`")
        if self.dtype not in KV_DTYPES:
            raise ValueError(
                f"{self.source}: dtype {self.dtype!r} unsupported; use {list(KV_DTYPES)}"
            )
        if ("mamba" in self.layer_kinds or self.parallel_mamba) and self.mamba is None:
            raise ValueError(f"{self.source}: mamba layers but no mamba_* sizes in config.json")


@dataclass(frozen=True)
class CacheConfig:
    """Device KV cache: block geometry and budget (blocks or bytes), caching and protections."""

    block_size: int = setting(16, "tokens per KV block")
    # or kv_cache_memory_bytes, never both
    num_device_blocks: int | None = setting(
        None,
        "device KV blocks (instead of --kv-cache-memory-bytes)",
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "device KV budget in bytes; suffixes KiB/MiB/GiB accepted",
    )
    kv_cache_dtype: str | None = setting(
        None,
        "dtype the KV pool stores: auto (the model's, default), fp8 (= fp8_e4m3) or fp8_e5m2"
        " (8-bit, half of bfloat16's bytes in every tier), float32, bfloat16, float16 or float64",
    )
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prefixes")
    prefix_caching_hash_algo: str = setting("sha256", "block hash: sha256 or xxhash")
    kv_offloading_size: float | None = setting(
        None,
        "host-memory KV tier size in GiB (needs prefix caching)",
    )
    num_host_blocks: int | None = setting(
        None,
        "host-memory KV tier size in blocks (instead of --kv-offloading-size; needs prefix "
        "caching)",
    )
    kv_offload_store_mode: str = setting(
        "eager",
        "when the host tier stores device blocks: eager (a request's full blocks once "
        "settled) or lazy (cached blocks as they near the device LRU head; vLLM's "
        "lazy_offload)",
    )
    admission: str = setting(
        "shared",
        "what admission charges window groups for tokens in flight: shared (steady window per"
        " request + one pool-wide reserve), per-request (W-1+in-flight tokens each, vLLM "
        "after its settled-basis fix) or optimistic (W-1+one step each, vLLM before it)",
    )
    # Tiers below the host (architecture.md §Chain): a folder of block files, a Redis URL (and
    # the expiry of its keys), and the longest a lookup may wait for them in total.
    kv_disk_path: str | None = setting(
        None,
        "folder of the disk KV tier below the host tier (one per process; survives restarts);"
        " needs a host tier",
    )
    kv_disk_size: float | None = setting(
        None,
        f"disk KV tier size in GiB (default {DEFAULT_DISK_GIB:g})",
    )
    kv_remote_url: str | None = setting(
        None,
        "remote KV tier on Redis or Valkey shared by replicas, redis://host:port/db; needs a "
        "host tier and sha256 block hashes",
    )
    kv_remote_ttl_s: float | None = setting(
        None,
        "expiry of each remote KV block in seconds (default: none); needed for Redis to evict"
        " under a volatile-* maxmemory policy",
    )
    kv_tier_timeout_s: float = setting(
        0.5,
        "longest a lookup waits for the disk and remote tiers in total, however many blocks "
        "it asks for; past it the request recomputes what did not arrive",
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        for blocks, size in (
            ("num_device_blocks", "kv_cache_memory_bytes"),
            ("num_host_blocks", "kv_offloading_size"),
        ):
            if getattr(self, blocks) is not None and getattr(self, size) is not None:
                raise ValueError(
                    f"{flag(blocks)} and {flag(size)} both size one KV tier and only one could "
                    "take effect; give one of them"
                )
        self._check_lower_tiers()
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.num_device_blocks is not None and self.num_device_blocks < 2:
            raise ValueError(f"--num-device-blocks must be ≥ 2, got {self.num_device_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("--kv-cache-memory-bytes must be positive")
        self._check_kv_cache_dtype()
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError("--kv-offloading-size must be a positive number of GiB")
        if self.num_host_blocks is not None and self.num_host_blocks < 2:
            raise ValueError(f"--num-host-blocks must be ≥ 2, got {self.num_host_blocks}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"--prefix-caching-hash-algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.kv_offload_store_mode not in STORE_MODES:
            raise ValueError(
                f"--kv-offload-store-mode must be eager or lazy, got {self.kv_offload_store_mode!r}"
            )
        host = self.num_host_blocks is not None or self.kv_offloading_size is not None
        if host and not self.enable_prefix_caching:
            raise ValueError(
                "a host KV tier (--num-host-blocks / --kv-offloading-size) holds prefix-cached "
                "blocks, so with --no-enable-prefix-caching it would store nothing; enable prefix "
                "caching or drop the host tier"
            )
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"--admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}"
            )

    def _check_kv_cache_dtype(self) -> None:
        value = self.kv_cache_dtype
        if value is None or value in KV_CACHE_DTYPES:
            return
        why = "is not a dtype the KV pool stores"
        if value.startswith("int8") or value.startswith("fp8"):
            why = "is not an 8-bit KV cache kvtier has (the 8-bit ones are fp8 formats)"
        raise ValueError(
            f"--kv-cache-dtype {value} {why}; use auto (the model's dtype, the default), "
            f"{', '.join(FP8_KV_DTYPES)} (8-bit: fp8 is fp8_e4m3) or one of {', '.join(KV_DTYPES)}"
        )

    def kv_dtype(self, model_dtype: str) -> str:
        """The dtype the KV pool holds for a model run in `model_dtype` (auto: that one)."""
        value = self.kv_cache_dtype
        if value in (None, "auto"):
            return model_dtype
        return FP8_KV_DTYPES.get(value, value)

    @property
    def has_host_tier(self) -> bool:
        return self.num_host_blocks is not None or self.kv_offloading_size is not None

    @property
    def has_lower_tiers(self) -> bool:
        """A disk or remote tier is configured (it stages its blocks through the host tier)."""
        return self.kv_disk_path is not None or self.kv_remote_url is not None

    def _check_lower_tiers(self) -> None:
        if self.kv_disk_path is not None and not self.kv_disk_path.strip():
            raise ValueError("--kv-disk-path must name a folder, got an empty string")
        if self.kv_disk_size is not None:
            if self.kv_disk_path is None:
                raise ValueError("--kv-disk-size needs --kv-disk-path (the folder it limits)")
            if not self.kv_disk_size > 0:
                raise ValueError(
                    f"--kv-disk-size must be a positive number of GiB, got {self.kv_disk_size}"
                )
        url = self.kv_remote_url
        if url is not None and url.partition("://")[0] not in REMOTE_SCHEMES:
            raise ValueError(
                f"--kv-remote-url {url!r} must start with redis://, rediss://, unix://, valkey:// "
                "or valkeys://, e.g. redis://127.0.0.1:6379/0"
            )
        if self.kv_remote_ttl_s is not None:
            if url is None:
                raise ValueError("--kv-remote-ttl-s needs --kv-remote-url (the keys it expires)")
            if not self.kv_remote_ttl_s > 0:
                raise ValueError(
                    f"--kv-remote-ttl-s must be positive seconds, got {self.kv_remote_ttl_s}"
                )
        if not self.kv_tier_timeout_s > 0:
            raise ValueError(
                f"--kv-tier-timeout-s must be positive seconds, got {self.kv_tier_timeout_s}"
            )
        if not self.has_lower_tiers:
            return
        what = "--kv-disk-path" if self.kv_disk_path is not None else "--kv-remote-url"
        if not self.has_host_tier:
            raise ValueError(
                f"{what} needs a host KV tier to stage blocks through (disk and remote blocks are "
                "read into host blocks, then loaded like host hits); add --num-host-blocks N or "
                "--kv-offloading-size GiB"
            )
        if self.kv_offload_store_mode != "eager":
            raise ValueError(
                f"{what} demotes the blocks the eager host store writes; --kv-offload-store-mode "
                "lazy stores no request's chain, so use eager (the default) with disk or remote "
                "tiers"
            )
        if url is not None and self.prefix_caching_hash_algo != "sha256":
            raise ValueError(
                "--kv-remote-url shares blocks by their chained hash with every replica on that "
                "server, so the hash must resist collisions: use --prefix-caching-hash-algo "
                "sha256 (the default), not xxhash"
            )

    @property
    def disk_size_bytes(self) -> int:
        """The disk tier's byte limit (--kv-disk-size, default DEFAULT_DISK_GIB)."""
        gib = DEFAULT_DISK_GIB if self.kv_disk_size is None else self.kv_disk_size
        return max(1, int(gib * (1 << 30)))


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits and how far the host may run ahead of the device."""

    max_num_seqs: int = setting(256, "most requests running at once")
    max_num_batched_tokens: int = setting(2048, "token budget of one step")
    max_model_len: int | None = setting(
        None,
        "longest prompt + output (default: the model's max positions)",
    )
    async_scheduling: bool = setting(True, "schedule the next step while the device runs this one")
    async_depth: int | None = setting(
        None,
        "unprocessed steps allowed at once with async scheduling (1-3, default 2)",
    )
    scheduler_reserve_full_isl: bool = setting(
        True,
        "admit a request only when the blocks of its whole prompt fit (not only its first chunk)",
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("--max-num-batched-tokens must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        depth = self.async_depth
        if depth is not None and not 1 <= depth <= MAX_ASYNC_DEPTH:
            raise ValueError(f"--async-depth must be 1, 2 or 3, got {depth}")
        if depth not in (None, 1) and not self.async_scheduling:
            raise ValueError(
                f"--async-depth {depth} needs async scheduling: with --no-async-scheduling "
                "each step is processed before the next is scheduled (depth 1); drop one of them"
            )

    @property
    def depth(self) -> int:
        """Steps that may be unprocessed at once (1 = synchronous)."""
        if not self.async_scheduling:
            return 1
        return DEFAULT_ASYNC_DEPTH if self.async_depth is None else self.async_depth

    @property
    def max_in_flight_tokens(self) -> int:
        """Upper bound of tokens scheduled but not settled across all requests."""
        return self.depth * self.max_num_batched_tokens


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Bounds on the grammars requests may constrain their outputs to (model/grammar.py)."""

    structured_outputs_max_spec_bytes: int = setting(
        64 << 10,
        "largest JSON schema, regex, choice list or grammar a request may send (bytes); larger "
        "ones get HTTP 400",
    )
    structured_outputs_compile_timeout_s: float = setting(
        10.0,
        "a request's grammar that takes longer to compile gets HTTP 400 (and is remembered as "
        "too slow)",
    )
    structured_outputs_cache_size: int = setting(
        256, "compiled grammars kept, least recently used evicted"
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.structured_outputs_max_spec_bytes < 1:
            raise ValueError("--structured-outputs-max-spec-bytes must be ≥ 1")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise ValueError(
                "--structured-outputs-compile-timeout-s must be positive seconds, got "
                f"{self.structured_outputs_compile_timeout_s}"
            )
        if self.structured_outputs_cache_size < 1:
            raise ValueError("--structured-outputs-cache-size must be ≥ 1")
