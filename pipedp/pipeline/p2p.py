"""Activations and gradients between pipeline ranks, over torch.distributed point-to-point ops.

Sends are ``isend`` (the sender goes on; the work is waited on at the end of
the step), receives are ``irecv`` waited on right away: on NCCL that wait is
device-side (the receiving stage's stream waits), on gloo the host waits, with
the layout's timeout. A receiver must know what is coming: the first time an
activation crosses a boundary for a given input signature, a small metadata
message per tensor (how many tensors the boundary passes, shape, dtype,
requires_grad) goes first; both sides key that cache on the same values, so
they agree on when it is sent. Gradients need none: they have the shapes of
the activation tensors the receiver sent that require grad.
"""

from __future__ import annotations

import datetime
from typing import Any, Hashable

import torch
import torch.distributed as dist

from ..distributed import DistributedError
from ..partition.boundary import Value, tensors

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

    def _fail(self, what: str, peer: int, cause: BaseException) -> DistributedError:
        return DistributedError(
            f"pipeline transfer failed: {what} rank {peer} at step {self.step} (this is rank {dist.get_rank()}): "
            f"that rank died, hung past the {self.timeout.total_seconds():.0f} s timeout, or runs a different "
            f"schedule. Check its log, then restart from the last checkpoint. Cause: {cause}"
        )

    def _isend(self, t: torch.Tensor, peer: int, what: str) -> None:
        t = t.contiguous()
        try:
            work = dist.isend(t, dst=peer, group=self.group)
        except RuntimeError as e:
            raise self._fail(f"sending {what} to", peer, e) from e
        self._pending.append((work, t, what, peer))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(buf, src=peer, group=self.group)
            if buf.is_cuda:
                work.wait()  # device-side on NCCL
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise self._fail(f"receiving {what} from", peer, e) from e
        return buf

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

    def recv_activation(self, peer: int, key: Hashable) -> Value:
        """Receive an activation (leaves that require grad where the sender's outputs did)."""
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

    def recv_grads(self, like: list[torch.Tensor], peer: int) -> list[torch.Tensor]:
        """Gradients for ``like`` (the sent tensors that require grad), as the receiver sent them."""
        return [self._recv(tuple(t.shape), t.dtype, peer, "a gradient") for t in like]

    def flush(self) -> None:
        """Wait for this step's sends (their buffers must live until they are out)."""
        pending, self._pending = self._pending, []
        for work, t, what, peer in pending:
            try:
                if t.is_cuda:
                    work.wait()
                else:
                    work.wait(self.timeout)
            except RuntimeError as e:
                raise self._fail(f"sending {what} to", peer, e) from e
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
        """Forget in-flight sends after a failed step (the step is being abandoned)."""
        self._pending = []
