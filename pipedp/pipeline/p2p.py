"""Activations and gradients between pipeline ranks, over torch.distributed point-to-point ops.

Sends are ``isend`` (the sender goes on; the work is waited on at the end of
the step), receives are ``irecv`` waited on when the action takes them: on NCCL
that wait is device-side (the receiving stage's stream waits), on gloo the host
waits, with the layout's timeout. A receive may be posted ahead of its action
(:mod:`pipedp.pipeline.ahead`): it waits, in posting order per peer, until the
action takes it. A receiver must know what is coming: the first time an
activation crosses a boundary for a given input signature, a small metadata
message per tensor (how many tensors the boundary passes, shape, dtype,
requires_grad) goes first; both sides key that cache on the same values, so
they agree on when it is sent. Gradients need none: they have the shapes of
the activation tensors the receiver sent that require grad.

Before a training step's first message the ranks of the pipeline compare
their batches (:meth:`Transport.compare_batch`, :mod:`.feeding`): the
comparison is gathered in the background from the step's start, and the
step's first send or receive waits for it and refuses a mismatch first, on
every rank alike, so no message of a refused step is on its way.
"""

from __future__ import annotations

import datetime
from collections import deque
from typing import Any, Hashable

import torch
import torch.distributed as dist

from ..distributed import DistributedError, let_go, use_counts
from ..partition.boundary import Value, tensors
from . import feeding

__all__ = ["Transport"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]
_META_LEN = 13  # tensors in the boundary value (0: a lone tensor), dtype, requires_grad, ndim, up to 9 dims
_Meta = tuple[tuple[int, ...], torch.dtype, bool]


class Transport:
    """Point-to-point messages of one rank's pipeline stages."""

    def __init__(self, group: Any, device: torch.device, timeout: datetime.timedelta, step: int = 0) -> None:
        self.group = group
        self.device = device
        self.timeout = timeout
        self.step = step
        self._pending: list[tuple[Any, torch.Tensor, str, int]] = []
        self._sent_meta: set[Hashable] = set()
        self._meta: dict[Hashable, tuple[bool, list[_Meta]]] = {}  # (a tuple?, per tensor)
        self._posted: dict[int, deque[tuple[Hashable, list[torch.Tensor], list[Any]]]] = {}  # per peer, in order
        self._batch: tuple[Any, list[torch.Tensor], list[tuple[int, int]]] | None = None  # the headers in flight

    def _fail(self, what: str, peer: int, cause: BaseException) -> DistributedError:
        return DistributedError(
            f"pipeline transfer failed: {what} rank {peer} at step {self.step} (this is rank {dist.get_rank()}): "
            f"that rank died, hung past the {self.timeout.total_seconds():.0f} s timeout, or runs a different "
            f"schedule. Check its log, then restart from the last checkpoint. Cause: {cause}"
        )

    def compare_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Start gathering every pipeline rank's header of this step's batch (:func:`.feeding.header`).

        Collective over the pipeline ranks, at the start of a training step.
        The step's first message waits for it (hidden behind the first
        forward on the first stage's rank; the others wait for that forward
        anyway) and refuses a mismatch: every rank raises the same error there.
        """
        mine = feeding.header(x, y, self.step).to(self.device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        held = [*parts, mine]
        before = use_counts([t for t in held if not t.is_cuda])
        try:
            work = dist.all_gather(parts, mine, group=self.group, async_op=True)
        except RuntimeError as e:
            raise DistributedError(self._compare_failed(e)) from e
        self._batch = (work, held, before)

    def _compare(self) -> None:
        """Wait for the batch headers begun by :meth:`compare_batch`, if any, and refuse a mismatch."""
        if self._batch is None:
            return
        (work, held, before), self._batch = self._batch, None
        try:
            if held[-1].is_cuda:
                work.wait()  # device-side; the rows' read below is the step's one host sync for it
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise DistributedError(self._compare_failed(e)) from e
        del work
        let_go([t for t in held if not t.is_cuda], before)  # gloo's thread lets go of the headers first
        rows = torch.stack(held[:-1]).tolist()
        feeding.check(rows, dist.get_process_group_ranks(self.group), dist.get_rank(), dist.get_rank(self.group))

    def _compare_failed(self, cause: BaseException) -> str:
        return (
            f"comparing the pipeline ranks' batches failed at step {self.step} (this is rank {dist.get_rank()}): a "
            f"peer died, hung past the {self.timeout.total_seconds():.0f} s timeout, or is not at the same step. "
            f"Check its log, then restart from the last checkpoint. Cause: {cause}"
        )

    def _isend(self, t: torch.Tensor, peer: int, what: str) -> None:
        self._compare()
        t = t.contiguous()
        try:
            work = dist.isend(t, dst=peer, group=self.group)
        except RuntimeError as e:
            raise self._fail(f"sending {what} to", peer, e) from e
        self._pending.append((work, t, what, peer))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int, what: str) -> torch.Tensor:
        buf, work = self._irecv(shape, dtype, peer, what)
        self._wait(work, buf, peer, what)
        return buf

    def _irecv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int, what: str) -> tuple[torch.Tensor, Any]:
        self._compare()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            return buf, dist.irecv(buf, src=peer, group=self.group)
        except RuntimeError as e:
            raise self._fail(f"receiving {what} from", peer, e) from e

    def _wait(self, work: Any, buf: torch.Tensor, peer: int, what: str) -> None:
        try:
            if buf.is_cuda:
                work.wait()  # device-side on NCCL
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise self._fail(f"receiving {what} from", peer, e) from e

    def knows(self, key: Hashable) -> bool:
        """Whether the activations of ``key`` have crossed before (their sizes are known: a receive can be posted)."""
        return key in self._meta

    def post_activation(self, peer: int, key: Hashable) -> None:
        """Post the receive of ``key``'s activation now; :meth:`recv_activation` with ``posted=True`` takes it."""
        self._post(peer, ("activation", key), [(shape, dtype) for shape, dtype, _ in self._meta[key][1]],
                   "an activation")

    def post_grads(self, like: list[torch.Tensor], peer: int, tag: Hashable) -> None:
        """Post the receive of the gradients for ``like`` now; :meth:`recv_grads` with the same ``tag`` takes it."""
        self._post(peer, ("gradients", tag), [(tuple(t.shape), t.dtype) for t in like], "a gradient")

    def _post(self, peer: int, tag: Hashable, specs: list[tuple[tuple[int, ...], torch.dtype]], what: str) -> None:
        bufs, works = [], []
        for shape, dtype in specs:
            buf, work = self._irecv(shape, dtype, peer, what)
            bufs.append(buf)
            works.append(work)
        self._posted.setdefault(peer, deque()).append((tag, bufs, works))

    def _take(self, peer: int, tag: Hashable, what: str) -> list[torch.Tensor]:
        """The receive posted for ``tag``, waited on: it must be the peer's oldest posted one."""
        queue = self._posted.get(peer)
        if not queue or queue[0][0] != tag:
            head = queue[0][0] if queue else None
            raise RuntimeError(f"pipeline receives taken out of posting order from rank {peer}: {tag!r} taken, "
                               f"{head!r} posted first (a pipedp bug: please report it)")
        _, bufs, works = queue.popleft()
        for buf, work in zip(bufs, works):
            self._wait(work, buf, peer, what)
        return bufs

    def send_activation(self, v: Value, peer: int, key: Hashable) -> None:
        """Send an activation (a tensor or a tuple of them); the first time for ``key`` its metadata goes first."""
        ts = tensors(v)
        if key not in self._sent_meta:
            for t in ts:
                if t.dim() > _META_LEN - 4 or t.dtype not in _DTYPES:
                    raise ValueError(
                        f"a stage boundary carries a {t.dim()}-dim {t.dtype} tensor; pipeline ranks can pass "
                        f"tensors of up to {_META_LEN - 4} dims in {_DTYPES}: cut elsewhere (stages=[...])"
                    )
            count = 0 if isinstance(v, torch.Tensor) else len(ts)
            for t in ts:
                meta = [count, _DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
                meta += [0] * (_META_LEN - len(meta))
                self._isend(torch.tensor(meta, dtype=torch.int64, device=self.device), peer, "activation metadata")
            self._sent_meta.add(key)
        for t in ts:
            self._isend(t.detach(), peer, "an activation")

    def _recv_meta(self, peer: int) -> tuple[int, _Meta]:
        m = self._recv((_META_LEN,), torch.int64, peer, "activation metadata").tolist()
        return m[0], (tuple(m[4 : 4 + m[3]]), _DTYPES[m[1]], bool(m[2]))

    def recv_activation(self, peer: int, key: Hashable, posted: bool = False) -> Value:
        """Receive an activation (leaves that require grad where the sender's outputs did); ``posted``: its
        receive was posted ahead (:meth:`post_activation`)."""
        if posted:
            is_tuple, metas = self._meta[key]
            bufs = self._take(peer, ("activation", key), "an activation")
            got = tuple(b.requires_grad_(rg) for b, (_, _, rg) in zip(bufs, metas))
            return got if is_tuple else got[0]
        if key not in self._meta:
            count, first = self._recv_meta(peer)
            self._meta[key] = (count > 0, [first] + [self._recv_meta(peer)[1] for _ in range(count - 1)])
        is_tuple, metas = self._meta[key]
        got = tuple(self._recv(shape, dtype, peer, "an activation").requires_grad_(rg) for shape, dtype, rg in metas)
        return got if is_tuple else got[0]

    def send_grads(self, gs: list[torch.Tensor], peer: int) -> None:
        """The gradients of the received activation's tensors that require grad, in order."""
        for g in gs:
            self._isend(g, peer, "a gradient")

    def recv_grads(self, like: list[torch.Tensor], peer: int, posted: Hashable | None = None) -> list[torch.Tensor]:
        """Gradients for ``like`` (the sent tensors that require grad), as the receiver sent them; ``posted``: the
        tag their receive was posted ahead with (:meth:`post_grads`)."""
        if posted is not None:
            return self._take(peer, ("gradients", posted), "a gradient")
        return [self._recv(tuple(t.shape), t.dtype, peer, "a gradient") for t in like]

    def flush(self) -> None:
        """Wait for this step's sends (their buffers must live until they are out)."""
        self._compare()  # a step that sent and received nothing still answers its comparison
        pending, self._pending = self._pending, []
        for work, t, what, peer in pending:
            try:
                if t.is_cuda:
                    work.wait()
                else:
                    work.wait(self.timeout)
            except RuntimeError as e:
                raise self._fail(f"sending {what} to", peer, e) from e
        left = sum(len(q) for q in self._posted.values())
        if left:  # it would take a message of the next step: drained (its sender waits for it), then refused
            for peer, queue in self._posted.items():
                while queue:
                    self._take(peer, queue[0][0], "a message")
            raise RuntimeError(f"{left} receive(s) posted ahead were never taken this step (a pipedp bug: please "
                               f"report it)")
        self.step += 1

    def forget(self) -> None:
        """Send and expect metadata afresh: the model changed (a layer frozen or unfrozen, a dtype changed).

        What crosses a boundary (its dtype, whether a gradient comes back) follows
        the parameters, not only the input. Every pipeline rank holds the whole
        model and makes the same change, so all forget at the same step.
        """
        self._sent_meta.clear()
        self._meta.clear()

    def reset(self) -> None:
        """Forget in-flight sends and receives posted ahead after a failed step (the step is being abandoned)."""
        self._pending = []
        self._posted = {}
        self._batch = None  # every pipeline rank began it: it completes without this rank waiting

    @property
    def posts_ahead(self) -> bool:
        """Whether receives are worth posting ahead: on gloo (the host's) a message waits for its posted receive;
        on NCCL the host runs ahead of the device and posts them early anyway."""
        return self.device.type == "cpu"
