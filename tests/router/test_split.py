"""The request-level split: a 1% canary gets 1% of requests, sessions stick to one arm."""
from __future__ import annotations

import doctest
import math
import random

from specfleet_router import split
from specfleet_router.split import CANARY, STABLE, arm_for, basis_points


def binomial_interval(n: int, p: float, z: float = 3.29) -> tuple[float, float]:
    """The normal approximation's two-sided 99.9% interval for a count."""
    sd = math.sqrt(n * p * (1 - p))
    return n * p - z * sd, n * p + z * sd


def test_docstring_examples():
    assert doctest.testmod(split).failed == 0


def test_one_percent_of_anonymous_and_of_session_requests_go_to_the_canary():
    rng = random.Random(7)
    n = 10_000
    lo, hi = binomial_interval(n, 0.01)
    anonymous = sum(arm_for(None, 1.0, rng) == CANARY for _ in range(n))
    sessions = sum(arm_for(f"session-{i}", 1.0) == CANARY for i in range(n))
    assert lo <= anonymous <= hi and lo <= sessions <= hi, (anonymous, sessions, lo, hi)


def test_a_session_sticks_to_one_arm_and_moves_only_up_with_the_weight():
    arms = {s: arm_for(s, 5.0) for s in (f"user-{i}" for i in range(500))}
    assert all(arm_for(s, 5.0) == a for s, a in arms.items())
    assert all(arm_for(s, 50.0) == CANARY for s, a in arms.items() if a == CANARY)  # a canary session stays


def test_weights_have_two_decimals_and_the_ends_are_exact():
    assert basis_points(0.01) == 1 and basis_points(33.33) == 3333 and basis_points(120) == 10_000
    assert arm_for("x", 0) == STABLE and arm_for(None, 100) == CANARY
