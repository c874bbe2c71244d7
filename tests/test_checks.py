"""Value checks: bools are not ints, numbers must be finite, errors name the option."""

import math

import pytest

from pipedp.checks import non_negative_int, one_of, positive_int, positive_number


@pytest.mark.parametrize("v", [0, -1, True, 1.0, "2", None])
def test_positive_int_rejects(v):
    with pytest.raises(ValueError, match=r"depth must be a positive int, got"):
        positive_int("depth", v)


def test_accepted_values_come_back():
    assert positive_int("n", 3) == 3 and non_negative_int("n", 0) == 0
    assert positive_number("t", 2) == 2.0 and isinstance(positive_number("t", 2), float)
    assert one_of("mode", "b", ("a", "b")) == "b"


@pytest.mark.parametrize("v", [0, -0.5, math.inf, math.nan, False, "1"])
def test_positive_number_rejects(v):
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds"):
        positive_number("timeout", v, "seconds")


def test_non_negative_int_and_one_of_reject():
    with pytest.raises(ValueError, match="measure_steps must be an int >= 0"):
        non_negative_int("measure_steps", -1)
    with pytest.raises(ValueError, match=r"mode must be one of \('a', 'b'\), got 'c'"):
        one_of("mode", "c", ("a", "b"))
