"""Boundary checks: plain Python values out, TypeError / ValueError naming the field otherwise;
messages stay short whatever the input."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvtier.checks import INT64_MAX, check_bool, check_float, check_int, check_ints, check_strs


def test_messages_stay_short_for_huge_inputs() -> None:
    with pytest.raises(TypeError, match=r"^top_k must be .{0,140}$"):
        check_int("top_k", "x" * 10_000_000)
    with pytest.raises(ValueError, match=r"an integer of \d+ bits"):
        check_int("seed", 10**5000)  # past Python's digit limit for str()


def test_bools_and_floats_are_not_integers() -> None:
    for value in (True, 1.0, "1", None, [1]):
        with pytest.raises(TypeError, match="n must be an integer"):
            check_int("n", value)
    with pytest.raises(ValueError, match="fits 64 bits"):
        check_int("n", INT64_MAX + 1)


def test_floats_must_be_finite_and_in_range() -> None:
    assert check_float("p", 1, lo=0.0, hi=1.0) == 1.0 and type(check_float("p", 1)) is float
    for value in (float("nan"), float("inf"), Fraction(10**400), 10**400):
        with pytest.raises(ValueError, match="p must be a finite number"):
            check_float("p", value)
    with pytest.raises(ValueError, match=r"\(0.0, 1.0\]"):
        check_float("p", 0.0, lo=0.0, hi=1.0, lo_open=True)
    with pytest.raises(TypeError):
        check_float("p", True)


def test_sequences_become_tuples_of_plain_values() -> None:
    np = pytest.importorskip("numpy")
    assert check_ints("ids", np.array([3, 4])) == (3, 4)
    assert all(type(t) is int for t in check_ints("ids", np.array([3, 4])))
    assert check_ints("ids", None) == () and check_ints("ids", range(2)) == (0, 1)
    assert check_ints("ids", [-5], lo=None) == (-5,)
    for value in ("abc", b"ab", {"a": 1}, 7, [1, 2.0], [[1]]):
        with pytest.raises(TypeError, match="ids must be a list of integers"):
            check_ints("ids", value)
    assert check_strs("stop", "a") == ("a",) and check_strs("stop", ["a", "b"]) == ("a", "b")
    with pytest.raises(ValueError, match="empty string"):
        check_strs("stop", [""])
    with pytest.raises(TypeError, match="True or False"):
        check_bool("flag", 1)
