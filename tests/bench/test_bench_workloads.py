"""The benchmark workloads are deterministic and shaped as their docstrings say."""

from __future__ import annotations

from bench.workloads import BUILDERS, CHAT, balance, head_of_line, prefix_heavy


def test_same_seed_same_plan() -> None:
    for build in BUILDERS.values():
        a, b = build(5.0, 4.0, 3).plan, build(5.0, 4.0, 3).plan
        assert [(p.at, p.body) for p in a] == [(p.at, p.body) for p in b]
        assert all(0 <= p.at < 4.0 for p in a)


def test_prefix_heavy_users_share_system_prompts_and_keep_history() -> None:
    plan = prefix_heavy(20.0, 10.0, seed=1, groups=3, users_per_group=2).plan
    assert all(p.path == CHAT and p.user is not None for p in plan)
    systems = {p.body["messages"][0]["content"] for p in plan}  # type: ignore[index]
    assert len(systems) == 3
    by_user: dict[int, list[int]] = {}
    for p in plan:
        by_user.setdefault(p.user, []).append(len(p.body["messages"]))  # type: ignore[arg-type]
    # Later turns carry the earlier ones (until the history is trimmed).
    assert any(lengths[1] > lengths[0] for lengths in by_user.values() if len(lengths) > 1)


def test_balance_prompts_vary_and_hol_has_a_few_long_generations() -> None:
    sizes = [len(p.body["prompt"]) for p in balance(50.0, 10.0).plan]  # type: ignore[arg-type]
    assert max(sizes) > 4 * min(sizes)
    plan = head_of_line(50.0, 10.0).plan
    kinds = [p.kind for p in plan]
    assert 0 < kinds.count("long") < kinds.count("short") / 5
    assert min(p.body["max_tokens"] for p in plan if p.kind == "long") > 8 * max(  # type: ignore[operator]
        p.body["max_tokens"] for p in plan if p.kind == "short")
