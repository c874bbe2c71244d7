"""One way to run a training step: the value every trial times and the decision names.

A configuration combines the user's standard levers (memory layout,
``torch.compile``) with pipedp's own (stages, microbatches, in-step
concurrency, concurrent CPU stages, tuned depthwise kernels). ``own=True``
is the step a user runs without pipedp (the unmodified model on the whole
batch, on torch's kernels): the bar a plan must beat. Precision is the user's and never a lever; ``precision`` is set
only on the trial behind a precision hint.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """A runnable configuration: the cut (blocks per stage), microbatches and levers."""

    counts: tuple[int, ...]
    microbatches: int = 1
    channels_last: bool = False
    compiled: bool = False
    concurrent: bool = False  # the user's concurrency pieces (shortcut branches, split weight gradients)
    threads: tuple[int, ...] | None = None  # concurrent CPU stages with these intra-op counts (None: in order)
    own: bool = False  # the user's own step, without pipedp (a bar alternative): torch's kernels
    kernels: bool = False  # depthwise layers on the tuned kernels (``kernels="auto"``/``"tvm"``)
    precision: str | None = None  # another precision than the user's (only the hint's trial)

    @property
    def plain(self) -> bool:
        """One stage, one microbatch, nothing concurrent: the user's step, whoever runs it."""
        return len(self.counts) == 1 and self.microbatches == 1 and not self.concurrent and self.threads is None

    @property
    def label(self) -> str:
        """How trials and the plan table name it: ``"plain"`` or ``"SxM"``, then its levers."""
        head = "plain" if self.own else f"{len(self.counts)}x{self.microbatches}"
        levers = [name for name, on in (("channels_last", self.channels_last), ("compiled", self.compiled),
                                        ("concurrent", self.concurrent), ("tuned kernels", self.kernels)) if on]
        if self.threads is not None:
            levers.append("threads " + "+".join(str(t) for t in self.threads))
        if self.precision is not None:
            levers.insert(0, self.precision)
        return " ".join([head, *levers])

    def run_by_pipedp(self, kernels: bool = False) -> "Config":
        """The same step run by the engine (the plan when the bar itself wins), on the tuned kernels if asked."""
        return Config(self.counts, self.microbatches, self.channels_last, self.compiled, self.concurrent,
                      self.threads, kernels=kernels)
