"""Heterogeneous pools (`--pods 8:h100,8:a100:max_num_seqs=64`), the calibrated step-time model
and the range it is valid in, and the greedy oracle's attention term."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from epp.cli import main
from epp.sim import cli as sim_cli
from epp.sim.cluster.cluster import Cluster
from epp.sim.cluster.routers import OracleRouter, reference_router
from epp.sim.cluster.simulate import expand_policies, run_policy, simulate
from epp.sim.cluster.workload import parse_workload
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.driver import run
from epp.sim.engine import Engine
from epp.sim.factory import RequestFactory
from epp.sim.pool import PodGroup, engine_configs, parse_pods
from epp.sim.steptime import StepTimeModel, kv_capacity_blocks

TINY = """
name: tiny
duration: 3
classes:
- {name: a, rate: 20, prompt: 300, output: 30, prefix: {groups: 2, tokens: 200}}
"""


# ---------------------------------------------------------------- pod specs

def test_a_plain_count_keeps_the_base_configuration() -> None:
    assert parse_pods("16") == [PodGroup(16)]
    assert parse_pods(3) == [PodGroup(3)]
    base = EngineConfig(num_gpu_blocks=5000, max_num_seqs=8)
    cfgs = engine_configs(parse_pods("3"), base)
    assert len(cfgs) == 3 and all(c == base and c is not base for c in cfgs)


def test_groups_take_their_profiles_capacity_and_settings() -> None:
    groups = parse_pods(" 2:h100 , 1:a100-llama3-8b:max_num_seqs=64:scheduling_policy=priority,"
                        "1:a100:num_gpu_blocks=900:enable_prefix_caching=false,1:h100:block_size=32")
    assert [g.count for g in groups] == [2, 1, 1, 1]
    assert groups[1] == PodGroup(1, "a100-llama3-8b", (("max_num_seqs", 64), ("scheduling_policy", "priority")))
    cfgs = engine_configs(groups, EngineConfig(num_gpu_blocks=1000))
    assert [c.step_profile for c in cfgs] == ["h100-llama3-8b"] * 2 + ["a100-llama3-8b"] * 2 + ["h100-llama3-8b"]
    assert [c.num_gpu_blocks for c in cfgs] == [28275, 28275, 28437, 900, 28275 // 2]
    assert cfgs[2].max_num_seqs == 64 and cfgs[2].scheduling_policy == "priority"
    assert cfgs[0].max_num_seqs == 256 and not cfgs[3].enable_prefix_caching
    assert kv_capacity_blocks("h100-llama3-8b", 32) * 32 == 28275 * 16 // 32 * 32


def test_an_explicit_capacity_is_kept_by_every_profile() -> None:
    """A KV capacity the run gave explicitly (a workload's `engine`, `epp sim --num-gpu-blocks`) is
    a statement about the deployment; a GPU profile's default does not undo it (in tokens, when a
    group changes the block size), and a group's own setting still wins."""
    groups = parse_pods("1:h100,1:a100,1,1:a100:num_gpu_blocks=900,1:h100:block_size=32")
    cfgs = engine_configs(groups, EngineConfig(num_gpu_blocks=1000), explicit=("num_gpu_blocks",))
    assert [c.num_gpu_blocks for c in cfgs] == [1000, 1000, 1000, 900, 500]
    assert [c.step_profile for c in cfgs][:2] == ["h100-llama3-8b", "a100-llama3-8b"]


def test_a_workloads_capacity_holds_on_a_mixed_pool() -> None:
    """The B2B workloads size the KV cache to put it under pressure; on `8:h100,8:a100` the pods
    used to get the profiles' 28k blocks instead, and the KV pressure was gone."""
    sized = parse_workload(TINY + "engine: {num_gpu_blocks: 3000}\n")
    cluster = Cluster(sized, reference_router("round-robin"), pods="1:h100,1:a100")
    assert [c.num_gpu_blocks for c in cluster.pod_configs] == [3000, 3000]
    plain = Cluster(parse_workload(TINY), reference_router("round-robin"), pods="1:h100,1:a100")
    assert [c.num_gpu_blocks for c in plain.pod_configs] == [28275, 28437]


@pytest.mark.parametrize(("spec", "message"), [
    ("", "empty"),
    ("x", "starts with a pod count"),
    ("0", "--pods must be >= 1"),
    ("4,-1", "--pods must be >= 1"),
    ("8:h200", "unknown step-time profile 'h200'; known: a100-llama3-8b, h100-llama3-8b"),
    ("8:h100:foo=1", "unknown setting 'foo'"),
    ("8:h100:max_num_seqs=many", "'many' is not an integer"),
    ("8:h100:max_num_seqs=4:max_num_seqs=5", "max_num_seqs given twice"),
    ("8:max_num_seqs=4:h100", "the profile comes right after the count"),
    ("8:h100:enable_prefix_caching=maybe", "not a boolean"),
    ("20000", "more than 10000"),
])
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_pods(spec)


def test_settings_are_validated_per_group() -> None:
    with pytest.raises(ValueError, match=r"group 2:a100-llama3-8b:scheduling_policy=lifo: unknown scheduling_policy"):
        engine_configs(parse_pods("2:a100:scheduling_policy=lifo"), EngineConfig())
    with pytest.raises(ValueError, match="KV cache must hold"):
        engine_configs(parse_pods("1:num_gpu_blocks=10"), EngineConfig())


# ---------------------------------------------------------------- virtual-time cluster

def test_a_mixed_pool_runs_each_pod_on_its_own_gpu() -> None:
    """Round-robin over 2 H100 and 2 A100 pods: the same requests take the A100s (slower per
    token, calibrated separately) longer; each pod reports its shape."""
    w = parse_workload(TINY)
    rep = run_policy(w, "round-robin", pods="2:h100,2:a100")
    assert rep.ok == rep.requests > 0
    cluster = Cluster(w, reference_router("round-robin"), pods="2:h100,2:a100")
    result = cluster.run()
    shapes = [p.shape for p in result.pod_stats]
    assert shapes == ["h100-llama3-8b"] * 2 + ["a100-llama3-8b"] * 2
    assert result.pool == "2 x h100-llama3-8b, 2 x a100-llama3-8b" and result.pods == 4
    h100 = sum(p.busy_time for p in result.pod_stats[:2])
    a100 = sum(p.busy_time for p in result.pod_stats[2:])
    assert a100 > 1.15 * h100
    assert [pod.engine.config.num_gpu_blocks for pod in cluster.pods] == [28275] * 2 + [28437] * 2


def test_a_plain_pool_reports_its_base_profile() -> None:
    result = Cluster(parse_workload(TINY), reference_router("round-robin"), pods=2).run()
    assert [p.shape for p in result.pod_stats] == ["h100-llama3-8b"] * 2
    assert result.pool == "2 x h100-llama3-8b"


def test_pods_of_one_run_must_share_the_block_size() -> None:
    with pytest.raises(ValueError, match="must share block_size"):
        Cluster(parse_workload(TINY), reference_router("random"), pods="1:h100,1:h100:block_size=32")


def test_simulate_cli_takes_a_pod_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(TINY)
    out = tmp_path / "out.json"
    assert main(["simulate", "--workload", str(workload), "--pods", "1:h100,1:a100:max_num_seqs=8",
                 "--policy", "round-robin", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "pods 1 x h100-llama3-8b, 1 x a100-llama3-8b:max_num_seqs=8; KV blocks per pod, by group: 28275, 28437" in err
    assert '"pods": 2' in out.read_text()
    assert main(["simulate", "--workload", str(workload), "--pods", "2:b200"]) == 2
    assert "unknown step-time profile 'b200'" in capsys.readouterr().err


def test_epp_sim_builds_one_config_per_pod() -> None:
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    args = p.parse_args(["--pods", "1:a100,2:h100:max_num_seqs=16", "--max-num-seqs", "32"])
    configs = sim_cli.pod_configs(args, sim_cli.config_from_args(args))
    assert [c.engine.step_profile for c in configs] == ["a100-llama3-8b"] + ["h100-llama3-8b"] * 2
    assert [c.engine.max_num_seqs for c in configs] == [32, 16, 16]
    assert [c.engine.num_gpu_blocks for c in configs] == [28437, 28275, 28275]
    sized = p.parse_args(["--pods", "1:a100,1:h100:num_gpu_blocks=700", "--num-gpu-blocks", "2000"])
    configs = sim_cli.pod_configs(sized, sim_cli.config_from_args(sized))
    assert [c.engine.num_gpu_blocks for c in configs] == [2000, 700]
    bad = p.parse_args(["--pods", "1:a100:max_loras=-1"])
    assert sim_cli.run(bad) == 2


# ---------------------------------------------------------------- step time

_SAMPLE = re.compile(r"^\| (?P<step>[a-z][^|]*?) \| (?P<composed>[\d.]+) \| (?P<five>[\d.]+) \| [\d.]+ \|$")


def _work(step: str) -> tuple[int, int, int, float]:
    """(P, D, K, Q) of a sample-step description in step-time.md, section 2."""
    p = d = k = 0
    q = 0.0
    m = re.search(r"decodes? (\d+) seqs?, context (\d+)", step)
    if m:
        d, ctx = int(m[1]), int(m[2])
        return 0, d, d * ctx, 0.0
    m = re.search(r"(?:prefill|chunk|prompt) (\d+)(?:, no prefix| after an? (\d+) prefix| after (\d+))?", step)
    assert m, step
    p = int(m[1])
    prefix = int(m[2] or m[3] or 0)
    q = p * (prefix + p / 2)
    m = re.search(r"\+ (\d+) decodes at (\d+)", step)
    if m:
        d = int(m[1])
        k = d * int(m[2])
    return p, d, k, q


def test_the_shipped_fit_reproduces_the_calibrations_sample_steps(shared_dir: Path) -> None:
    """Every sample step of step-time.md (H100), computed with the shipped coefficients from its
    P, D, K, Q, gives the table's 5-term figure — to 0.025 ms, as the JSON rounds the coefficients
    to four significant figures and the table was computed before rounding."""
    text = (shared_dir / "calibration" / "step-time.md").read_text()
    rows = [m.groupdict() for line in text.splitlines() if (m := _SAMPLE.match(line))]
    assert len(rows) == 13
    model = StepTimeModel.load("h100-llama3-8b")
    for row in rows:
        p, d, k, q = _work(row["step"])
        ms = model.seconds(p, d, k, q, d + (1 if p else 0)) * 1e3
        assert ms == pytest.approx(float(row["five"]), abs=0.025), row["step"]
        assert ms == pytest.approx(float(row["composed"]), rel=0.3)  # the fit's stated worst case


def test_steps_outside_the_calibrated_range_are_counted() -> None:
    """H100: not validated above 4,096 tokens per step; both profiles: contexts above 16,384.
    An 8,192-token budget with 6,000-token prompts leaves the H100 range, not the A100's."""
    def out_of_range(profile: str, prompt: int, max_len: int = 8192) -> tuple[int, int]:
        cfg = SimConfig(engine=EngineConfig(step_profile=profile, max_model_len=max_len,
                                            num_gpu_blocks=kv_capacity_blocks(profile)))
        eng, f = Engine(cfg.engine), RequestFactory(cfg)
        run(eng, [f.synthetic(prompt, 20, arrival_time=0.0)])
        return eng.num_steps_out_of_range, eng.num_steps

    assert out_of_range("h100-llama3-8b", 6000) == (1, 20)  # the prefill step
    assert out_of_range("a100-llama3-8b", 6000) == (0, 20)
    assert out_of_range("h100-llama3-8b", 3000) == (0, 20)
    # Two chunks (8,192 and 8,188 tokens, contexts 8,192 and 16,380) and decodes at contexts
    # 16,381..16,384 are in range; the other 15 decodes are not.
    assert out_of_range("a100-llama3-8b", 16380, max_len=20000) == (15, 21)


def test_pod_stats_carry_the_out_of_range_share() -> None:
    w = parse_workload("""
name: long
duration: 2
classes:
- {name: a, rate: 4, prompt: 6000, output: 5}
""")
    result = Cluster(w, reference_router("round-robin"), pods="1:h100,1:a100").run()
    h100, a100 = result.pod_stats
    assert h100.steps_out_of_range > 0 and a100.steps_out_of_range == 0
    share = result.steps_out_of_range_share
    assert share == pytest.approx(h100.steps_out_of_range / (h100.steps + a100.steps))


# ---------------------------------------------------------------- the greedy oracle

def test_the_oracle_is_greedy_oracle_and_the_old_name_still_works() -> None:
    assert reference_router("greedy-oracle").name == "greedy-oracle"
    assert reference_router("oracle").name == "oracle"  # old commands keep their labels
    assert expand_policies(["all"])[-1] == "greedy-oracle"
    assert expand_policies(["oracle"]) == ["oracle"]
    assert [r.policy for r in simulate(parse_workload(TINY), pods=2, policies=["greedy-oracle"])] == \
        ["greedy-oracle"]


def test_the_oracle_counts_prefill_attention() -> None:
    """Its estimate includes a_qk·Q for the prefill ahead and its own (Q = n·(k + n/2)), so a
    long prompt behind long queued prompts costs more than the tokens alone say."""
    from epp.sim.cluster.pods import ClusterPod
    from epp.sim.cluster.traffic import Job
    from epp.sim.cluster.vloop import VirtualTimeLoop

    cfg = EngineConfig(max_model_len=16384, record_token_times=False)
    cluster = Cluster(parse_workload(TINY), OracleRouter(), pods=1, sim_config=SimConfig(engine=cfg))
    cluster.pods = [ClusterPod(0, cfg, VirtualTimeLoop(), lambda r: None)]
    oracle = cluster.router
    assert isinstance(oracle, OracleRouter)
    oracle.attach(cluster)
    f = RequestFactory(SimConfig(engine=cfg))
    for _ in range(3):
        cluster.pods[0].engine.add_request(f.synthetic(8000, 10, arrival_time=0.0))
    job = Job(id=1, cls=0, tenant="t", arrival=0.0, prompt="", prompt_tokens=8000, output_tokens=10,
              max_tokens=10)
    job.request = f.synthetic(8000, 10, arrival_time=0.0)
    est = oracle.estimate(0, job)
    st = cluster.pods[0].engine.step_time
    qk = 4 * 8000 * 4000.0  # three queued prompts and its own, none cached
    tokens_only = (1 + 32000 / cfg.max_num_batched_tokens) * st.seconds(8192, 0, 0, 0.0, 1)
    assert est == pytest.approx(tokens_only + st.prefill_attn_ms_per_qk_pair * qk * 1e-3, rel=1e-6)
    assert st.prefill_attn_ms_per_qk_pair * qk * 1e-3 > 0.2 * tokens_only
