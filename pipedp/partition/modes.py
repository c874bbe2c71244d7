"""What a traced forward does beyond its operations, kept in the blocks cut from it: no-grad regions and modes.

torch.fx records operations, not the state they ran in. A ``with
torch.no_grad():`` inside forward (a scale computed without gradient) traces
as ordinary nodes, and blocks copied from them would let gradients flow
where the author stopped them; so each node carries the grad mode it was
traced in, and a block switches gradients off around the nodes traced
without (putting back the caller's mode after: a step's own ``enable_grad``
or ``no_grad`` puts it back if the block raises).

The root's ``self.training``, read in its own forward (timm's classifier
dropout), is baked in as a constant: the forward is traced in both modes,
and a block whose nodes differ between the two holds both graphs and runs
the one the model's flag selects, as the model's own forward would.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["ModeBlock", "copy_nodes", "differing"]


def copy_nodes(graph: torch.fx.Graph, nodes: list[torch.fx.Node], env: dict[torch.fx.Node, torch.fx.Node],
               arg: Callable[[torch.fx.Node], torch.fx.Node]) -> None:
    """Copy ``nodes`` into ``graph`` (``env``: old node to new), turning gradients off around those traced without."""
    restore: torch.fx.Node | None = None  # the caller's grad mode, read where a no-grad run starts
    for n in nodes:
        off = n.meta.get("grad", True) is False
        if off and restore is None:
            restore = graph.call_function(torch.is_grad_enabled)
            graph.call_function(torch._C._set_grad_enabled, (False,))
        elif not off and restore is not None:
            graph.call_function(torch._C._set_grad_enabled, (restore,))
            restore = None
        env[n] = graph.node_copy(n, arg)
    if restore is not None:
        graph.call_function(torch._C._set_grad_enabled, (restore,))


def differing(a: torch.fx.Graph, b: torch.fx.Graph,
              attribute: Callable[[str], object] | None = None) -> set[int] | None:
    """Positions of the nodes whose arguments differ between two traces of one forward; None if the operations do.

    ``attribute`` reads what a ``get_attr`` target holds: the tensor constants
    fx makes (``_tensor_constant<n>``) are named anew by each trace, and two
    of equal value are the same operation.
    """
    na, nb = list(a.nodes), list(b.nodes)
    if len(na) != len(nb):
        return None
    index = {n: i for i, n in enumerate(na)} | {n: i for i, n in enumerate(nb)}

    def refs(v: object) -> object:
        return torch.fx.node.map_aggregate(v, lambda x: _Ref(index[x]) if isinstance(x, torch.fx.Node) else x)

    out: set[int] = set()
    for i, (x, y) in enumerate(zip(na, nb)):
        same_op = (x.op, x.target) == (y.op, y.target) or (
            x.op == y.op == "get_attr" and attribute is not None
            and _same_tensor(attribute(str(x.target)), attribute(str(y.target))))
        if not same_op or x.meta.get("grad") != y.meta.get("grad"):
            return None
        rx, ry = refs((x.args, x.kwargs)), refs((y.args, y.kwargs))
        if not _same(rx, ry):
            if _skeleton(rx) != _skeleton(ry):
                return None
            out.add(i)
    return out


def _same_tensor(a: object, b: object) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))


class _Ref(int):
    """A node reference, by position: unequal to any constant."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and int(self) == int(other)

    __hash__ = int.__hash__


def _same(a: object, b: object) -> bool:
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - a constant whose == is not a bool (a tensor): call it different
        return False


def _skeleton(v: object) -> object:
    """Traced arguments with the constants blanked: node references and container shapes stay."""
    if isinstance(v, _Ref):
        return v
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_skeleton(x) for x in v))
    if isinstance(v, dict):
        return tuple((k, _skeleton(x)) for k, x in v.items())
    return None


class ModeBlock(nn.Module):
    """A block whose graph differs in train and eval mode: runs the one ``root.training`` selects.

    ``root`` is the user's model (not registered: the block's parameters are
    those of its graphs), whose flag ``model.train()``/``eval()`` sets.
    """

    def __init__(self, train: torch.fx.GraphModule, eval_: torch.fx.GraphModule, root: nn.Module) -> None:
        super().__init__()
        self.train_graph, self.eval_graph = train, eval_
        object.__setattr__(self, "root", root)

    def forward(self, x: object) -> object:
        return (self.train_graph if self.root.training else self.eval_graph)(x)
