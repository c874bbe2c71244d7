"""What planning times configurations with: protocols the planner depends on, implemented by the trials.

The planner weighs plans; running one needs the lowering and the runtime,
which depend on the planner's decision. So decide/ asks for a clock through
these protocols and :mod:`pipedp.trials` implements them on the executor the
build makes: decide/ never imports the lowering or the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from .config import Config
from .search import Measure

if TYPE_CHECKING:
    from ..partition.threads import CpuPlan

__all__ = ["Clock", "KernelSwitch", "Trials", "World"]


class KernelSwitch(Protocol):
    """The depthwise layers' switch between tuned kernels and torch's: whether they run the kernels now."""

    @property
    def on(self) -> bool: ...

    def use(self, on: bool) -> None: ...


class Clock(Measure, Protocol):
    """A :class:`~pipedp.decide.search.Measure` that keeps what its trials built, and is closed after the search."""

    @property
    def stages(self) -> Mapping[Config, Sequence[object]]:
        """Each timed plan's stages (compiled ones are handed to the build, which reuses them)."""
        ...

    def close(self) -> None:
        """Drop what the trials built and put the kernels back as the clock found them."""
        ...


class World(Protocol):
    """The processes a plan is made for: all the planner reads of the communicator."""

    @property
    def pp(self) -> int: ...  # pipeline ranks

    @property
    def world(self) -> int: ...  # processes in all


class Trials(Protocol):
    """The clocks of one planning call, bound to its model, batch, devices and options."""

    def clock(self, kernels: KernelSwitch | None) -> Clock:
        """The timed trials' clock; ``kernels`` switches the depthwise layers (None: none swapped)."""
        ...

    def thread_plan_ms(self, plan: CpuPlan) -> float:
        """ms of one step of a plan of concurrent CPU stages, as the build would run it."""
        ...
