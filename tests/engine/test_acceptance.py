"""The one acceptance estimator: tracks, forgets, recovers toward its prior."""
from __future__ import annotations

import doctest

import pytest

from specfleet_engine import acceptance
from specfleet_engine.acceptance import Acceptance, window


def test_docstring_examples():
    assert doctest.testmod(acceptance).failed == 0


def test_it_tracks_and_recovers():
    est = Acceptance(prior=0.5)
    for _ in range(10):
        est.observe(4, 0)
    low = est.alpha
    assert low < 0.1
    for _ in range(200):
        est.observe(0, 0)  # steps without a draft: drift back toward the prior
    assert low < est.alpha <= 0.5
    for _ in range(10):
        est.observe(4, 4)
    assert est.alpha > 0.9


def test_a_window_forgets_old_steps_and_reports_rate_and_tau():
    w = window(16, weight=0.0, recover=0.0)
    for _ in range(200):
        w.observe(4, 0)
    for _ in range(200):
        w.observe(4, 2)
    assert w.rate == pytest.approx(0.5, abs=1e-4) and w.tau == pytest.approx(3.0, abs=1e-3)
    for _ in range(200):
        w.observe(0, 0)  # plain steps: one token each, nothing drafted
    assert w.tau == pytest.approx(1.0, abs=1e-3)
    assert w.steps == 400  # verify steps with a draft, not forgotten


def test_the_geometric_alpha_counts_one_rejection_per_step_that_stopped_short():
    est = Acceptance(weight=0.0, decay=1.0)
    est.observe(4, 3)  # 3 accepted, then a rejection
    est.observe(4, 4)  # all accepted: no rejection
    assert est.alpha == pytest.approx(7 / 8) and est.rate == pytest.approx(7 / 8)
    est.observe(4, 0)
    assert est.alpha == pytest.approx(7 / 9) and est.rate == pytest.approx(7 / 12)
