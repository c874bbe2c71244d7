"""The one dependency rule: what F, B, I and W wait for, where their results go, how long activations live."""

from pipedp.pipeline.deps import grad_kinds, needs, peaks, sends
from pipedp.pipeline.schedule import Action

F, B, I, W = (lambda i, k=k: Action(k, i) for k in "FBIW")


def test_a_forward_waits_for_the_previous_stage_and_a_backward_for_the_next_stages_input_gradient():
    assert needs(0, F(3), 4) == [] and needs(2, F(3), 4) == [(1, F(3))]
    assert needs(3, B(1), 4) == [(3, F(1))]  # the last stage: its own loss
    assert needs(1, B(1), 4) == [(1, F(1)), (2, B(1))]
    # where the next stage splits its backward, its I makes the gradient; a W waits for its own I only
    assert needs(1, I(1), 4, {(2, 1)}) == [(1, F(1)), (2, I(1))]
    assert needs(1, B(1), 4, {(2, 1)}) == [(1, F(1)), (2, I(1))]
    assert needs(2, W(1), 4) == [(2, I(1))]


def test_results_go_forward_from_f_and_back_from_b_or_i_but_not_from_w():
    assert sends(0, F(0), 3) == 1 and sends(2, F(0), 3) is None
    assert sends(2, B(0), 3) == 1 and sends(1, I(0), 3) == 0 and sends(0, I(0), 3) is None
    assert sends(1, W(0), 3) is None


def test_split_backwards_are_found_and_activations_live_until_b_or_w():
    assert grad_kinds([(0, F(0)), (0, I(0)), (1, B(0)), (0, W(0))]) == {(0, 0)}
    assert peaks([[F(0), F(1), B(0), B(1)], [F(0), I(0), F(1), W(0), I(1), W(1)]]) == (2, 2)
