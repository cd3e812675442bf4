"""An 8-bit KV cache's scales from a checkpoint (docs/kernels.md, "8-bit KV"): the `kv_cache_scheme`
of a compressed-tensors config, checked against the one kvtier serves (static, symmetric, one fp8
scale per layer for K and one for V), and the per-layer k/v scale tensors under the names
llm-compressor and ModelOpt write, taken out of a checkpoint's tensors. It owns no model: the
loaders hand the scales to the attention layers, which apply them to an fp8 cache only."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

log = logging.getLogger("kvtier.model")

# "model.layers.{i}.self_attn.{suffix}" → the scale it holds: K's, V's or one for both
_SCALE_SUFFIXES = {
    "k_scale": "k",  # compressed-tensors (llm-compressor's kv_cache_scheme)
    "v_scale": "v",
    "k_proj.k_scale": "k",  # ModelOpt
    "v_proj.v_scale": "v",
    "k_proj.output_scale": "k",  # older llm-compressor: the k/v projections' output scales
    "v_proj.output_scale": "v",
    "kv_scale": "kv",  # the deprecated single scale of both
}
# fp8 attention's query and probability scales: kvtier quantizes neither, so they are dropped
_QUERY_SUFFIXES = ("q_scale", "prob_scale", "q_proj.output_scale", "prob_output_scale")
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")
# what a kv_cache_scheme must say for kvtier to serve it (absent keys take these defaults)
SERVED_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True}

KVScales = dict[int, tuple[float, float]]  # layer index → (k_scale, v_scale)


def check_kv_cache_scheme(hf_config: Mapping[str, Any], source: object) -> None:
    """Refuse a config.json whose compressed-tensors `kv_cache_scheme` kvtier cannot serve:
    anything but static, symmetric fp8 with one scale per tensor (vLLM's CPU and GPU default)."""
    qc = hf_config.get("quantization_config") or {}
    scheme = qc.get("kv_cache_scheme") if isinstance(qc, Mapping) else None
    if scheme is None:
        return
    if not isinstance(scheme, Mapping):
        raise ValueError(f"{source}: quantization_config.kv_cache_scheme must be an object")
    got = {key: scheme.get(key, want) for key, want in SERVED_SCHEME.items()}
    if got != SERVED_SCHEME or scheme.get("dynamic"):
        raise ValueError(
            f"{source}: quantization_config.kv_cache_scheme {dict(scheme)} is not served: kvtier's"
            f" 8-bit KV takes static, symmetric fp8 scales, one per layer for K and one for V "
            f"({SERVED_SCHEME}, dynamic false); use a checkpoint calibrated with that scheme, or "
            "drop kv_cache_scheme from config.json to run fp8 KV with scales 1.0"
        )


def take_kv_scales(raw: dict[str, torch.Tensor], num_layers: int, source: object) -> KVScales:
    """Take every KV scale tensor out of a checkpoint's tensors `raw` (in place) → layer index →
    (k_scale, v_scale); layers without scales are absent. Query/probability scales are dropped.
    A ValueError names the tensor when a scale is not one positive finite number, when a layer
    has a K scale but no V scale (or the reverse), or when its layer does not exist."""
    found: dict[int, dict[str, float]] = {}
    dropped: list[str] = []
    for key in [k for k in raw if _NAME.match(k)]:
        m = _NAME.match(key)
        assert m is not None
        layer, suffix = int(m.group(1)), m.group(2)
        if suffix in _QUERY_SUFFIXES:
            del raw[key]
            dropped.append(key)
            continue
        which = _SCALE_SUFFIXES.get(suffix)
        if which is None:
            continue
        if layer >= num_layers:
            raise ValueError(f"{source}: {key} names layer {layer} of a {num_layers}-layer model")
        found.setdefault(layer, {})[which] = _scalar(raw.pop(key), key, source)
    if dropped:
        log.info("%s: %d query/probability scales ignored (queries are not quantized here), "
                 "e.g. %s", source, len(dropped), dropped[0])  # fmt: skip
    scales: KVScales = {}
    for layer, got in sorted(found.items()):
        k, v = got.get("k"), got.get("v")
        if (k is None) != (v is None):
            half = "k_scale" if k is not None else "v_scale"
            raise ValueError(
                f"{source}: layer {layer} has a {half} but not the other one; an fp8 cache needs "
                "both (or one legacy kv_scale for both)"
            )
        if k is None or v is None:  # only the legacy single scale
            k = v = got["kv"]
        scales[layer] = (k, v)
    return scales


def _scalar(t: torch.Tensor, key: str, source: object) -> float:
    if t.numel() != 1:
        raise ValueError(
            f"{source}: {key} has {t.numel()} values {tuple(t.shape)}; kvtier's fp8 KV takes one "
            "scale per layer for K and one for V (kv_cache_scheme strategy 'tensor'), not "
            "per-head or per-channel scales"
        )
    value = float(t.reshape(()).to(torch.float64))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: {key} is {value}; a KV scale must be positive and finite")
    return value


def apply_kv_scales(layers: nn.ModuleList, scales: KVScales, source: object) -> None:
    """Give each decoder layer's attention its (k_scale, v_scale) (mutates the layers); a
    ValueError when a scaled layer has no attention (a hybrid's Mamba layer)."""
    for i, (k_scale, v_scale) in scales.items():
        attn = getattr(layers[i], "self_attn", None)
        if attn is None:
            raise ValueError(f"{source}: KV scales for layer {i}, which has no attention")
        attn.k_scale, attn.v_scale = k_scale, v_scale
