"""Gradient averaging over the data-parallel group, overlapped with backward.

Every stage's parameters are packed into buckets (flat buffers of about
``bucket_bytes``, in reverse registration order like DDP, since backward reaches
the last layers first, and the first layers apart, see :func:`~pipedp.pipeline.buckets.pack`); each parameter's ``.grad`` is a view into its bucket,
so nothing is copied in or out. Gradients accumulate over microbatches; during
a stage's *last* backward of the step a bucket is all-reduced (asynchronously,
on that stage's own communication lane) the moment its last parameter has
accumulated, while this and other stages are still in backward. The optimizer
waits only on those collectives (:meth:`GradSync.wait`), or, with an early
optimizer update, each stage's update waits only on that stage's buckets
(:meth:`GradSync.wait_stage`).

Gradients accumulated off the stage's stream (a W action on the stage's side
lane, :mod:`~pipedp.pipeline.weight_grad`) reach a bucket through
:meth:`GradSync.accumulated` instead of autograd's hook, and a bucket is
launched only after the lanes in :attr:`GradSync.after` for its stage (those
side lanes), since its last gradient may have been added on either.

Averaging: the result is the gradient of the global batch's mean loss, as if
one process trained on all ranks' samples at once. The global batch of
``N = sum(n_r)`` samples has mean loss ``sum(n_r * mean_r) / N``, so rank ``r``'s
gradient counts with weight ``n_r / N``, not ``1 / ranks`` (which is DDP's mean
of per-rank means, the same only when every rank feeds an equal batch). Each
step starts with :meth:`GradSync.begin`: one single-number all-reduce of the
local batch sizes on the same group, issued before any bucket's, so it is done
first; a bucket is divided by the group size as before and multiplied by
``n_r * ranks / N``, which is exactly 1 for equal batches (then the numbers are
those of a plain average). On CUDA that factor stays on the device (the lane
waits for the count, the host does not); on the CPU the first bucket waits for
the count, which its peers sent when they began the step.

The buckets hold what trains *now*: when a layer is frozen or unfrozen, or a
parameter changes dtype or shape, after wrap, :meth:`GradSync.refresh` packs
them again (the engine notices at the start of a step). The count carries a
stamp of that layout and the step number, so on the CPU a rank whose layout
differs from its peers' (a change made on some ranks only), or a rank behind
(a step that failed there while its peers trained it, drained by
:meth:`GradSync.drain`), fails the step on every rank before any bucket
travels; on CUDA the stamp is not read (that would be a host sync).

With ``reduce_dtype`` (bf16/fp16) the bucket travels in that dtype: half the bytes,
at the cost of rounding each rank's contribution to 8 (bf16) or 11 (fp16)
significant bits before the sum.

Why not DDP's reducer, which does the bucketing in C++: it serves one module
per process, whose every parameter's gradient arrives through autograd in one
backward. pipedp needs, and DDP cannot give: several stages in one process,
each with its own buckets launched on that stage's own lane as its last
microbatch's backward ends (CUDA streams of one GPU, CPU thread teams);
gradients accumulated outside autograd (split weight gradients on a side
lane, :meth:`GradSync.accumulated`); an optimizer update per stage that waits
on that stage's buckets only (:meth:`GradSync.wait_stage`); ranks weighed by
their share of unequal batches; a layout stamp that fails a step whose ranks
disagree on what trains before any bucket travels. Where DDP would do the job
(one stage per process, plain data parallelism), the buckets are laid out as
DDP's (the same first and later caps, closing at the cap) and measured against
it side by side (``experiments/bench_links.py``, ``bench_dp.py``).
"""

from __future__ import annotations

import datetime
import itertools
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..defaults import DEFAULT_BUCKET_BYTES
from ..device import canonical_device
from ..distributed import DistributedError, StepMismatch, behind_note, gather_objects
from .buckets import FIRST_BUCKET_BYTES, Bucket, layout_stamp, pack, same_stamp
from .stream import Lane, current_lane, new_lane
from .sync_stats import SyncStats, union_ms
from .trace import Clock

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["GradSync", "DEFAULT_BUCKET_BYTES"]

_COUNT = "the all-reduce of the local batch sizes"
_STEP_BITS = 16  # the step travels mod 2**16 with its square, summed exactly in float64 as the stamp (buckets.py)


class GradSync:
    """Averages each stage's gradients over ``group`` as soon as that stage's backward ends."""

    def __init__(
        self,
        stage_params: Sequence[Sequence[nn.Parameter]],
        group: Any,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        if reduce_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"reduce_dtype must be None, torch.bfloat16 or torch.float16, got {reduce_dtype}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype
        self.timeout = timeout
        self.step = 0
        self.buckets: list[Bucket] = []
        self._of: dict[int, tuple[Bucket, int]] = {}  # a parameter's bucket and its place there
        self._armed: set[int] = set()
        self.lanes: list[Lane] = []
        self._hooks: list[Any] = []
        self.after: dict[int, list[Lane]] = {}  # per stage: other lanes its gradients are accumulated on
        self._waited: set[int] = set()  # buckets (by position) this step already waited for
        # Per device with buckets: the step's local batch size, summed over the group, and the layout stamp.
        self._counts: dict[torch.device, torch.Tensor] = {}
        self._stamps: dict[torch.device, torch.Tensor] = {}
        self.refresh(stage_params)
        self._local = 0
        self._count_work: dict[torch.device, Any] = {}
        self._weights: dict[int, Any] = {}  # per stage: the factor of this step (None: 1)
        self.last = SyncStats()
        self._wait_started = 0.0
        self._wait_events: dict[torch.device, Any] = {}

    def refresh(self, stage_params: Sequence[Sequence[nn.Parameter]]) -> None:
        """Pack the buckets from what trains now: the parameters of each stage that require grad.

        Called at build and whenever the model's trainable set or a parameter's
        dtype or shape changed since the last step (a layer frozen or unfrozen,
        ``model.double()``), so that exactly the parameters that train are
        averaged and a frozen one keeps ``.grad`` None. Every rank must make the
        same change before the same step; :meth:`begin` sends a stamp of this
        layout with the batch count, and a rank whose layout differs raises.
        """
        for h in self._hooks:
            h.remove()
        self.buckets, self._of = [], {}
        seen: set[int] = set()
        for s, params in enumerate(stage_params):
            mine = [p for p in params if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in mine)
            for ps in pack(mine, self.bucket_bytes, FIRST_BUCKET_BYTES):
                flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
                offsets = [0, *itertools.accumulate(p.numel() for p in ps)]
                views = [flat[a:z].view_as(p) for a, z, p in zip(offsets, offsets[1:], ps)]
                b = Bucket(s, ps, flat, views, [False] * len(ps), [False] * len(ps))
                self.buckets.append(b)
                for k, p in enumerate(ps):
                    self._of[id(p)] = (b, k)
            dev = mine[0].device if mine else self.lanes[s].device if s < len(self.lanes) else torch.device("cpu")
            if s >= len(self.lanes):
                self.lanes.append(new_lane(dev, f"gradsync{s}"))
            elif self.lanes[s].device != canonical_device(dev):  # a stage that had nothing to average before
                self.lanes[s] = new_lane(dev, f"gradsync{s}")
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for b in self.buckets for p in b.params]
        stamp = layout_stamp(stage_params) + [0.0, 0.0]  # and the step with its square (begin)
        self._counts, self._stamps = {}, {}
        for dev in dict.fromkeys(b.flat.device for b in self.buckets):
            self._counts[dev] = torch.zeros(len(stamp), dtype=torch.float64, device=dev)
            self._stamps[dev] = torch.tensor(stamp, dtype=torch.float64).to(dev)

    # -- per step -------------------------------------------------------------------------------
    def follow_lanes(self, executor: Executor) -> None:
        """A bucket's gradients may come from the stage's lane or a side lane, in any order on the host: the sync
        waits for all of them before it launches one."""
        for pos, st in enumerate(executor.stages):
            extra = executor.lanes.of_stage(st.index)
            if extra:
                self.after[pos] = [st.lane, *extra]

    def attach(self) -> None:
        """Start a step with no gradients: each one's first accumulation is copied into its bucket (before a step).

        As DDP's reducer does: the first gradient of a parameter is copied into
        its slot and ``.grad`` becomes that slot, later ones are added there in
        place, and a slot that got no gradient by the bucket's launch is zeroed.
        Zeroing every bucket first and adding the first gradient to the zeros
        would pass over the model's gradient bytes twice more each step. Where
        that first gradient is also the last (a step of one microbatch, as data
        parallelism runs) the copy divides by the group size on its way, so the
        launch does not pass over the bucket again to divide it (VGG-11's 113 MB
        cost that pass on every step).
        """
        for b in self.buckets:
            for p in b.params:
                p.grad = None
            b.attached = [False] * len(b.params)
        self.resume()

    def _attach(self, b: Bucket, k: int) -> None:
        """Make parameter ``k`` of ``b``'s ``.grad`` its slot: its gradient so far copied in, else zeros.

        During the stage's last backward what ``.grad`` holds is all this step
        adds (each parameter accumulates once per backward), so it goes in
        divided by the group size, as the launch would divide it.
        """
        p, slot = b.params[k], b.views[k]
        scaled = False
        with torch.no_grad():
            if p.grad is None:
                slot.zero_()
                scaled = True
            elif p.grad is not slot:
                if b.stage in self._armed:
                    torch.div(p.grad, self.size, out=slot)
                    scaled = True
                else:
                    slot.copy_(p.grad)
            p.grad = slot
        b.attached[k] = True
        b.scaled[k] = scaled

    def resume(self) -> None:
        """Start a step's sync on what the buckets hold (after :meth:`attach`, or a call that accumulated).

        The all-reduce is linear and the held part is the same on every
        replica (it was averaged), so averaging held + new gives held + the
        average of new: accumulating over calls equals one process doing so.
        """
        for b in self.buckets:
            b.work, b.wire, b.done, b.events = None, None, [], None
            b.scaled = [False] * len(b.params)  # what the slots hold is divided at the launch
        self._armed.clear()
        self._waited.clear()
        self._count_work, self._weights = {}, {}

    def begin(self, local_batch: int) -> None:
        """This step feeds ``local_batch`` samples here: weigh this rank by its share of the global batch.

        Call after :meth:`attach`, before the backward. Without it a step averages
        plainly (right for equal local batches only).
        """
        if isinstance(local_batch, bool) or not isinstance(local_batch, int) or local_batch < 1:
            raise ValueError(f"the local batch size must be a positive int, got {local_batch!r}")
        self._local = local_batch
        step = self.step % (1 << _STEP_BITS)
        for dev, count in self._counts.items():
            count.copy_(self._stamps[dev])  # on the current stream: no host sync
            count[0].fill_(local_batch)
            count[-2].fill_(step)
            count[-1].fill_(step * step)
            try:
                self._count_work[dev] = dist.all_reduce(count, group=self.group, async_op=True)
            except RuntimeError as e:
                raise DistributedError(self._failure("starting", e, _COUNT)) from e

    def _weight(self, stage: int, dev: torch.device) -> Any:
        """This rank's factor ``n_r * ranks / N`` on the current lane (None when it is 1 or no count was begun)."""
        if stage in self._weights:
            return self._weights[stage]
        work = self._count_work.get(dev)
        weight: Any = None
        if work is not None and dev.type == "cuda":
            work.wait()  # device-side: the lane (current stream) waits for the count
            weight = torch.full((), float(self._local * self.size), dtype=torch.float64, device=dev)
            weight.div_(self._counts[dev][0])
        elif work is not None:
            try:
                work.wait(self.timeout)
            except RuntimeError as e:
                raise DistributedError(self._failure("waiting for", e, _COUNT)) from e
            total, *stamp = self._counts[dev].tolist()
            if not same_stamp(stamp[-2:], self.size):  # every rank sees these sums: all raise here, none is gone
                steps = gather_objects(self.step, self.group, self.timeout)
                raise StepMismatch(behind_note("data-parallel", steps, dist.get_process_group_ranks(self.group),
                                               dist.get_rank()))
            if not same_stamp(stamp[:-2], self.size):
                raise ValueError(self._mismatch())
            factor = self._local * self.size / total
            weight = None if factor == 1.0 else factor
        self._weights[stage] = weight
        return weight

    def arm(self, stage: int) -> None:
        """Stage ``stage`` starts its last backward: launch each bucket when it is complete."""
        self._armed.add(stage)
        for b in self.buckets:
            if b.stage == stage:
                b.pending = len(b.params)

    def finish(self, stage: int) -> None:
        """Stage ``stage``'s backward is over: launch buckets with parameters that got no gradient."""
        for b in self.buckets:
            if b.stage == stage and b.work is None:
                self._launch(b)
        self._armed.discard(stage)

    def accumulated(self, p: torch.Tensor) -> None:
        """``p``'s gradient was accumulated outside autograd (on the current stream)."""
        self._accumulated(p)

    def _accumulated(self, p: torch.Tensor) -> None:
        slot = self._of.get(id(p))
        if slot is None:
            return
        b, k = slot
        if not b.attached[k]:
            self._attach(b, k)
        if b.stage not in self._armed or b.work is not None:
            return
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        for k, attached in enumerate(b.attached):
            if not attached:  # no gradient reached it this step (on the current stream, before the lane waits)
                self._attach(b, k)
        lane = self.lanes[b.stage]
        dev = b.flat.device
        if lane.is_cuda:
            # The bucket's last accumulation was issued on the current stream (the stage's), or on a side lane.
            lane.wait_lane(current_lane(dev))
            for other in self.after.get(b.stage, ()):
                lane.wait_lane(other)
        with lane.use():
            if lane.is_cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record(lane.stream)
            if not any(b.scaled):
                b.flat.div_(self.size)
            elif not all(b.scaled):
                for view, scaled in zip(b.views, b.scaled):
                    if not scaled:
                        view.div_(self.size)
            weight = self._weight(b.stage, dev)
            if weight is not None:
                b.flat.mul_(weight)
            wire = b.flat if self.reduce_dtype in (None, b.flat.dtype) else b.flat.to(self.reduce_dtype)
            b.issued = time.perf_counter()
            try:
                b.work = dist.all_reduce(wire, group=self.group, async_op=True)
            except RuntimeError as e:
                raise DistributedError(self._failure("starting", e)) from e
            b.wire = wire
            if lane.is_cuda:
                b.work.wait()  # device-side: the lane waits for the collective, the host does not
                if wire is not b.flat:
                    b.flat.copy_(wire)
                lane.keep(wire)
                end = torch.cuda.Event(enable_timing=True)
                end.record(lane.stream)
                b.events = (start, end)
            else:
                b.work.get_future().add_done_callback(lambda _f, d=b.done: d.append(time.perf_counter()))

    def wait_stage(self, stage: int) -> None:
        """Make the current stream (CPU: the host) wait for stage ``stage``'s buckets (after its :meth:`finish`)."""
        for k, b in enumerate(self.buckets):
            if b.stage != stage or k in self._waited:
                continue
            if b.work is None:
                self._launch(b)
            lane = self.lanes[b.stage]
            if lane.is_cuda:
                cur = current_lane(b.flat.device)
                cur.wait_lane(lane)
                cur.keep(b.flat)
            else:
                self._wait_work(b)
            self._waited.add(k)

    def _wait_work(self, b: Bucket) -> None:
        """The host waits for ``b``'s all-reduce (CPU) and the result lands in the bucket."""
        try:
            b.work.wait(self.timeout)
        except RuntimeError as e:
            raise DistributedError(self._failure("waiting for", e)) from e
        if b.wire is not b.flat:
            assert b.wire is not None
            b.flat.copy_(b.wire)

    def wait(self) -> None:
        """Make the optimizer's stream (CPU: the host) wait for every bucket's all-reduce."""
        for b in self.buckets:
            if b.work is None:  # a stage whose backward never ran (a failed step)
                self._launch(b)
        self._wait_started = time.perf_counter()
        self._wait_events = {}
        for k, b in enumerate(self.buckets):
            lane = self.lanes[b.stage]
            if k in self._waited and not lane.is_cuda:
                continue
            if lane.is_cuda:
                cur = current_lane(b.flat.device)
                if b.flat.device not in self._wait_events:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record(cur.stream)
                    self._wait_events[b.flat.device] = ev
                cur.wait_lane(lane)
                cur.keep(b.flat)
                continue
            self._wait_work(b)
        self._wait_done = time.perf_counter()
        self.step += 1

    def drain(self) -> BaseException | None:
        """After a step that failed on this rank alone: launch its buckets still to go, zeroed, and wait for all.

        The peers go on with the step, and each of their all-reduces needs this
        rank's; left without, a later collective of this rank would meet theirs
        instead (gloo aborts the process on the size mismatch). Drained, the
        peers finish the step and the next step's count finds this rank behind
        (:class:`~pipedp.distributed.StepMismatch` on every rank). Where every
        rank refused the step at the count, no bucket goes. Returns the error
        that ended the drain (a peer gone), if any.
        """
        try:
            for b in self.buckets:
                if b.work is None:
                    b.flat.zero_()
                    b.attached, b.scaled = [True] * len(b.params), [True] * len(b.params)
                    self._launch(b)
            self.wait()
        except (ValueError, DistributedError) as e:
            return e
        return None

    def stats(self) -> SyncStats:
        """The last waited step's sync timing (on CUDA this synchronises its events)."""
        cuda = [b for b in self.buckets if b.events is not None]
        if cuda:
            ref = next(iter(self._wait_events.values()), None)
            spans = []
            for b in cuda:
                start, end = b.events  # type: ignore[misc]
                end.synchronize()
                base = ref if ref is not None and ref.device == start.device else start
                spans.append((base.elapsed_time(start) * 1e-3, base.elapsed_time(end) * 1e-3))
            total, before = union_ms(spans, 0.0 if ref is not None else float("inf"))
            # A span ending before the wait event has negative offsets: all hidden.
            return SyncStats(len(self.buckets), total, before, total - before)
        spans = [(b.issued, b.done[0] if b.done else self._wait_done) for b in self.buckets if b.work is not None]
        total, before = union_ms(spans, self._wait_started)
        return SyncStats(len(self.buckets), total, before, (self._wait_done - self._wait_started) * 1e3)

    def describe(self) -> str:
        """The last step's sync in one line, for the plan."""
        st = self.stats()
        return (
            f"{st.buckets} bucket(s) of <= {self.bucket_bytes / 2**20:g} MiB over {self.size} replica(s); "
            f"last step {st.sync_ms:.2f} ms in flight, {100 * st.hidden_fraction:.0f}% hidden behind backward, "
            f"optimizer waited {st.exposed_ms:.2f} ms"
        )

    def spans(self, clock: Clock) -> list[tuple[int, int, float, float]]:
        """(stage, bucket bytes, start ms, end ms) of each all-reduce of the last step, from ``clock``'s origin."""
        out = []
        for b in self.buckets:
            nbytes = b.flat.numel() * b.flat.element_size()
            if b.events is not None:
                start, end = b.events
                out.append((b.stage, nbytes, clock.ms(start, b.flat.device), clock.ms(end, b.flat.device)))
            elif b.work is not None:
                done = b.done[0] if b.done else self._wait_done
                out.append((b.stage, nbytes, clock.ms(b.issued), clock.ms(done)))
        return out

    def _mismatch(self) -> str:
        trained = sum(len(b.params) for b in self.buckets)
        return (
            f"the data-parallel ranks do not train the same parameters at step {self.step} (this is rank "
            f"{dist.get_rank()}, where {trained} parameter tensor(s) require grad): a layer was frozen, unfrozen "
            f"or converted (requires_grad_, .double(), .to(dtype)) on some ranks only. Make the same change on every "
            f"rank before the same step; this step was undone"
        )

    def _failure(self, what: str, cause: BaseException, of: str = "gradient all-reduce") -> str:
        """The message of a failed collective ``of``, ``what`` (starting / waiting for) it."""
        return (
            f"{of} over the data-parallel group failed while {what} it at step {self.step} "
            f"(this is rank {dist.get_rank()}; the group has {self.size} ranks): a peer rank died, hung "
            f"past the {self.timeout.total_seconds():.0f} s timeout, or was not at the same step. "
            f"Check the other ranks' logs, then restart from the last checkpoint. Cause: {cause}"
        )

    def remove(self) -> None:
        """Drop the gradient hooks (the engine is being rebuilt)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
