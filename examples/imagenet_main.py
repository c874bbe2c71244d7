"""The training loop of PyTorch's ImageNet example (``imagenet/main.py``), trained with pipedp.

Written after that script's shape (argparse, torchvision model by name, SGD
with momentum and weight decay, StepLR, top-1/top-5 accuracy, a checkpoint
dict with ``epoch``/``state_dict``/``optimizer``/``scheduler``) on
synthetic data, as its ``--dummy`` flag does. ``--plain`` runs the plain
loop; without it the lines marked ``# pipedp`` replace forward, backward and
step. Both print each step's loss with all its digits, and the weights'
digest at the end: compare the two outputs to see the same training.

    python examples/imagenet_main.py --plain
    python examples/imagenet_main.py
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn as nn

import pipedp  # pipedp
from synthetic import batches
from pipedp.experiments.zoo import torchvision_models  # torchvision.models (CPU torch beside a CUDA torchvision)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-a", "--arch", default="resnet18")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="batches per epoch (synthetic data)")
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default="", help="a checkpoint written by --checkpoint")
    p.add_argument("--checkpoint", default="", help="where to save one after the last epoch")
    p.add_argument("--plain", action="store_true", help="the plain loop, without pipedp")
    return p.parse_args(argv)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[float]:
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum().item() * 100.0 / target.size(0) for k in topk]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = torchvision_models().__dict__[args.arch](num_classes=args.num_classes)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    ckpt = torch.load(args.resume, weights_only=True) if args.resume else None
    engine = None if args.plain else pipedp.wrap(model, optimizer=optimizer, loss_fn=criterion,  # pipedp
                                                 decision=ckpt["pipedp"]["decision"] if ckpt else None)  # pipedp
    start_epoch = 0
    if ckpt is not None:
        start_epoch = ckpt["epoch"]
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if engine is not None:  # pipedp
            engine.load_run_state(ckpt["pipedp"])  # pipedp: step count, RNG states
    for epoch in range(start_epoch, args.epochs):
        model.train()
        for i, (images, target) in enumerate(
                batches(args.seed, epoch, args.steps, args.batch_size, args.image_size, args.num_classes)):
            if engine is None:
                output = model(images)
                loss = criterion(output, target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            else:
                loss, output = engine.train_step(images, target, return_outputs=True)  # pipedp
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            print(f"epoch {epoch} step {i} loss {loss.item()!r} acc1 {acc1:.2f} acc5 {acc5:.2f}", flush=True)
        scheduler.step()
    if args.checkpoint:
        state = {"epoch": args.epochs, "arch": args.arch, "state_dict": model.state_dict(),
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        if engine is not None:  # pipedp
            state["pipedp"] = engine.run_state()  # pipedp
        torch.save(state, args.checkpoint)
    if engine is not None:  # pipedp
        print(engine.plan.label, "-", engine.plan.contract)  # pipedp: the plan and its math
    digest = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                     for t in model.state_dict().values())).hexdigest()[:16]
    print(f"weights {digest}")


if __name__ == "__main__":
    main()
