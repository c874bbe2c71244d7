"""Stock model builders for the library's tests (the library's tests do not import the experiments).

The registry's torchvision wheels are CUDA builds whose compiled operators
do not load beside the CPU torch; their model definitions are pure Python.
Where the operators are missing, torchvision is imported again without the
module that registers their meta kernels, which is all that fails.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest


def torchvision_models() -> types.ModuleType:
    """``torchvision.models``, or the test skipped where torchvision is not installed."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (the dev extra has it)")
    try:
        import torchvision.models as models
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision.models as models
    return models


def timm() -> types.ModuleType:
    """``timm`` (importing torchvision as :func:`torchvision_models` can), or the test skipped where it is missing."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (the dev extra has it)")
    torchvision_models()
    import timm as module
    return module
