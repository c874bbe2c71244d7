"""The resources x batch-size advisor: the cheapest configuration that meets a time limit and an accuracy target.

``pipedp.advise(step_timer, accuracy_run, space=..., targets=..., dataset_size=...)``
profiles a few configurations briefly, fits a monotone model of step time
over (resources, batch, microbatches) and a conservative monotone bound of
accuracy over (batch, epochs), and returns the cheapest plan (one phase, or
staged) predicted to meet both targets. ``pipedp-advise`` is its command line.
"""

from .accuracy import AccuracyModel, AccuracyRun
from .api import Advice, Profiling, advise, fit_step_model
from .choose import NoPlan, Phase, Targets, TrainingPlan, cheapest, cheapest_staged
from .monotone import Isotonic, MonotoneLaw, isotonic
from .profile import CpuStepTimer, StepTimer, Task, TrainAccuracy
from .ranks import TorchrunStepTimer
from .space import Config, SearchSpace

__all__ = [
    "advise", "Advice", "Profiling", "Config", "SearchSpace", "Targets", "TrainingPlan", "Phase", "NoPlan",
    "StepTimer", "AccuracyRun", "AccuracyModel", "MonotoneLaw", "Isotonic", "isotonic", "cheapest", "cheapest_staged",
    "fit_step_model", "CpuStepTimer", "TorchrunStepTimer", "TrainAccuracy", "Task",
]
