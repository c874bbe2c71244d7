"""The training loop of timm's ``train.py``, trained with pipedp.

Written after that script's loop with timm's own pieces: a model from
``timm.create_model`` with dropout and drop path, mixup + cutmix with label
smoothing (``timm.data.Mixup``) and its soft-target loss, ``create_optimizer_v2``,
a cosine schedule with warmup stepped per update, an EMA of the weights
(``ModelEmaV3``), gradient accumulation (``--grad-accum-steps``) and
gradient clipping by norm, value or adaptively (``--clip-mode agc``), on
synthetic data. ``--plain`` runs the plain loop; without it the lines
marked ``# pipedp`` replace forward, backward, clipping and step. Both print
each step's loss with all its digits, and the digests of the weights and
of the EMA weights at the end.

    python examples/timm_train.py --plain
    python examples/timm_train.py
"""

from __future__ import annotations

import argparse
import hashlib

import torch

import pipedp  # pipedp
from synthetic import batches
from pipedp.experiments.zoo import torchvision_models

torchvision_models()  # timm imports torchvision: a CUDA torchvision wheel beside a CPU torch needs the zoo's import

import timm  # noqa: E402
from timm.data import Mixup  # noqa: E402
from timm.loss import SoftTargetCrossEntropy  # noqa: E402
from timm.optim import create_optimizer_v2  # noqa: E402
from timm.scheduler import create_scheduler_v2  # noqa: E402
from timm.utils import ModelEmaV3, dispatch_clip_grad, random_seed  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("-b", "--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="batches per epoch (synthetic data)")
    p.add_argument("--opt", default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=2e-5)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--drop", type=float, default=0.2)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--model-ema-decay", type=float, default=0.998)
    p.add_argument("--grad-accum-steps", type=int, default=2)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--clip-mode", default="agc", choices=["norm", "value", "agc"])
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--plain", action="store_true", help="the plain loop, without pipedp")
    return p.parse_args(argv)


def digest(model: torch.nn.Module) -> str:
    data = b"".join(t.detach().contiguous().numpy().tobytes() for t in model.state_dict().values())
    return hashlib.sha256(data).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    random_seed(args.seed)  # torch, numpy (mixup's draws) and random, as timm's train.py seeds them
    model = timm.create_model(args.model, num_classes=args.num_classes, drop_rate=args.drop,
                              drop_path_rate=args.drop_path)
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=args.num_classes)
    train_loss_fn = SoftTargetCrossEntropy()
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay)
    updates_per_epoch = (args.steps + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=args.epochs,
                                          warmup_epochs=args.warmup_epochs, step_on_epochs=False,
                                          updates_per_epoch=updates_per_epoch)
    model_ema = ModelEmaV3(model, decay=args.model_ema_decay)

    def clip(params) -> None:
        dispatch_clip_grad(params, value=args.clip_grad, mode=args.clip_mode)

    engine = None if args.plain else pipedp.wrap(model, optimizer=optimizer, loss_fn=train_loss_fn,  # pipedp
                                                 grad_hook=clip)  # pipedp
    num_updates = 0
    for epoch in range(args.epochs):
        model.train()
        for batch_idx, (input, target) in enumerate(
                batches(args.seed, epoch, args.steps, args.batch_size, args.img_size, args.num_classes)):
            input, target = mixup_fn(input, target)
            need_update = (batch_idx + 1) % args.grad_accum_steps == 0 or batch_idx + 1 == args.steps
            if engine is None:
                output = model(input)
                loss = train_loss_fn(output, target)
                (loss / args.grad_accum_steps).backward()
                if need_update:
                    clip(model.parameters())
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                loss = engine.train_step(input, target, update=need_update,  # pipedp
                                         loss_divisor=args.grad_accum_steps)  # pipedp
            if need_update:
                num_updates += 1
                model_ema.update(model, step=num_updates)
                lr_scheduler.step_update(num_updates=num_updates)
            print(f"epoch {epoch} step {batch_idx} loss {loss.item()!r}", flush=True)
        lr_scheduler.step(epoch + 1)
    if engine is not None:  # pipedp
        print(engine.plan.label, "-", engine.plan.contract)  # pipedp: the plan and its math
    print(f"weights {digest(model)} ema {digest(model_ema.module)}")


if __name__ == "__main__":
    main()
