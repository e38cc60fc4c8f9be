"""Workload files, distributions and the request generator of the virtual-time cluster."""

from __future__ import annotations

import random
import re

import pytest

from epp.params import ConfigError
from epp.sim.cluster.dist import parse_dist
from epp.sim.cluster.traffic import Traffic, arrival_times
from epp.sim.cluster.workload import builtin_names, load_workload, parse_workload


def _jobs(text: str, seed: int = 1, pods: int = 2) -> list:
    traffic = Traffic(parse_workload(text), pods=pods, seed=seed, max_model_len=8192)
    out = []
    while (job := traffic.next_arrival()) is not None:
        out.append(job)
    return out


@pytest.mark.parametrize("name", builtin_names())
def test_shipped_workloads_parse(name: str) -> None:
    w = load_workload(name)
    assert w.classes and w.name == name
    w.sim_config().validate()


@pytest.mark.parametrize(("text", "message"), [
    ("classes: []", "workload.classes: at least one class"),
    ("classes: [{name: a}]", "workload.classes[0].rate: give rate or rate_per_pod"),
    ("classes: [{name: a, rate: 1, colour: red}]", "workload.classes[0].colour: unknown field"),
    ("classes: [{name: a, rate: 1, prompt: {dist: zipf}}]", "workload.classes[0].prompt.dist: must be one of"),
    ("classes: [{name: a, rate: 1, prompt: {dist: uniform, min: 5}}]", "uniform needs min and max"),
    ("classes: [{name: a, rate: 1, objective: gold}]", "unknown objective 'gold'"),
    ("classes: [{name: a, arrival: {process: burst}}]", "a burst needs count > 0"),
    ("engine: {max_num_seqs: 0}\nclasses: [{name: a, rate: 1}]", "workload.engine"),
    ("classes: [{name: a, rate: 1}, {name: a, rate: 2}]", "class names must be unique"),
])
def test_bad_workloads_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_workload(text)


def test_unknown_shipped_workload_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="shipped: .*prefix-heavy"):
        load_workload("no-such-workload")


def test_distributions_respect_clamps_and_means() -> None:
    rng = random.Random(3)
    d = parse_dist({"dist": "lognormal", "mean": 400, "sigma": 0.5, "min": 10, "max": 2000}, "x")
    values = [d.sample(rng) for _ in range(20000)]
    assert 10 <= min(values) and max(values) <= 2000
    assert sum(values) / len(values) == pytest.approx(400, rel=0.05)
    choice = parse_dist({"dist": "choice", "values": [1, 100], "weights": [3, 1]}, "x")
    picks = [choice.sample(rng) for _ in range(8000)]
    assert picks.count(1.0) / len(picks) == pytest.approx(0.75, abs=0.03)
    mix = parse_dist({"dist": "mix", "of": [{"weight": 1, "dist": "constant", "value": 5},
                                            {"weight": 1, "dist": "constant", "value": 15}]}, "x")
    assert mix.mean == pytest.approx(10)
    assert parse_dist(7, "x").sample(rng) == 7


def test_arrival_processes() -> None:
    w = parse_workload("""
duration: 100
classes:
- {name: p, rate: 5}
- {name: b, arrival: {process: burst, count: 50, at: 2}}
- {name: o, rate: 10, arrival: {process: onoff, on_for: 1, off_for: 3}}
- {name: g, rate: 5, arrival: {process: gamma, cv: 3}, start: 10, stop: 60}
""")
    times = {c.name: list(arrival_times(c, 1, random.Random(1), w.duration)) for c in w.classes}
    assert len(times["p"]) == pytest.approx(500, rel=0.15)
    assert times["b"] == [2.0] * 50
    assert all(t % 4 < 1 for t in times["o"])  # only in the on windows
    assert len(times["o"]) == pytest.approx(250, rel=0.2)  # rate × on / period
    assert all(10 <= t < 60 for t in times["g"]) and times["g"] == sorted(times["g"])


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    text = """
duration: 5
classes:
- {name: a, rate: 20, prompt: {dist: exponential, mean: 100}, tenants: 3, prefix: {groups: 2, tokens: 64}}
"""
    a, b, c = _jobs(text, seed=1), _jobs(text, seed=1), _jobs(text, seed=2)
    key = [(j.arrival, j.tenant, j.prompt, j.output_tokens) for j in a]
    assert key == [(j.arrival, j.tenant, j.prompt, j.output_tokens) for j in b]
    assert key != [(j.arrival, j.tenant, j.prompt, j.output_tokens) for j in c]


def test_prompts_are_tokens_of_the_tokenizer_and_share_prefixes_as_text() -> None:
    from epp.sim.tokens import load_tokenizer

    jobs = _jobs("""
duration: 10
classes:
- {name: a, rate: 10, prompt: 50, output: 20, prefix: {groups: 1, tokens: 200}}
""")
    tok = load_tokenizer("bpe")
    assert all(j.prompt_tokens == 1 + 200 + 50 for j in jobs)  # BOS, the system prompt, the rest
    assert all(j.prompt_ids == tok.encode(j.prompt) for j in jobs)  # what vLLM would compute
    system = tok.backend.decode(list(jobs[0].prompt_ids[1:201]))
    assert all(j.prompt.startswith(system) for j in jobs)  # one system prompt for all, as text
    assert len({j.prompt[len(system):] for j in jobs}) == len(jobs)  # the rest is unique
    chars_per_token = {len(j.prompt) / j.prompt_tokens for j in jobs}
    assert len(chars_per_token) > 1 and 3.5 < sum(chars_per_token) / len(chars_per_token) < 5


def test_chars4_workloads_keep_the_old_text() -> None:
    jobs = _jobs("""
duration: 10
tokenizer: chars4
classes:
- {name: a, rate: 10, prompt: 50, output: 20, prefix: {groups: 1, tokens: 200}}
""")
    assert all(len(j.prompt) == 4 * j.prompt_tokens for j in jobs)
    assert all(j.prompt_tokens == 250 for j in jobs)
    assert len({j.prompt[:800] for j in jobs}) == 1  # one system prompt for all
    assert len({j.prompt[800:] for j in jobs}) == len(jobs)  # the rest is unique


def test_chat_turns_resend_the_conversation_as_text_and_ids() -> None:
    from epp.sim.generation import token_text
    from epp.sim.request import Request
    from epp.sim.tokens import load_tokenizer

    w = parse_workload("""
duration: 100
classes:
- {name: c, rate: 1, prompt: 40, output: 12, prefix: {groups: 1, tokens: 100},
   chat: {turns: 3, think_time: 0, message: 30}}
""")
    tok = load_tokenizer("bpe")
    traffic = Traffic(w, pods=1, seed=3, max_model_len=8192)
    job = traffic.next_arrival()
    assert job is not None and job.prompt_ids is not None
    turns = [job]
    for turn in range(2):
        job.request = Request(request_id=str(job.id), prompt_len=job.prompt_tokens, block_hashes=[],
                              max_tokens=12, output_len=12, arrival_time=0.0, salt=1000 + turn)
        job.generated, job.finish = 12, 1.0
        nxt = traffic.follow_up(job, 1.0)
        assert nxt is not None and nxt.prompt_ids is not None
        reply = token_text(job.request.salt, 0, 12, tok.output_vocab)
        # A turn's prompt ends with the assistant's header, so the next one re-sends this turn's
        # whole sequence (prompt, then reply) before its own message.
        assert job.prompt.endswith(" Assistant:")
        assert nxt.prompt.startswith(job.prompt + reply + " User:") and nxt.prompt.endswith(" Assistant:")
        assert nxt.prompt_ids[:job.prompt_tokens] == job.prompt_ids
        assert nxt.prompt_ids == tok.encode(nxt.prompt)
        assert nxt.prompt_tokens == job.prompt_tokens + 12 + len(tok.encode(" User:", False)) + 30 + \
            len(tok.encode(" Assistant:", False))
        turns.append(nxt)
        job = nxt


def test_unknown_tokenizer_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="workload.tokenizer: .*not one of bpe, tiny, chars4"):
        parse_workload("tokenizer: gpt-17\nclasses: [{name: a, rate: 1}]")


def test_class_fields_reach_the_requests() -> None:
    jobs = _jobs("""
duration: 20
objectives: {gold: 5}
classes:
- name: a
  rate: 5
  objective: gold
  max_tokens: 999
  output: 10
  tenants: {names: [x, y], weights: [1, 0]}
  lora: {adapters: [l1, l2], weights: [0, 1], base: 0}
""")
    assert {j.tenant for j in jobs} == {"x"}
    assert {j.lora for j in jobs} == {"l2"}
    assert {j.max_tokens for j in jobs} == {999} and {j.output_tokens for j in jobs} == {10}
    w = parse_workload("objectives: {gold: 5}\nclasses: [{name: a, rate: 1, objective: gold}, "
                       "{name: b, rate: 1, priority: -2}]")
    assert w.all_objectives() == {"gold": 5, "b": -2}
    assert w.sim_config().lora_adapters == ()


def test_requests_cap_and_context_window() -> None:
    w = parse_workload("duration: 100\nmax_requests: 7\nclasses: [{name: a, rate: 50, prompt: 20000, output: 100}]")
    traffic = Traffic(w, pods=1, seed=1, max_model_len=8192)
    jobs = []
    while (job := traffic.next_arrival()) is not None:
        jobs.append(job)
    assert len(jobs) == 7
    assert all(j.prompt_tokens + j.output_tokens < 8192 for j in jobs)


def test_rate_per_pod_scales_with_the_pool_and_scaled_multiplies() -> None:
    w = parse_workload("duration: 50\nclasses: [{name: a, rate_per_pod: 2}]")
    n4 = len(list(arrival_times(w.classes[0], 4, random.Random(1), w.duration)))
    n1 = len(list(arrival_times(w.classes[0], 1, random.Random(1), w.duration)))
    assert n4 == pytest.approx(4 * n1, rel=0.2)
    doubled = w.scaled(rate=2.0, duration=10)
    assert doubled.classes[0].arrival.rate_per_pod == 4 and doubled.duration == 10
