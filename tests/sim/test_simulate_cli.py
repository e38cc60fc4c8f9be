"""`epp simulate` end to end (tiny sizes), and the virtual-time benchmarks' smoke runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from epp.cli import main

WORKLOAD = """
name: tiny
duration: 3
warmup: 0.5
classes:
- {name: chat, rate: 4, prompt: 200, output: 30, tenants: 2, prefix: {groups: 2, tokens: 300}}
- {name: batch, rate: 2, priority: -1, prompt: 600, output: 60}
"""


def _matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("matplotlib is missing in CI: install the `sim` extra")
        return False
    return True


def test_simulate_prints_a_table_and_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "out.json"
    args = ["simulate", "--workload", str(workload), "--pods", "2", "--policy", "all", "--seed", "3",
            "--json", str(out)]
    plots = _matplotlib()
    if plots:
        args += ["--plots", str(tmp_path / "plots")]
    assert main(args) == 0
    text = capsys.readouterr().out
    for name in ("epp", "random", "round-robin", "least-queue", "oracle", "per class", "chat", "batch"):
        assert name in text
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["reports"]] == ["epp", "random", "round-robin", "least-queue", "greedy-oracle"]
    assert all(r["ok"] == r["requests"] > 0 for r in data["reports"])
    if plots:
        assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
            "class-ttft.png", "latency.png", "pod-load.png", "queues.png", "ttft-cdf.png"]


def test_simulate_compares_configs_and_uses_shipped_workloads(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fc.yaml"
    from epp.config.defaults import DEFAULT_CONFIG

    config.write_text(DEFAULT_CONFIG + "featureGates: [flowControl]\nflowControl: {}\n")
    default = tmp_path / "default.yaml"
    default.write_text(DEFAULT_CONFIG)
    assert main(["simulate", "--workload", "mixed", "--pods", "2", "--duration", "2", "--config", str(default),
                 "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "epp:default" in text and "epp:fc" in text and "(flow control on)" in text
    assert main(["simulate", "--list-workloads"]) == 0
    assert "prefix-heavy" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    ([], "--workload is required"),
    (["--workload", "nope"], "no workload file or shipped workload named 'nope'"),
    (["--workload", "mixed", "--policy", "fastest"], "unknown policy 'fastest'"),
    (["--workload", "mixed", "--pods", "0"], "--pods must be >= 1"),
    (["--workload", "mixed", "--tokenizer", "gpt-17"], "--tokenizer: tokenizer 'gpt-17': not one of bpe"),
])
def test_simulate_errors_are_clear(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("tokenizer", ["bpe", "tiny", "chars4"])
def test_simulate_with_each_tokenizer(tokenizer: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "out.json"
    assert main(["simulate", "--workload", str(workload), "--pods", "2", "--policy", "epp,round-robin",
                 "--tokenizer", tokenizer, "--json", str(out)]) == 0
    assert f"tokenizer {tokenizer}" in capsys.readouterr().err
    reports = json.loads(out.read_text())["reports"]
    assert all(r["ok"] == r["requests"] > 0 for r in reports)


def test_simulate_rejects_an_invalid_picker_config_with_its_path(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins: 3\n")
    assert main(["simulate", "--workload", "mixed", "--config", str(bad)]) == 2
    assert "plugins" in capsys.readouterr().err


def test_flowcontrol_bench_smoke(tmp_path: Path) -> None:
    from bench import flowcontrol

    assert flowcontrol.main(["--tiny", "--jobs", "1", "--out", str(tmp_path),
                             *([] if _matplotlib() else ["--no-plots"])]) == 0
    text = (tmp_path / "flowcontrol.md").read_text()
    for section in ("## Flood", "## Overload (2× capacity)", "## No overload (½× capacity)", "round robin"):
        assert section in text


def test_scale_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import scale

    assert scale.main(["--tiny", "--pools", "2", "--workloads", "load-balancing", "--jobs", "1", "--out",
                       str(tmp_path)]) == 0
    text = (tmp_path / "scale.md").read_text()
    assert "within the bars" in text and "## load-balancing, 2 pods" in text
    for policy in ("**epp**", "epp-weighted", "round-robin", "least-queue", "greedy-oracle"):
        assert policy in text

    # The default alone against that report: the same requests, so the same figures.
    report = scale.read_summary(tmp_path / "scale.md")
    (case,) = report.values()
    capsys.readouterr()
    assert scale.main(["--tiny", "--pools", "2", "--workloads", "load-balancing", "--jobs", "1", "--against",
                       str(tmp_path / "scale.md")]) == 0
    out = capsys.readouterr().out
    assert f"on {int(case.within)} of 1 cases" in out  # unchanged: the report's own verdict
    assert f"{case.p90:,.0f} → {case.p90:,.0f}" in out and f"{case.p99:,.0f} → {case.p99:,.0f}" in out


def test_scale_bench_runs_every_pool_for_the_duration_asked(tmp_path: Path) -> None:
    """`--duration` sets the seconds of arrivals on every pool (a 100-pod pool's default is 20 s,
    too short for a choice whose cost comes late), and the report says how it was run."""
    from bench import scale

    assert scale.main(["--pools", "2", "--workloads", "load-balancing", "--duration", "3", "--warmup", "0.5",
                       "--jobs", "1", "--out", str(tmp_path), "--report", "long.md"]) == 0
    text = (tmp_path / "long.md").read_text()
    assert "--duration 3 --warmup 0.5 --report long.md" in text and "## load-balancing, 2 pods" in text
    with pytest.raises(SystemExit):
        scale.main(["--pools", "2", "--duration", "3", "--warmup", "3", "--out", str(tmp_path)])


def test_precise_virtual_bench_smoke(tmp_path: Path) -> None:
    from bench import precise_virtual

    assert precise_virtual.main(["--tiny", "--jobs", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "precise-virtual.md").read_text()
    assert "## b2b-shared-context (KV demand ~0.7)" in text and "## b2b-kv-pressure (KV demand ~1.5)" in text
    for policy in ("**epp**", "epp-precise", "round-robin", "greedy-oracle"):
        assert policy in text
    # the precise arm's index heard the engines' events: its accuracy is a number, not a dash
    precise_row = next(line for line in text.splitlines() if line.startswith("| epp-precise"))
    assert "%" in precise_row.split("|")[9]
