"""The model zoo pipedp is checked on: torchvision's classification CNNs and a fixed sample of timm's families.

One list for the zoo tests and the zoo benchmark. Each model is built from
its library's own builder with random init and random layers on, as users
build them: torchvision's builders with their default arguments (dropout,
stochastic depth as set there; GoogLeNet and Inception-v3 without their
auxiliary heads, which need a loss of their own), timm's with the dropout
and drop path that training recipes set (``drop_rate=0.2,
drop_path_rate=0.1``, where the model takes them; timm's own defaults are 0).
:func:`quiet` sets those rates to 0 on a built model, structure unchanged,
for the checks that compare several stages with plain training (across
stages masks are drawn in the schedule's order, not plain PyTorch's).

The registry's torchvision wheels are CUDA builds: their compiled operators
(``torchvision::nms``, ``roi_align``, ...) do not load beside a CPU-only torch,
and importing torchvision then fails while it registers fake kernels for
those operators (``torchvision._meta_registrations``). The model definitions
are pure Python and never call them, so when the plain import fails
:func:`torchvision_models` imports torchvision again with that one
registration module replaced by an empty one. Only the calling process is
affected; pipedp itself imports neither library.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Callable

from torch import nn

__all__ = ["TORCHVISION", "TRANSFORMERS", "TOO_BIG", "TIMM", "TIMM_DROP", "torchvision_models", "timm", "build",
           "input_size", "quiet"]

# torchvision: every classification CNN builder (its transformers, vit/swin/maxvit, are not CNNs), with the
# arguments it needs beyond the defaults (none but the Inceptions': their auxiliary heads return tuples).
TORCHVISION: dict[str, dict[str, object]] = {
    "alexnet": {}, "squeezenet1_0": {}, "squeezenet1_1": {},
    **{f"vgg{d}{bn}": {} for d in (11, 13, 16, 19) for bn in ("", "_bn")},
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
    **{f"resnet{d}": {} for d in (18, 34, 50, 101, 152)},
    "resnext50_32x4d": {}, "resnext101_32x8d": {}, "resnext101_64x4d": {},
    "wide_resnet50_2": {}, "wide_resnet101_2": {},
    **{f"densenet{d}": {} for d in (121, 161, 169, 201)},
    "mobilenet_v2": {}, "mobilenet_v3_small": {}, "mobilenet_v3_large": {},
    **{f"mnasnet{w}": {} for w in ("0_5", "0_75", "1_0", "1_3")},
    **{f"shufflenet_v2_x{w}": {} for w in ("0_5", "1_0", "1_5", "2_0")},
    **{f"efficientnet_b{i}": {} for i in range(8)},
    **{f"efficientnet_v2_{s}": {} for s in "sml"},
    **{f"regnet_{k}_{f}": {} for k in "xy" for f in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")},
    "regnet_y_128gf": {},
    **{f"convnext_{s}": {} for s in ("tiny", "small", "base", "large")},
}
TIMM_DROP = {"drop_rate": 0.2, "drop_path_rate": 0.1}  # as timm's train.py recipes pass them (--drop, --drop-path)
TRANSFORMERS = ("vit_", "swin_", "maxvit_")
# The largest members of their families (43M to 644M parameters): the zoo runs on 2 cores hold two or three
# copies of each and take a minute or more per model, so they are left out of the default runs; every family is
# covered by smaller members built from the same block code (``bench_zoo --models`` runs them by name).
TOO_BIG = ("regnet_y_128gf", "regnet_y_32gf", "regnet_x_32gf", "regnet_y_16gf", "vgg11", "vgg11_bn", "vgg13",
           "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn", "resnext101_64x4d", "resnext101_32x8d",
           "wide_resnet101_2", "convnext_large", "convnext_base", "efficientnet_v2_l", "efficientnet_v2_m",
           "efficientnet_b7", "efficientnet_b6", "alexnet")

# timm: 64 models of 34 families (timm modules), fixed before cutting was made robust for them (small variants).
TIMM = (
    "resnet18", "resnet50d", "resnetv2_50", "seresnet18", "resnext26ts", "regnetx_002", "regnety_002",
    "regnetz_b16", "efficientnet_b0", "efficientnet_lite0", "tf_efficientnet_b0", "tf_efficientnetv2_b0",
    "efficientnetv2_rw_t", "mixnet_s", "mnasnet_small", "mobilenetv2_050", "mobilenetv3_small_050",
    "mobilenetv3_large_100", "mobilenetv4_conv_small", "fbnetc_100", "spnasnet_100", "lcnet_050",
    "ghostnet_050", "ghostnetv2_100", "rexnet_100", "rexnetr_100", "densenet121", "dla34", "dpn68", "vovnet39a",
    "ese_vovnet19b_dw", "xception41", "hrnet_w18_small", "cspresnet50", "cspdarknet53", "cs3darknet_s",
    "darknet17", "res2net50_26w_4s", "res2next50", "resnest14d", "skresnet18",
    "selecsls42b", "tresnet_m", "nf_resnet26", "nfnet_f0", "dm_nfnet_f0", "repvgg_a0", "mobileone_s0",
    "fastvit_t8", "convnext_atto", "convnextv2_atto", "edgenext_xx_small", "efficientformer_l1",
    "efficientvit_b0", "levit_128s", "coatnet_nano_rw_224", "mobilevit_xxs", "mobilevitv2_050", "poolformer_s12",
    "inception_v3", "inception_v4", "vgg11", "hgnet_tiny", "hgnetv2_b0",
)


def _purge(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def torchvision_models() -> types.ModuleType:
    """``torchvision.models``; ImportError where torchvision is not installed."""
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError("torchvision is not installed (the dev extra has it)")
    try:
        import torchvision.models as models
    except RuntimeError as e:  # its compiled operators are missing from this torch build
        if "torchvision::" not in str(e):
            raise
        _purge("torchvision")
        meta = "torchvision._meta_registrations"
        sys.modules[meta] = types.ModuleType(meta)
        import torchvision.models as models
    return models


def timm() -> types.ModuleType:
    """``timm`` (which imports torchvision); ImportError where it is not installed."""
    if importlib.util.find_spec("timm") is None:
        raise ImportError("timm is not installed (the dev extra has it)")
    torchvision_models()
    import timm as module

    return module


def input_size(library: str, name: str) -> int:
    """A square input size the model takes (small: the checks run on CPUs).

    64 where the model takes it; the Inception stems shrink an input 8x
    before 3x3 convolutions without padding (at least 75 pixels); timm's
    models with a fixed input size (attention over a fixed grid) take theirs.
    """
    if "inception" in name:
        return 96
    if library == "timm":
        cfg = timm().models.get_pretrained_cfg(name)
        if cfg is not None and cfg.fixed_input_size:
            return int(cfg.input_size[-1])
    return 64


def build(library: str, name: str, classes: int = 10, *, random_layers: bool = True) -> Callable[[], nn.Module]:
    """A builder of the named model, random init, random layers on (see the module doc), or set to 0."""
    if library == "torchvision":
        models = torchvision_models()

        def make() -> nn.Module:
            return models.get_model(name, num_classes=classes, **TORCHVISION[name])
    else:
        lib = timm()

        def make() -> nn.Module:
            for drop in (TIMM_DROP, {"drop_rate": TIMM_DROP["drop_rate"]}):
                try:
                    return lib.create_model(name, pretrained=False, num_classes=classes, **drop)
                except TypeError:  # a model without drop path (or without either)
                    continue
            return lib.create_model(name, pretrained=False, num_classes=classes)

    return make if random_layers else lambda: quiet(make())


_RATES = ("p", "drop_prob", "drop_rate", "dropout", "drop_path_rate")


def quiet(model: nn.Module) -> nn.Module:
    """``model`` with every dropout and drop-path rate set to 0 in place (its structure as built); returns it.

    The rates are attributes the layers read at each call: torch's dropout
    modules' and torchvision's ``StochasticDepth``'s ``p``, timm's
    ``DropPath``/``DropBlock`` ``drop_prob``, and the ``drop_rate`` a timm
    model's own forward passes to ``F.dropout``.
    """
    for m in model.modules():
        random = isinstance(m, nn.modules.dropout._DropoutNd) or "drop" in type(m).__name__.lower() or (
            type(m).__name__ == "StochasticDepth")
        for attr in _RATES:
            value = getattr(m, attr, None)
            if isinstance(value, float) and (random or attr != "p"):
                setattr(m, attr, 0.0)
    return model
