"""The decoder layers of a bfloat16 step in one native call (`kernels/csrc/layer.c`).

A layer's Python path makes ~11 kernel calls (norms, the tile linears, rope, the KV write, the
paged attention kernel), each with its own ctypes call, output allocation and Python; on a small
model that is most of a step's time, and every call releases and retakes the GIL. Where the
whole batch is served by those kernels — bfloat16 on a CPU with the tile linear (AMX,
AVX512-BF16 or AVX2), every linear taking the tiles at this row count (`takes_tiles`), every query on
the attention kernel (decodes, drafts, and a prompt's chunks, which `CausalLM.forward` plans for
the kernel when `takes` says the step fits; no gathered sequence) — `FusedLayers` runs every
layer in one call that makes the same kernel calls in C, on the same inputs: the same bits as
the Python path on the same plans (tests/model/test_fused_layer.py). Other batches take the
Python path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.kernels import abi
from kvtier.model import native
from kvtier.model.layers import Linear, RMSNorm, takes_tiles
from kvtier.model.paged import GroupPlan
from kvtier.model.quant import Int8Linear

# transformer.DecoderLayer, which this module cannot import (transformer.py imports it)
DecoderLayer = Any


class _Built:
    """One layer's `Layer` struct, what it points into, and the weights it was built from."""

    def __init__(self, layer: DecoderLayer, kernels: native.Kernels) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.tensors: list[torch.Tensor] = list(layer.parameters())  # the struct points here
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # the bfloat16 linears' sizes (`takes_tiles`); the int8 kernel serves any row count
        self.numels = [lin.weight.numel() for lin in linears if not isinstance(lin, Int8Linear)]
        tiles, scales = [], []
        for lin in linears:
            packed, scale = lin.tiles(kernels) if isinstance(lin, Int8Linear) else (
                lin.tiles(kernels), None)  # fmt: skip
            tiles.append(packed)
            scales.append(scale)
            self.tensors += [packed] if scale is None else [packed, scale]
        s = abi.Layer()
        s.input_norm = layer.input_layernorm.weight.data_ptr()
        s.post_attn_norm = layer.post_attention_layernorm.weight.data_ptr()
        if layer.sandwich:
            s.pre_ff_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
            s.post_ff_norm = layer.post_feedforward_layernorm.weight.data_ptr()
        if attn.q_norm is not None and attn.k_norm is not None:
            s.q_norm, s.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            s.qk_gemma = int(attn.q_norm.gemma)
        names = ("qkv", "o", "gate_up", "down")
        for name, lin, packed, scale in zip(names, linears, tiles, scales, strict=True):
            setattr(s, name, packed.data_ptr())
            if scale is not None:
                setattr(s, f"{name}_scale", scale.data_ptr())
            if lin.bias is not None:
                setattr(s, f"{name}_bias", lin.bias.data_ptr())
        s.hidden, s.heads, s.kv_heads = attn.o_proj.out_features, attn.num_heads, attn.num_kv_heads
        s.head_dim, s.inter = attn.head_dim, mlp.down_proj.in_features
        s.eps, s.scale, s.softcap = layer.input_layernorm.eps, attn.scale, attn.softcap or 0.0
        s.gemma, s.act = int(layer.input_layernorm.gemma), native.ACTIVATIONS[mlp.activation]
        s.w8a8 = int(any(isinstance(lin, Int8Linear) and lin.int8_activations for lin in linears))
        self.kv_scales = (attn.k_scale, attn.v_scale)  # an fp8 cache's (`run` sets them)
        self.struct = s
        self.address = ctypes.addressof(s)
        self.work = int(kernels.lib.kvtier_layer_work(self.address))  # bytes per token
        self.hidden = s.hidden


_registrations = 0  # parameters assigned to any module (`register_parameter`) since import


def _registered(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    global _registrations
    _registrations += 1


# torch's public global hook: a weight assigned anew (loading with `assign`, `module.weight =
# Parameter(...)`) makes `FusedLayers` collect the layers' parameters again
torch.nn.modules.module.register_module_parameter_registration_hook(_registered)


def servable(layer: DecoderLayer, kernels: native.Kernels) -> bool:
    """Whether `layer.c` can run this layer at all (any batch): bfloat16 weights on the CPU where
    the bfloat16 tile linear is built (int8 ones with their scales and bfloat16 biases where the
    int8 linear is; a layer of int8 linears only needs no tile linear), every norm, the rope and
    the MLP's activation on the native kernels, no float32 leftovers."""
    attn, mlp = layer.self_attn, layer.mlp
    norms: list[RMSNorm | None] = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if attn.q_norm is not None or attn.k_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if not all(n is not None and n.native for n in norms) or not (attn.native and mlp.native):
        return False
    if attn.head_dim > native.MAX_HEAD_DIM or mlp.activation not in native.ACTIVATIONS:
        return False
    int8 = [m for m in layer.modules() if isinstance(m, Int8Linear)]
    if len({m.int8_activations for m in int8}) > 1:  # the struct says one for the layer
        return False
    if not all(m.kernel_serves(kernels) for m in int8):
        return False
    if kernels.tile_linear is None and any(isinstance(m, Linear) for m in layer.modules()):
        return False
    scaled = {id(p) for m in int8 for p in (m.weight, m.weight_scale)}
    return all(
        (id(p) in scaled or p.dtype == torch.bfloat16)
        and p.device == native.CPU
        and p.is_contiguous()
        for p in layer.parameters()
    )


class FusedLayers:
    """The layers of one model as native calls; `run` declines (None) batches it does not serve.
    Structs are built on first use and rebuilt when a weight tensor is another one."""

    def __init__(self) -> None:
        self._built: list[_Built] | None = None  # None: not servable
        self._of: tuple[int, ...] | None = None  # the weights `_built` was decided for
        self._params: list[torch.nn.Parameter | None] = []  # every layer parameter, in order
        self._seen = -1  # `_registrations` when `_params` was collected
        self._spare: torch.Tensor | None = None  # the layers' work buffer between steps

    def takes(self, layers: Sequence[DecoderLayer], rows: int) -> bool:
        """Whether a batch of `rows` rows can run fused: every layer servable here and every
        linear taking the tiles at this row count (the caller then plans a prompt's chunks for
        the attention kernel, which the one-call layer needs)."""
        kernels = native.kernels()
        if kernels is None:
            return False
        return _fits(self._layers(layers, kernels), rows, kernels.tile_linear)

    def run(
        self,
        layers: Sequence[DecoderLayer],
        x: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        layer_rope: list[int],
        kv_caches: list[torch.Tensor],
        plans: list[GroupPlan],
        layer_group: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer for input x [rows, hidden], or None where some
        layer or query is not served (the caller runs the Python path)."""
        kernels = native.kernels()
        if kernels is None:
            return None
        if x.dtype != torch.bfloat16:
            return None
        if any(p.native is None or p.gathers or p.owns for p in plans):
            return None
        built = self._layers(layers, kernels)
        if built is None:
            return None
        rows = x.shape[0]
        kv_dtype = native.KV_DTYPES.get(kv_caches[0].dtype, -1)
        if not _fits(built, rows, kernels.tile_linear) or not all(
            c.dtype == kv_caches[0].dtype and c.is_contiguous() for c in kv_caches
        ):
            return None
        if kv_dtype < 1:  # the layer kernel's caches: bfloat16 or fp8 codes (8-bit KV)
            return None
        for b in built:  # as paged_attention: scales apply to an fp8 cache only
            b.struct.kv_dtype = kv_dtype
            b.struct.k_scale, b.struct.v_scale = b.kv_scales if kv_dtype > 1 else (1.0, 1.0)
        steps = [_step(p) for p in plans]
        step_addresses = [ctypes.addressof(s) for s in steps]
        hidden = built[0].hidden
        # the layers' scratch, kept between steps: a prompt step's is large, and a new one each
        # step is a new mapping whose every page the kernel faults in and zeroes. Taken out while
        # in use, so a concurrent call (another thread) allocates its own.
        work, self._spare = self._spare, None
        elements = rows * max(b.work for b in built) // 2
        if work is None or work.numel() < elements:
            work = torch.empty(elements, dtype=torch.bfloat16)
        outs = torch.empty(2, rows, hidden, dtype=torch.bfloat16)
        n = len(built)
        pointers = ctypes.c_void_p * n
        tables = [(cos.data_ptr(), sin.data_ptr()) for cos, sin in ropes]
        status = kernels.lib.kvtier_layers(  # every layer in one call, x the first residual
            n, pointers(*(b.address for b in built)),
            pointers(*(step_addresses[layer_group[i]] for i in range(n))),
            pointers(*(tables[layer_rope[i]][0] for i in range(n))),
            pointers(*(tables[layer_rope[i]][1] for i in range(n))),
            pointers(*(kv_caches[i].data_ptr() for i in range(n))), x.data_ptr(), x.data_ptr(),
            outs[0].data_ptr(), outs[1].data_ptr(), work.data_ptr(), rows, native.threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("kvtier_layers: a kernel found no scratch memory")
        self._spare = work
        return outs[(n - 1) % 2], x

    def _layers(
        self, layers: Sequence[DecoderLayer], kernels: native.Kernels
    ) -> list[_Built] | None:
        if self._seen != _registrations:  # a parameter was assigned somewhere: collect again
            self._params = [
                getattr(module, name)
                for layer in layers
                for module in layer.modules()
                for name, _ in module.named_parameters(recurse=False)
            ]
            self._seen = _registrations
        # each parameter's storage now (`.data` may be another tensor), read from the list
        # collected above: `Module.__getattr__` per parameter is slow host work on every step
        of = tuple(0 if p is None else p.data_ptr() for p in self._params)
        if of != self._of:
            servable_all = all(servable(layer, kernels) for layer in layers)
            self._built = [_Built(layer, kernels) for layer in layers] if servable_all else None
            self._of = of
        return self._built


def _fits(built: list[_Built] | None, rows: int, kind: str | None) -> bool:
    """Every linear of the built layers takes the tiles of `kind` at `rows` rows."""
    return built is not None and all(takes_tiles(rows, n, kind) for b in built for n in b.numels)


def _step(plan: GroupPlan) -> abi.Step:
    nat = plan.native
    assert nat is not None  # `run` declined plans without one
    s = abi.Step()
    s.tables, s.table_stride = nat.tables.data_ptr(), nat.tables.stride(0)
    s.seq_token, s.seq_qlen = nat.seq_token.data_ptr(), nat.seq_qlen.data_ptr()
    s.seq_row, s.lo, s.hi = nat.seq_row.data_ptr(), nat.lo.data_ptr(), nat.hi.data_ptr()
    s.num_seqs = nat.seq_token.shape[0]
    s.write_rows, s.num_written = plan.write_rows.data_ptr(), plan.write_rows.shape[0]
    if plan.write_tokens is not None:
        s.write_tokens = plan.write_tokens.data_ptr()
    s.block_size = plan.block_size
    return s
