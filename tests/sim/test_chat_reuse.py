"""A chat's next turn re-sends the reply: on vLLM it hits the reply's cached blocks too, so the
simulator's generated blocks must carry the ids of the text it sent back."""

from __future__ import annotations

from epp.sim.cluster.traffic import Traffic
from epp.sim.cluster.workload import parse_workload
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.engine import Engine
from epp.sim.factory import RequestFactory


def run(engine: Engine, req) -> None:  # type: ignore[no-untyped-def]
    engine.add_request(req)
    now = 0.0
    while engine.has_unfinished():
        out = engine.schedule(now)
        assert out is not None
        engine.update(out)
        now = out.end_time


def test_the_next_turn_hits_the_previous_turns_prompt_and_reply() -> None:
    workload = parse_workload("""
name: chat
duration: 60
classes:
- name: chat
  rate: 1
  prompt: 300
  output: 200
  chat: {turns: 3, think_time: 1, message: 50}
""")
    config = SimConfig(engine=EngineConfig(block_size=16))
    factory = RequestFactory(config)
    engine = Engine(config.engine)
    traffic = Traffic(workload, pods=1, seed=1, max_model_len=config.engine.max_model_len,
                      tokenizer=factory.tokenizer)
    job = traffic.next_arrival()
    assert job is not None
    first = factory.from_token_ids(job.prompt_ids, max_tokens=job.output_tokens, ignore_eos=True)
    run(engine, first)
    job.request, job.generated, job.finish = first, first.num_output_tokens, 1.0
    follow = traffic.follow_up(job, 2.0)
    assert follow is not None
    sequence = len(first.prompt_token_ids) + first.num_output_tokens
    assert list(follow.prompt_ids[:len(first.prompt_token_ids)]) == list(first.prompt_token_ids)
    second = factory.from_token_ids(follow.prompt_ids, max_tokens=8, ignore_eos=True)
    run(engine, second)
    # Every full block of the first turn's prompt and reply was reused.
    assert second.num_cached_tokens == (sequence // 16) * 16
