"""Tiny runs of every benchmark harness: they start, measure, write a report and stop everything.

Only this project's arms run here (Envoy + EPP, Envoy alone), never the peer routers or
inference-perf, and nothing asserts on wall-clock figures.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench import common, cost, metrics_scrape, overhead, routing
from bench.arms import arm
from bench.pods import PodSpec

pytestmark = pytest.mark.e2e


def _no_children_left() -> None:
    assert not common._LIVE, f"processes left running: {[p.args for p in common._LIVE.values()]}"


def test_routing_point_for_each_local_arm_and_report(tmp_path: Path) -> None:
    sc = routing.SCENARIOS["prefix"]
    sc = routing.Scenario(sc.name, sc.title, PodSpec(count=2, num_gpu_blocks=1200, max_num_seqs=8, time_scale=0.2),
                          rates=[6.0], arms=["epp", "envoy-rr"], duration=1.0, warmup=0.2, drain=5.0)
    arms = [arm("epp"), arm("envoy-rr")]
    points = asyncio.run(routing.run(sc, arms, seed=1))
    _no_children_left()
    assert [p.arm for p in points] == ["epp", "envoy-rr"]
    for p in points:
        assert p.sent > 0 and p.ok == p.sent, p
        assert len(p.share) == 2 and p.load_series
    out = tmp_path / "routing-prefix.md"
    text = routing.report(sc, arms, points, [], 1.0, out, 1)
    assert "| 6 | epp |" in text and "| 6 | envoy-rr |" in text and "Headline" in text
    routing.save_points(tmp_path / "routing-prefix.json", sc, points)
    saved = json.loads((tmp_path / "routing-prefix.json").read_text())
    assert [p["arm"] for p in saved["points"]] == ["epp", "envoy-rr"]


def test_routing_cli_rejects_unknown_arms() -> None:
    with pytest.raises(ValueError):
        arm("no-such-router")


@pytest.mark.parametrize("name", ["approximate", "precise", "precise-nospec", "precise-noforesight"])
def test_every_precise_routing_arm_loads(name: str) -> None:
    """The live precise benchmark runs minutes outside `make test`: its configs are checked here."""
    from bench import precise_routing
    from epp.config.loader import load_config
    from epp.datastore import Datastore

    config = load_config(precise_routing.arm_config(name, 5557), Datastore())
    precise = [p for p in config.plugins.values() if p.type == "precise-prefix-cache-producer"]
    if name == "approximate":
        assert not precise
    else:
        (producer,) = precise
        assert producer.config.events.zmq_endpoint == "tcp://127.0.0.1:5557"
        assert producer.config.speculative == (name != "precise-nospec")
        assert producer.config.eviction_foresight == (name != "precise-noforesight")


def test_cost_parts_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cost.md"
    rc = cost.main(["--endpoints", "2", "--duration", "0.3", "--concurrency", "4", "--prompt-requests", "3,1",
                    "--prompt-concurrency", "1", "--scrape-seconds", "0.3", "--settle", "0.2", "--age-samples", "1",
                    "--pick-requests", "10",
                    "--stream-concurrency", "2", "--stream-tokens", "8", "--out", str(out)])
    _no_children_left()
    assert rc == 0
    text = out.read_text()
    for heading in ("Highest request rate", "The pick alone", "CPU per request", "Scraping cost", "token path",
                    "The floor"):
        assert heading in text
    assert "100,000" in text and "shipped" in text and "reference" in text and "process ÷ in-loop" in text
    figures = json.loads(out.with_suffix(".json").read_text())
    assert set(figures) == {"rate", "pick", "prompt", "scrape", "tokens", "floor", "index"}  # bench.summary reads them


def test_overhead_tiny(tmp_path: Path) -> None:
    out = tmp_path / "overhead.md"
    rc = overhead.main(["--duration", "0.3", "--rounds", "1", "--pods", "2", "--rates", "20",
                        "--concurrency", "2", "--out", str(out)])
    _no_children_left()
    assert rc == 0
    assert "envoy + epp (shipped)" in out.read_text() and "envoy + epp (reference)" in out.read_text()


def test_metrics_scrape_tiny(tmp_path: Path) -> None:
    out = tmp_path / "metrics-scrape.md"
    rc = metrics_scrape.main(["--names", "40", "--duration", "0.3", "--rounds", "1", "--concurrency", "2",
                              "--out", str(out)])
    _no_children_left()
    assert rc == 0
    text = out.read_text()
    assert "| quiet |" in text and "| scraped |" in text and "Scraped / quiet" in text
    figures = json.loads((tmp_path / "metrics-scrape.json").read_text())
    assert 0 < figures["metrics_bytes"] < 1 << 20 and figures["scrapes"] > 0
