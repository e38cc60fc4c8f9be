"""The shipped recommended config (manifests/examples/flow-control-config.yaml) as a held-out check
uses it: `epp simulate --config <it>` on a flood, where a newcomer must not wait behind the flood."""

from __future__ import annotations

import json
from pathlib import Path

from epp.cli import main
from epp.config.loader import load_config
from epp.datastore import Datastore

CONFIG = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "flow-control-config.yaml"

FLOOD = """
name: small-flood
duration: 6
classes:
- {name: newcomer, rate: 2, start: 0.5, prompt: 400, output: 50, tenants: {count: 100}}
- {name: flood, tenants: [flooder], arrival: {process: burst, count: 150, at: 0}, prompt: 1500, output: 200}
"""


def test_the_recommended_config_loads_with_every_remedy_on() -> None:
    loaded = load_config(CONFIG.read_text(), Datastore())
    assert loaded.warnings == []
    fc = loaded.flow_control_config
    assert fc is not None and fc.vllm_priority and fc.max_num_seqs == 256
    band = fc.band(0)
    assert band.slot_fairness and band.newcomer_reserve == 2 and band.gate.queued_tokens_threshold
    assert fc.band(-1).newcomer_reserve == 0  # batch never passes a closed gate


def test_a_newcomer_does_not_wait_behind_a_flood(tmp_path: Path) -> None:
    workload = tmp_path / "flood.yaml"
    workload.write_text(FLOOD)
    out = tmp_path / "reports.json"
    assert main(["simulate", "--workload", str(workload), "--pods", "1", "--policy", "epp",
                 "--config", str(CONFIG), "--json", str(out)]) == 0
    without = tmp_path / "without.json"
    assert main(["simulate", "--workload", str(workload), "--pods", "1", "--policy", "epp",
                 "--json", str(without)]) == 0

    def p90(path: Path, name: str) -> float:
        [report] = json.loads(path.read_text())["reports"]
        return next(g for g in report["by_class"] if g["name"] == name)["ttft"][1]

    assert p90(out, "newcomer") * 5 < p90(without, "newcomer")  # not behind the flood's backlog
