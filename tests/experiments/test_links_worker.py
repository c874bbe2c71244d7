"""links_worker's PowerSGD row: torch's hook, its buckets chained so that gloo sees one order on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.multiproc import run


def _train_with_powersgd(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from experiments.links_worker import InOrder, in_order_powersgd
    from pipedp.models import get_model

    torch.manual_seed(0)
    model = get_model("resnet18", num_classes=10, width=8)
    # Many small buckets: unchained, the second all-reduce of one crosses the next one's between ranks.
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.02)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    ddp.register_comm_hook(InOrder(state), in_order_powersgd)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "iter": state.iter,
            "compressed": len(state.p_memory_dict), "buckets": len(ddp.reducer._get_zeros_like_grad_buckets())}


@pytest.mark.slow
def test_chained_powersgd_runs_on_gloo_and_keeps_the_replicas_equal():
    a, b = run(_train_with_powersgd, 2, timeout_s=120)
    assert a["buckets"] > 3 and a["compressed"] > 0 and a["iter"] == 5  # PowerSGD ran, over many buckets
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
