"""The streaming client against one in-process simulated pod: tokens, TTFT, ITL, user turns."""

from __future__ import annotations

import math

from bench.client import replay
from bench.workloads import CHAT, COMPLETION, Planned
from epp.sim.config import SimConfig
from epp.sim.server import start_pods, stop_pods


async def test_replay_times_every_token_and_orders_a_users_turns() -> None:
    pods = await start_pods(1, config=SimConfig(time_scale=0.02))
    try:
        plan = [
            Planned(0.0, COMPLETION, {"prompt": "abc " * 50, "max_tokens": 8, "ignore_eos": True}, "a"),
            Planned(0.0, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                "ignore_eos": True}, "turn", user=7),
            Planned(0.01, CHAT, {"messages": [{"role": "user", "content": "again"}], "max_tokens": 5,
                                 "ignore_eos": True}, "turn", user=7),
        ]
        result = await replay(pods[0].url, pods[0].config.model, plan, duration=2.0, drain=5.0)
    finally:
        await stop_pods(pods)
    assert result.not_sent == 0
    by_kind = {o.kind: o for o in result.outcomes}
    assert all(o.ok for o in result.outcomes), result.outcomes
    assert by_kind["a"].tokens == 8 and len(by_kind["a"].itls) == 7
    assert not math.isnan(by_kind["a"].ttft) and by_kind["a"].ttft <= by_kind["a"].e2e
    first, second = [o for o in result.outcomes if o.kind == "turn"]
    assert first.tokens == second.tokens == 5
    assert second.sent >= first.sent + first.e2e - 1e-3  # the second turn waited for the first


async def test_a_dead_server_is_counted_as_errors() -> None:
    plan = [Planned(0.0, COMPLETION, {"prompt": "x", "max_tokens": 1}, "a")]
    result = await replay("http://127.0.0.1:9", "m", plan, duration=0.5, drain=1.0)
    assert len(result.outcomes) == 1 and not result.outcomes[0].ok
