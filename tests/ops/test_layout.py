"""Which kernel layout a tensor calls for, and the zero-copy views the kernels are given."""

import pytest
import torch

from pipedp.ops.layout import ALIGNMENT, aligned, arrange, empty, layout_of_tensor


def test_memory_format_picks_the_layout():
    x = torch.randn(2, 3, 4, 5)
    assert layout_of_tensor(x) == "NCHW"
    assert layout_of_tensor(x.contiguous(memory_format=torch.channels_last)) == "NHWC"
    # One channel: both formats at once; the plain one wins (no permute needed).
    assert layout_of_tensor(torch.randn(2, 1, 4, 5).contiguous(memory_format=torch.channels_last)) == "NCHW"
    assert layout_of_tensor(x[:, :, ::2]) == "NCHW"  # neither: made contiguous when arranged


def test_arrange_is_a_view_in_the_right_layout_and_copies_otherwise():
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    v = arrange(x, "NHWC")
    assert v.shape == (2, 4, 5, 3) and v.is_contiguous() and v.data_ptr() == x.data_ptr()
    assert torch.equal(v[1, 2, 3], x[1, :, 2, 3])
    c = arrange(x, "NCHW")
    assert c.is_contiguous() and c.data_ptr() != x.data_ptr() and torch.equal(c, x)


def test_empty_and_bad_layouts():
    like = torch.randn(1, dtype=torch.float64)
    y = empty([2, 3, 4, 5], like, "NHWC")
    assert y.dtype == torch.float64 and y.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="layout 'NCWH'"):
        arrange(y, "NCWH")


def test_aligned_copies_only_a_tensor_whose_data_is_off_the_kernels_alignment():
    x = torch.randn(4, 3, 5, 5)  # 300 bytes a sample
    assert aligned(x) is x and x.data_ptr() % ALIGNMENT == 0
    view = x[1:]
    assert view.data_ptr() % ALIGNMENT != 0
    copy = aligned(view)
    assert copy.data_ptr() % ALIGNMENT == 0 and torch.equal(copy, view) and copy.stride() == view.stride()
    nhwc = arrange(x.contiguous(memory_format=torch.channels_last)[1:], "NHWC")
    assert aligned(nhwc).is_contiguous() and torch.equal(aligned(nhwc), nhwc)
