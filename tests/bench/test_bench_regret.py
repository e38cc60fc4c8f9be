"""`bench.regret`: each pick weighed by the greedy oracle's own estimate, in virtual time."""

from __future__ import annotations

from bench.regret import REGRET_SECONDS, measure, report


def test_the_oracle_has_no_regret_and_a_blind_policy_has_some() -> None:
    oracle = measure("head-of-line", "4", policy="greedy-oracle", duration=5.0)
    assert sum(len(c.regrets) for c in oracle) > 100
    assert all(r <= 1e-6 for c in oracle for r in c.regrets)  # (its ranking rounds to the microsecond)
    blind = measure("head-of-line", "4", policy="round-robin", duration=5.0)
    assert sum(len(c.regrets) for c in blind) == sum(len(c.regrets) for c in oracle)  # the same requests
    assert max(r for c in blind for r in c.regrets) > REGRET_SECONDS
    assert all(c.overridden == c.mispredicted == 0 for c in blind)  # no prediction to tell them apart


def test_the_epps_regrets_over_the_threshold_are_each_overridden_or_mispredicted() -> None:
    classes = measure("head-of-line", "4", duration=5.0, rate_scale=1.3)
    over = sum(1 for c in classes for r in c.regrets if r > REGRET_SECONDS)
    assert over == sum(c.overridden + c.mispredicted for c in classes)
    assert all(r >= 0.0 for c in classes for r in c.regrets)
    text = report(classes)
    assert text.splitlines()[0].startswith("| class | picks |") and "| short |" in text and "| long |" in text
