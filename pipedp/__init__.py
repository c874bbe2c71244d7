"""pipedp: faster PyTorch CNN training without changing the model.

``pipedp.wrap(model, ...)`` cuts an unmodified model into balanced stages and
trains it as a microbatch pipeline (GPipe or 1F1B), with stages on separate
CUDA streams of one GPU or on several devices. A step equals plain PyTorch
training with gradient accumulation over the same microbatches. Launched with
torchrun it runs data parallel x pipeline over ``torch.distributed``.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING  # noqa: E402

from . import data  # noqa: E402
from .api import inspect, wrap  # noqa: E402
from .distributed import DistributedError  # noqa: E402
from .engine import Engine  # noqa: E402
from .options import (  # noqa: E402
    ConcurrencyOptions, DataParallelOptions, KernelOptions, PipelineOptions, TrainingOptions,
)
from .plan import Plan, StagePlan  # noqa: E402

if TYPE_CHECKING:
    from .advisor import advise


def __getattr__(name: str) -> object:
    """``pipedp.advise``: the advisor (resources x batch size) is an add-on, loaded on first use, not with
    ``import pipedp``."""
    if name == "advise":
        from .advisor import advise

        return advise
    raise AttributeError(f"module 'pipedp' has no attribute {name!r}")


__all__ = [
    "wrap", "inspect", "Engine", "PipelineOptions", "DataParallelOptions", "KernelOptions", "TrainingOptions", "Plan", "StagePlan",
    "DistributedError", "data", "advise", "__version__", "ConcurrencyOptions",
]
