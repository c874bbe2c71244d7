"""pipedp: faster PyTorch CNN training without changing the model.

``pipedp.wrap(model, ...)`` cuts an unmodified model into balanced stages and
trains it as a microbatch pipeline (GPipe or 1F1B), with stages on separate
CUDA streams of one GPU or on several devices. A step equals plain PyTorch
training with gradient accumulation over the same microbatches. Launched with
torchrun it runs data parallel x pipeline over ``torch.distributed``.
"""

from . import data
from .distributed import DistributedError
from .engine import Engine, wrap
from .plan import Plan, StagePlan

__all__ = ["wrap", "Engine", "Plan", "StagePlan", "DistributedError", "data"]
__version__ = "0.1.0"
