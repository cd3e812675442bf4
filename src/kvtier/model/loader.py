"""Load a local HuggingFace model folder: config.json + *.safetensors (single or sharded) into a
`CausalLM`, fusing q/k/v and gate/up, tying embeddings; `generation_config.json` defaults; the
dtype a model runs in. Every bad input is a ValueError that names it and the fix."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvtier.model import native as native_kernels
from kvtier.model.arch import arch_spec
from kvtier.model.generation import GenerationDefaults, load_generation_defaults
from kvtier.model.hf_config import load_model_config
from kvtier.model.kv_scales import apply_kv_scales, check_kv_cache_scheme, take_kv_scales
from kvtier.model.quant import (
    QUANTIZATIONS,
    Int8Linear,
    int8_activations,
    int8_config,
    int8_tensors,
    quantize_int8,
)
from kvtier.model.tokenizer import Tokenizer, load_tokenizer
from kvtier.model.transformer import CausalLM

log = logging.getLogger("kvtier.model")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
DTYPES["float16"] = torch.float16  # on the cuda backend only (resolve_dtype)
HF_FILES = "config.json, *.safetensors and tokenizer.json"
GGUF_MAGIC = b"GGUF"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# torch.nn.init's fills that torch's own layers call when they are built
_INIT_FILLS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
               "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_")  # fmt: skip


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules on the meta device without filling their weights (a checkpoint assigns
    every one): a random fill of a meta tensor runs a Python decomposition whose first call
    imports torch._dynamo, a large part of every process's start. Replaces torch.nn.init's fills
    while it is open (as transformers' `no_init_weights` does): build models on one thread."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FILLS}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    try:
        for name in saved:
            setattr(nn.init, name, keep)
        with torch.device("meta"):
            yield
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)


def is_gguf(path: Path) -> bool:
    """True for a GGUF file (llama.cpp's format), told by its magic whatever its name."""
    with contextlib.suppress(OSError), path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC
    return False


def gguf_hint(path: Path) -> str:
    return (
        f"{path} is a GGUF file (llama.cpp's format), which kvtier does not load; pass the "
        f"folder of the original HF checkpoint it was converted from ({HF_FILES}), e.g. "
        "`hf download <repo> --local-dir <folder>`"
    )


def model_folder(path: str | Path) -> Path:
    """`path` as a HF model folder; a ValueError naming it and what to pass instead when it is a
    GGUF file, another file, or a folder without config.json."""
    folder = Path(path)
    if folder.is_file():
        if is_gguf(folder):
            raise ValueError(gguf_hint(folder))
        raise ValueError(
            f"model {str(path)!r} is a file; pass its folder ({folder.parent}), which must hold "
            f"{HF_FILES}"
        )
    if not folder.is_dir():
        raise ValueError(
            f"model {str(path)!r}: not a local folder; pass a HF model folder holding {HF_FILES} "
            "(download it first, e.g. `hf download <repo> --local-dir <folder>`)"
        )
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if ggufs:
            raise ValueError(
                f"{folder}: no config.json, only {ggufs}: " + gguf_hint(folder / ggufs[0])
            )
        raise ValueError(
            f"{folder}: config.json is missing; a HF model folder needs {HF_FILES} (save it "
            "with `model.save_pretrained(folder)`, or download the whole repo)"
        )
    return folder


@dataclass(frozen=True)
class Pretrained:
    """What a model folder provides: the model, its tokenizer (None without tokenizer.json) and
    generation defaults."""

    model: CausalLM
    tokenizer: Tokenizer | None
    generation: GenerationDefaults


def load_pretrained(path: str | Path, dtype: str | torch.dtype | None = None) -> Pretrained:
    """Model, tokenizer and generation defaults of a HF folder in one call."""
    model = load_model(path, dtype)
    folder = Path(path)
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    return Pretrained(model, tokenizer, load_generation_defaults(folder))


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    *,
    native: bool = True,
    quantization: str | None = None,
) -> CausalLM:
    """Build the model of the folder's config.json and load its safetensors weights
    (`native=False`: torch ops only, no kernels of model/native.py). `quantization` as
    `resolve_quantization`: int8 linears where the checkpoint has them, or made at load."""
    folder = model_folder(path)
    config = load_model_config(folder)
    spec = arch_spec(config)
    torch_dtype = resolve_dtype(dtype, folder, checkpoint=config.dtype)
    method = resolve_quantization(quantization, folder)
    with empty_weights():
        model = CausalLM(config, spec, native=native)
    if native:
        log.info("%s", native_kernels.describe(native_kernels.kernels()))
    raw = read_safetensors(folder)
    check_kv_cache_scheme(config.hf_config, folder)
    kv_scales = take_kv_scales(raw, config.num_layers, folder)
    int8 = _fused_int8(int8_tensors(raw, folder), config.num_layers, folder)
    qc = int8_config(config.hf_config, folder)
    w8a8 = set(int8) if qc is not None and int8_activations(qc) else set()  # as checkpointed
    state = _fused_state(raw, config.num_layers, torch_dtype, folder)
    if method in ("int8", "w8a8"):  # every linear the checkpoint holds in float, quantized
        for name in [*_decoder_linears(config.num_layers), "lm_head"]:
            if name not in int8:  # a tied head gets its own int8 copy; lookups keep the table
                w = state.pop(f"{name}.weight", None)
                int8[name] = quantize_int8(state[_EMBED] if w is None else w)
    if method == "w8a8":  # the decoder's linears; the head's logits keep bfloat16 inputs
        w8a8 |= set(_decoder_linears(config.num_layers)) & set(int8)
    for name, (q, scale) in int8.items():
        _make_int8(model, name, int8_activations=name in w8a8)
        state[f"{name}.weight"], state[f"{name}.weight_scale"] = q, scale
    if int8 and native and torch_dtype == torch.bfloat16:  # float32 inputs take torch ops anyway
        _say_where_int8_runs(folder, w8a16=bool(set(int8) - w8a8), w8a8=bool(w8a8))
    tied = spec.tie_word_embeddings and "lm_head" not in int8
    expected = set(model.state_dict())
    if tied:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match {config.architecture}: missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}; check `architectures` and `tie_word_embeddings` in "
            "config.json"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    apply_kv_scales(model.model.layers, kv_scales, folder)  # an fp8 cache's; a float one ignores
    return model.eval().requires_grad_(False)


def resolve_quantization(quantization: str | None, folder: Path) -> str | None:
    """What `--quantization` means for a folder: None follows its config.json (int8 weights where
    it has a compressed-tensors `quantization_config`); "compressed-tensors" requires one;
    "int8" takes a checkpoint's int8 weights as they are and quantizes every other linear as it
    loads (symmetric, per output channel), the LM head included: decode reads it every step;
    "w8a8" does the same and runs every decoder linear on int8 activations, quantized a row at a
    time as they arrive (the LM head's stay bfloat16: its logits are what is sampled)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization (--quantization) {quantization!r} is not supported; use one of "
            f"{list(QUANTIZATIONS)}, or leave it unset to follow the checkpoint's config.json"
        )
    config = json.loads((folder / "config.json").read_text())
    found = "compressed-tensors" if int8_config(config, folder) is not None else None
    kv_only = (config.get("quantization_config") or {}).get("kv_cache_scheme") is not None
    if quantization == "compressed-tensors" and found is None and kv_only:
        return None  # its KV scales load whatever --quantization says; no weight is int8
    if quantization == "compressed-tensors" and found is None:
        raise ValueError(
            f"--quantization compressed-tensors: {folder}/config.json has no compressed-tensors "
            "quantization_config; pass an int8 compressed-tensors checkpoint, or --quantization "
            "int8 to quantize this one as it loads"
        )
    return quantization or found


def resolve_dtype(
    dtype: str | torch.dtype | None,
    source: Path | str = "",
    *,
    checkpoint: str | None = None,
    device: str = "cpu",
) -> torch.dtype:
    """The dtype a model runs in. `None` or "auto" is the checkpoint's, except that a float16
    checkpoint runs as bfloat16 off cuda (logged), as vLLM's CPU build does: the CPU kernels take
    float32 and bfloat16 only. A name is checked against `device` (float16 on cuda only); a
    torch dtype is taken as already resolved for its device."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        dtype = str(dtype).removeprefix("torch.")
    if dtype in (None, "auto"):
        if checkpoint is None:
            raise ValueError(f"{source}: dtype auto needs the checkpoint's dtype")
        if checkpoint == "float16" and device != "cuda":
            log.warning(
                "%s: a float16 checkpoint, run as bfloat16 on the %s backend (--dtype auto; "
                "float16 runs on cuda only)",
                source,
                device,
            )
            return torch.bfloat16
        dtype = checkpoint
    if dtype not in DTYPES:
        raise ValueError(
            f"{source}: dtype {dtype!r} unsupported; use --dtype auto or one of {list(DTYPES)}"
        )
    if dtype == "float16" and device != "cuda":
        raise ValueError(
            f"{source}: --dtype float16 runs on --device cuda only; on the {device} backend pass "
            "--dtype bfloat16, or auto (a float16 checkpoint then runs as bfloat16)"
        )
    return DTYPES[dtype]


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (folder / f).is_file()]
        if absent:
            raise ValueError(
                f"{folder}: shards {absent} named in model.safetensors.index.json are missing; "
                "download every shard"
            )
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        hint = " (only PyTorch .bin weights found: re-save with `safe_serialization=True`)"
        has_bin = any(folder.glob("*.bin"))
        raise ValueError(f"{folder}: no *.safetensors weights{hint if has_bin else ''}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = f.get_tensor(key)
    return tensors


def _fused_state(
    raw: dict[str, torch.Tensor], num_layers: int, dtype: torch.dtype, folder: Path
) -> dict[str, torch.Tensor]:
    """HF names → ours: q/k/v concatenated into qkv_proj, gate/up into gate_up_proj."""
    state = {k: v for k, v in raw.items() if not k.endswith(_IGNORED_SUFFIXES)}
    for i in range(num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            _fuse(state, [f"{attn}{p}_proj.{kind}" for p in "qkv"], f"{attn}qkv_proj.{kind}")
            _fuse(
                state,
                [f"{mlp}{p}_proj.{kind}" for p in ("gate", "up")],
                f"{mlp}gate_up_proj.{kind}",
            )
    return {k: v.to(dtype) for k, v in state.items()}


_EMBED = "model.embed_tokens.weight"
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _decoder_linears(num_layers: int) -> list[str]:
    """Our names of every decoder layer's linears (the fused ones)."""
    kinds = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    return [f"model.layers.{i}.{kind}" for i in range(num_layers) for kind in kinds]


def _fused_int8(
    int8: dict[str, tuple[torch.Tensor, torch.Tensor]], num_layers: int, folder: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module names of int8 linears → ours, q/k/v and gate/up concatenated (weights and their
    per-channel scales alike); a fused group must be int8 whole."""
    for i in range(num_layers):
        for prefix in (f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."):
            for fused, parts in _FUSED.items():
                names = [prefix + p for p in parts]
                have = [n in int8 for n in names]
                if any(have) and not all(have):
                    raise ValueError(
                        f"{folder}: {names} must all be int8 or none (they run as one linear); "
                        f"int8: {[n for n, h in zip(names, have, strict=True) if h]}"
                    )
                if all(have):
                    qs, scales = zip(*(int8.pop(n) for n in names), strict=True)
                    int8[prefix + fused] = (torch.cat(qs), torch.cat(scales))
    return int8


def _say_where_int8_runs(folder: Path, *, w8a16: bool, w8a8: bool) -> None:
    """A warning for each int8 scheme of the model whose kernel is not built here (both need
    AVX2 or AVX512-VNNI, and a C compiler): W8A16 linears then dequantize their weights on every
    call, W8A8 ones run in torch ops (`quant.w8a8_reference`); right, but many times slower than
    bfloat16's."""
    kernels = native_kernels.kernels()
    cases = (
        (w8a16, "int8", kernels and kernels.i8_linear, "dequantize their weights on every call"),
        (w8a8, "W8A8", kernels and kernels.w8a8_linear, "run in torch ops"),
    )
    for used, name, built, fallback in cases:
        if used and built is None:
            log.warning(
                "%s: the %s linear kernel is not built here (it needs AVX2 or AVX512-VNNI and a "
                "C compiler): its linears %s, many times slower than bfloat16; load a bfloat16 "
                "checkpoint instead",
                folder,
                name,
                fallback,
            )


def _make_int8(model: nn.Module, name: str, int8_activations: bool) -> None:
    """Replace the linear `name` of `model` by an `Int8Linear` of its shape (W8A8 with
    `int8_activations`)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child, None)
    if not isinstance(old, nn.Linear):
        raise ValueError(f"{name} has int8 weights in the checkpoint but is not a linear here")
    with torch.device("meta"):
        new = Int8Linear(old.in_features, old.out_features, old.bias is not None, int8_activations)
    setattr(parent, child, new)


def _fuse(state: dict[str, torch.Tensor], names: list[str], fused: str) -> None:
    if any(n in state for n in names) and all(n in state for n in names):
        state[fused] = torch.cat([state.pop(n) for n in names], dim=0)
