"""One rank of the emulated-cluster training check: a small CNN trained with pipedp over torchrun's world.

Each data-parallel replica trains on its shard of fixed global batches; rank 0
writes the final weights to ``--out``. The test trains the same global batches
in one plain process and compares.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import pipedp
from tests.reference import data, sequential_cnn

STEPS, GLOBAL_BATCH = 3, 8


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return data(n=GLOBAL_BATCH, size=8, steps=STEPS, seed=5)


def model() -> nn.Module:
    torch.manual_seed(0)
    return sequential_cnn()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        m = model()
        engine = pipedp.wrap(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), pp=args.pp, stages=2 if args.pp > 1 else 1,
                             microbatches=2, profile=False, progress=False, plan_cache=False)
        dp, replica = engine.layout.dp, engine.layout.dp_rank
        for x, y in batches():
            shard = slice(replica * GLOBAL_BATCH // dp, (replica + 1) * GLOBAL_BATCH // dp)
            engine.train_step(x[shard], y[shard])
        state = engine.state_dict()  # collective: the pipeline ranks' stages merged
        if dist.get_rank() == 0:
            torch.save(state["model"], args.out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
