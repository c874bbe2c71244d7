"""The custom op without tuned kernels: exactly torch's convolution, with autograd and torch.compile."""

import pytest
import torch
import torch.nn.functional as F

from pipedp.ops import depthwise_conv2d


@pytest.mark.parametrize("mult, stride, padding, dilation", [(1, 1, 1, 1), (2, 2, 0, 1), (1, (1, 2), (2, 1), 2)])
def test_matches_conv2d_with_gradients(mult, stride, padding, dilation):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 11, 9, generator=g, requires_grad=True)
    w = torch.randn(3 * mult, 1, 3, 3, generator=g, requires_grad=True)
    b = torch.randn(3 * mult, generator=g, requires_grad=True)
    y = depthwise_conv2d(x, w, b, stride, padding, dilation)
    ref_in = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref = F.conv2d(*ref_in, stride=stride, padding=padding, dilation=dilation, groups=3)
    assert torch.allclose(y, ref, atol=1e-6)  # bias added after the conv: rounding differs
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy)
    for a, r in zip((x, w, b), ref_in):
        assert torch.allclose(a.grad, r.grad, atol=1e-6)


def test_gradcheck_in_float64():
    x = torch.randn(1, 2, 6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: depthwise_conv2d(a, c, None, 2, 1, 1), (x, w))


def test_torch_compile_traces_through_the_op():
    x, w = torch.randn(2, 4, 8, 8), torch.randn(4, 1, 3, 3, requires_grad=True)
    f = torch.compile(lambda a, c: depthwise_conv2d(a, c, None, 1, 1, 1).relu().sum(), backend="eager", fullgraph=True)
    try:
        out = f(x, w)
        out.backward()
        assert torch.allclose(out, F.conv2d(x, w, padding=1, groups=4).relu().sum()) and w.grad is not None
    finally:
        del f
        torch._dynamo.reset()  # compiled frames keep example tensors (with their graphs) alive


def test_fake_tensors_get_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = depthwise_conv2d(torch.empty(2, 4, 9, 9), torch.empty(8, 1, 5, 5), None, 2, 2, 1)
    assert tuple(y.shape) == (2, 8, 5, 5)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match=r"weight \(M\*C, 1, kh, kw\)"):
        depthwise_conv2d(torch.randn(1, 4, 8, 8), torch.randn(6, 1, 3, 3))


def test_channels_last_stays_channels_last_through_forward_and_backward():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 9, 9, generator=g).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(8, 1, 3, 3, generator=g, requires_grad=True)
    y = depthwise_conv2d(x, w, None, 2, 1, 1)
    assert y.is_contiguous(memory_format=torch.channels_last)
    y.backward(torch.ones_like(y))
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.conv2d(xr, wr, stride=2, padding=1, groups=8).sum().backward()
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(x.grad, xr.grad, atol=1e-6) and torch.allclose(w.grad, wr.grad, atol=1e-5)


def test_eager_path_and_the_registered_op_agree_with_gradients(monkeypatch):
    from pipedp.ops import depthwise as D

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 7, 6, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 1, 3, 3, generator=g)
    dy = torch.randn(2, 8, 4, 3, generator=g)
    results = []
    for path in ("eager", "op"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        if path == "op":
            y = D._fwd(xr, wr, [2, 2], [1, 1], [1, 1], "", False)  # the registered custom op (torch.compile's path)
        else:
            calls: list = []
            monkeypatch.setattr(D, "_fwd", calls.append)  # must not be reached for plain tensors
            y = depthwise_conv2d(xr, wr, None, 2, 1, 1)
            monkeypatch.undo()
            assert not calls
        y.backward(dy)
        results.append((y.detach(), xr.grad, wr.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(results[0][0], F.conv2d(x, w, None, 2, 1, 1, 4), rtol=1e-5, atol=1e-5)
