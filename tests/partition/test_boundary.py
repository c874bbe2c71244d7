import torch

from pipedp.partition.boundary import is_value, leaf, map_tensors, nbytes, tensors


def test_a_tensor_and_a_tuple_of_tensors_are_values_and_nothing_else_is():
    t = torch.zeros(2)
    assert is_value(t) and is_value((t, t)) and not is_value(()) and not is_value((t, 3)) and not is_value([t])
    assert tensors(t) == (t,) and tensors((t, t)) == (t, t)


def test_leaf_detaches_and_flags_only_floating_point_tensors():
    a = torch.ones(2, requires_grad=True) * 2
    i = torch.arange(3)
    got = leaf((a, i), True)
    assert got[0].is_leaf and got[0].requires_grad and not got[1].requires_grad
    assert got[0].data_ptr() == a.data_ptr()  # no copy
    mixed = leaf((a, a), [False, True])
    assert [t.requires_grad for t in mixed] == [False, True]
    assert not leaf(a, False).requires_grad


def test_map_keeps_the_structure_and_nbytes_counts_every_tensor():
    t = torch.zeros(2, 3)
    assert isinstance(map_tensors(t, torch.clone), torch.Tensor)
    assert isinstance(map_tensors((t,), torch.clone), tuple)
    assert nbytes((t, torch.zeros(4, dtype=torch.float64))) == 24 + 32
