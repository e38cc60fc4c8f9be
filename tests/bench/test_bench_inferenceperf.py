"""Reading inference-perf's reports: stage figures and each stage's time window."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench import inferenceperf


def _stage(count: int, ttft: float) -> dict:  # type: ignore[type-arg]
    lat = {"time_to_first_token": {"median": ttft, "p90": 2 * ttft, "p99": 3 * ttft},
           "inter_token_latency": {"median": 0.01, "p99": 0.05}}
    return {"load_summary": {"count": count}, "successes": {"count": count, "latency": lat,
            "throughput": {"output_tokens_per_sec": 100.0, "requests_per_sec": 2.0}}, "failures": {"count": 0}}


def test_parse_splits_requests_into_stages_by_order(tmp_path: Path) -> None:
    (tmp_path / "stage_0_lifecycle_metrics.json").write_text(json.dumps(_stage(2, 0.1)))
    (tmp_path / "stage_1_lifecycle_metrics.json").write_text(json.dumps(_stage(1, 0.2)))
    records = [{"start_time": t, "end_time": t + 0.5, "error": None} for t in (20.0, 10.0, 11.0)]
    (tmp_path / "per_request_lifecycle_metrics.json").write_text(json.dumps(records))
    stages = inferenceperf.parse(tmp_path, [5.0, 9.0])
    assert [s.rate for s in stages] == [5.0, 9.0]
    assert stages[0].window == (10.0, 11.5) and stages[1].window == (20.0, 20.5)
    assert stages[1].ttft == (0.2, 0.4, 0.6000000000000001)
    assert stages[0].e2e_mean == 0.5


def test_config_is_offline_and_replays_the_trace(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(inferenceperf, "tokenizer_dir", lambda: tmp_path / "tok")
    cfg = inferenceperf.config("http://127.0.0.1:1", tmp_path / "trace.csv", 5.0, tmp_path / "out", seed=3)
    text = yaml.safe_dump(cfg)
    assert "huggingface" not in text
    assert cfg["load"]["type"] == "trace_replay" and len(cfg["load"]["stages"]) == 1  # type: ignore[index]
    assert cfg["load"]["trace"]["file"] == cfg["data"]["trace"]["file"] == str(tmp_path / "trace.csv")  # type: ignore[index]
    assert cfg["tokenizer"]["pretrained_model_name_or_path"] == str(tmp_path / "tok")  # type: ignore[index]


def test_trace_is_the_same_for_every_arm_and_poisson_at_the_rate(tmp_path: Path) -> None:
    """inference-perf's own Poisson timer is unseeded; the trace must not be."""
    rows = inferenceperf.trace(30.0, 40.0, seed=1)
    assert rows == inferenceperf.trace(30.0, 40.0, seed=1)
    assert rows != inferenceperf.trace(30.0, 40.0, seed=2)
    assert 1080 <= len(rows) <= 1320  # 1200 expected; sd ~35
    assert all(0.0 <= t < 40.0 for t, _, _ in rows) and [t for t, _, _ in rows] == sorted(t for t, _, _ in rows)
    prompts = [p for _, p, _ in rows]
    assert min(prompts) >= 32 and max(prompts) <= 6000 and 650 <= sum(prompts) / len(prompts) <= 900
    inferenceperf.write_trace(tmp_path / "t.csv", rows[:2])
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0] == inferenceperf.TRACE_HEADER and len(lines) == 3
    assert lines[1].startswith("2026-01-01 00:00:") and lines[1].endswith(f",{rows[0][1]},{rows[0][2]}")


def test_tokenizer_prompts_weigh_their_nominal_tokens_on_the_pods(tmp_path: Path) -> None:
    """inference-perf decodes random ids of its tokenizer into a prompt of that many tokens: the
    simulated pods must count the same (plus the BOS a completion gets), or every prompt costs
    them more prefill than the scenario says."""
    import random

    from tokenizers import Tokenizer

    from bench import tokenizer
    from epp.sim.tokens import load_tokenizer

    tokenizer.build(str(tmp_path))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    special = {ours.token_to_id(t) for t in tokenizer.SPECIALS.values()}
    ids = [i for i in range(ours.get_vocab_size()) if i not in special]
    pods = load_tokenizer()
    rng = random.Random(4)
    for n in (32, 800, 3000):
        text = ours.decode(rng.choices(ids, k=n))
        assert len(ours.encode(text).ids) == n
        assert n + 1 <= len(pods.encode(text)) <= n + 2  # BOS, and the first word may lack its space
