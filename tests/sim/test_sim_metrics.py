"""The simulator's /metrics text against the real vLLM 0.32 captures: names, types, HELP, labels."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.driver import run
from epp.sim.engine import Engine
from epp.sim.exposition import Exposition, go_float
from epp.sim.factory import RequestFactory
from epp.sim.metrics import VllmMetrics

_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Family:
    type: str = ""
    help: str = ""
    # sample name -> label names in order of appearance (one entry per distinct ordering)
    label_names: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def parse(text: str) -> dict[str, Family]:
    fams: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            current = fams.setdefault(name, Family())
            current.help = help_
        elif line.startswith("# TYPE "):
            name, _, type_ = line[7:].partition(" ")
            current = fams.setdefault(name, Family())
            current.type = type_
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"unparsable sample line: {line!r}"
            assert current is not None
            labels = dict(_LABEL.findall(m.group(2) or ""))
            current.label_names.setdefault(m.group(1), set()).add(tuple(labels))
            current.samples.append((m.group(1), labels, float(m.group(3))))
    return fams


def vllm_only(fams: dict[str, Family]) -> dict[str, Family]:
    return {k: v for k, v in fams.items() if k.startswith("vllm:")}


def render_after_traffic(**engine_kw: object) -> tuple[str, Engine, list]:
    lora = engine_kw.pop("lora", False)
    cfg = SimConfig(model="tiny", lora_adapters=("ad1", "ad2") if lora else (),
                    engine=EngineConfig(**engine_kw))  # type: ignore[arg-type]
    eng = Engine(cfg.engine)
    f = RequestFactory(cfg)
    metrics = VllmMetrics(cfg.engine.max_model_len)
    expo = Exposition(cfg.model, cfg.engine, created=1795944237.6778946, lora_enabled=lora)
    shared = "w0 w1 w2 w3 w4 w5 w6 w7 " * 40
    reqs = [f.from_text(shared + f"unique {i}", max_tokens=20, ignore_eos=True, arrival_time=0.01 * i,
                        lora=("ad1" if i % 2 else None) if lora else None) for i in range(10)]

    def on_step(step: object) -> None:
        metrics.record_step(step)  # type: ignore[arg-type]
        if lora:
            s = eng.snapshot()
            metrics.record_lora(s.running_loras, s.waiting_loras, 1795944300.0 + eng.num_steps)

    run(eng, reqs, on_step=on_step)
    return expo.render(eng, metrics), eng, reqs


REQUIRED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc", "vllm:cache_config_info", "vllm:lora_requests_info",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prefix_cache_queries_created", "vllm:time_to_first_token_seconds_created",
]


@pytest.fixture(scope="module")
def fixture_families(vllm_fixtures: Path) -> dict[str, dict[str, Family]]:
    return {name: vllm_only(parse((vllm_fixtures / f"metrics-{name}.txt").read_text()))
            for name in ("idle", "busy", "after", "priority")}


def test_sim_emits_every_required_family() -> None:
    text, _, _ = render_after_traffic(lora=True, max_loras=1, max_model_len=1024)
    fams = parse(text)
    missing = [n for n in REQUIRED if n not in fams]
    assert not missing


def test_exposition_is_valid_prometheus_text() -> None:
    text, _, _ = render_after_traffic(lora=True, max_loras=2)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "vllm:num_requests_running" in names and "vllm:lora_requests_info" in names


@pytest.mark.parametrize("capture", ["idle", "busy", "after", "priority"])
def test_families_match_the_real_capture(capture: str,
                                         fixture_families: dict[str, dict[str, Family]]) -> None:
    real = fixture_families[capture]
    text, _, _ = render_after_traffic(lora=True, max_loras=1, max_model_len=1024)
    sim = vllm_only(parse(text))
    # Every vLLM family the real server shows, the simulator shows too ...
    assert sorted(set(real) - set(sim)) == []
    # ... and the only extra one is the LoRA family real vLLM adds when LoRA is enabled.
    assert sorted(set(sim) - set(real)) == ["vllm:lora_requests_info"]
    for name, fam in real.items():
        mine = sim[name]
        assert mine.type == fam.type, name
        assert mine.help == fam.help, name
        assert mine.label_names == fam.label_names, name


def test_enumerated_label_values_and_buckets_match(
        fixture_families: dict[str, dict[str, Family]]) -> None:
    real = fixture_families["busy"]
    text, _, _ = render_after_traffic(max_model_len=1024)
    sim = vllm_only(parse(text))
    for name, fam in real.items():
        if name == "vllm:cache_config_info":
            continue
        real_keys = [(s, {k: v for k, v in lab.items() if k != "model_name"}) for s, lab, _ in fam.samples]
        sim_keys = [(s, {k: v for k, v in lab.items() if k != "model_name"})
                    for s, lab, _ in sim[name].samples]
        assert sim_keys == real_keys, name  # same series (incl. le buckets), same order


def test_cache_config_info_has_the_real_label_set_and_our_geometry(
        fixture_families: dict[str, dict[str, Family]]) -> None:
    text, _, _ = render_after_traffic(num_gpu_blocks=1234, block_size=16)
    info = parse(text)["vllm:cache_config_info"].samples
    real = fixture_families["idle"]["vllm:cache_config_info"].samples
    assert len(info) == 1 and info[0][2] == 1.0
    assert list(info[0][1]) == list(real[0][1])
    assert info[0][1]["block_size"] == "16" and info[0][1]["num_gpu_blocks"] == "1234"
    assert info[0][1]["enable_prefix_caching"] == "True"


def test_values_agree_with_the_engine() -> None:
    text, eng, reqs = render_after_traffic(lora=True, max_loras=1)
    fams = parse(text)

    def value(name: str, **labels: str) -> float:
        hits = [v for fam in fams.values() for s, lab, v in fam.samples
                if s == name and all(lab.get(k) == w for k, w in labels.items())]
        assert len(hits) == 1, (name, labels)
        return hits[0]

    n = len(reqs)
    assert value("vllm:num_requests_running") == 0.0
    assert value("vllm:kv_cache_usage_perc") == 0.0
    assert value("vllm:request_success_total", finished_reason="length") == n
    assert value("vllm:generation_tokens_total") == 20 * n
    assert value("vllm:prompt_tokens_total") == sum(r.prompt_len for r in reqs)
    assert value("vllm:prefix_cache_hits_total") == eng.kv.hits > 0
    assert value("vllm:prefix_cache_queries_total") == eng.kv.queries
    assert value("vllm:prompt_tokens_cached_total") == eng.kv.hits
    assert value("vllm:time_to_first_token_seconds_count") == n
    assert value("vllm:e2e_request_latency_seconds_count") == n
    assert value("vllm:inter_token_latency_seconds_count") == 19 * n
    e2e = value("vllm:e2e_request_latency_seconds_sum")
    assert e2e == pytest.approx(sum(r.e2e for r in reqs))
    inf = value("vllm:time_to_first_token_seconds_bucket", le="+Inf")
    assert inf == n
    lora = fams["vllm:lora_requests_info"].samples
    assert {lab["max_lora"] for _, lab, _ in lora} == {"1"}
    assert any(lab["running_lora_adapters"] == "ad1" for _, lab, _ in lora)
    assert max(v for _, _, v in lora) == 1795944300.0 + eng.num_steps


def test_go_float_formatting_matches_prometheus_client() -> None:
    assert go_float(4.0) == "4.0"
    assert go_float(0.2222222222222222) == "0.2222222222222222"
    assert go_float(1795944237.6778946) == "1.7959442376778946e+09"
    assert go_float(float("inf")) == "+Inf"
    assert go_float(2560) == "2560.0"
