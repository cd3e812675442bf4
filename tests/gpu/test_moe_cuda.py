"""`SparseMoE` on a CUDA GPU (marked `gpu`; `tools/gpu_check.sh` runs it): its forward issues no
synchronising call (torch's sync debug mode raising), and gives the host loop's result. CI has no
GPU; on the CPU `tests/runner/test_placement.py` audits the same route for host reads."""

from __future__ import annotations

import pytest
import torch

from kvtier.model.hybrid import SparseMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_moe_routes_on_the_gpu_without_a_sync(num_tokens: int) -> None:
    torch.manual_seed(0)
    layer = SparseMoE(hidden=64, intermediate=32, num_experts=8, top_k=2)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(num_tokens, 64)
    with torch.no_grad():
        on_host = layer(x)  # the loop
        layer.cuda()
        x_gpu = x.cuda()  # the copies in are synchronous: before the mode
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            on_gpu = layer(x_gpu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(on_gpu.cpu(), on_host, rtol=1e-4, atol=1e-4)
