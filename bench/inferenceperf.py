"""Drive `inference-perf` (the Gateway API Inference Extension's load generator) against an arm.

inference-perf needs Python >= 3.12 and a tokenizer; `make bench-deps` makes a 3.12 venv in
`.venv-bench312/` and saves a local WordLevel tokenizer there (`bench/tokenizer.py`: the pods'
single-token words, so prompt lengths are in the pods' tokens), and runs set
HF_HUB_OFFLINE=1, so nothing is fetched at run time. One invocation runs every rate of an arm as
consecutive stages (Poisson arrivals, random prompts with lognormal lengths); its per-stage
reports give TTFT, ITL and throughput, and each stage's time window (from the per-request
records, on the same monotonic clock as ours) lines it up with our pod samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.common import LOGS, MODEL, REPO, log, start_process, stop_process

VENV = Path(os.environ.get("BENCH_VENV312", REPO / ".venv-bench312"))
# Set by the caller when the benchmark is interrupted: `run` (in a worker thread) then stops at once.
CANCEL = threading.Event()


def executable() -> Path | None:
    exe = VENV / "bin" / "inference-perf"
    return exe if exe.exists() else None


def tokenizer_dir() -> Path:
    """The local tokenizer, saved on first use if `make bench-deps` has not done it."""
    directory = VENV / "pod-words-tokenizer"
    if not (directory / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "bench.tokenizer", str(directory)], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return directory


DESCRIPTION = ("inference-perf `random` data: independent prompts with lognormal lengths (mean 800 tokens, 32–6000) "
               "and outputs (mean 80, 8–768), streamed completions, Poisson arrivals")


@dataclass(slots=True)
class Stage:
    rate: float
    count: int
    failures: int
    ttft: tuple[float, float, float]  # p50, p90, p99 seconds
    itl: tuple[float, float]  # p50, p99 seconds
    out_tps: float
    rps: float
    window: tuple[float, float]  # monotonic start of the first request, end of the last
    e2e_mean: float  # seconds, over the stage's requests


def config(url: str, rates: list[float], duration: float, out_dir: Path, seed: int,
           mean_prompt: int = 800, mean_output: int = 80) -> dict[str, object]:
    # Same shape as bench.workloads.balance: lognormal prompt and output lengths.
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {
            "type": "random",
            "input_distribution": {"min": 32, "max": 6000, "mean": mean_prompt, "std_dev": mean_prompt * 1.05,
                                   "total_count": 5000, "type": "lognormal"},
            "output_distribution": {"min": 8, "max": 768, "mean": mean_output, "std_dev": mean_output * 0.9,
                                    "total_count": 5000, "type": "lognormal"},
        },
        "load": {"type": "poisson", "stages": [{"rate": r, "duration": int(duration)} for r in rates],
                 "num_workers": 1, "base_seed": seed, "interval": 1.0,
                 "stage_teardown_grace_seconds": max(10.0, duration)},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir())},
        "report": {"request_lifecycle": {"summary": False, "per_stage": True, "per_request": True,
                                         "per_request_fields": {"request": False, "response": False,
                                                                "response_chunks": False}},
                   "prometheus": None},
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def run(url: str, rates: list[float], duration: float, tag: str, seed: int = 2) -> list[Stage]:
    exe = executable()
    if exe is None:
        raise FileNotFoundError(f"inference-perf not found in {VENV} (make bench-deps)")
    work = LOGS / f"{tag}-inference-perf"
    if work.exists():
        for f in work.rglob("*"):
            if f.is_file():
                f.unlink()
    work.mkdir(parents=True, exist_ok=True)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config(url, rates, duration, work / "out", seed)))
    proc = start_process([str(exe), "-c", str(cfg_path), "--log-level", "INFO"], f"{tag}-inference-perf",
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""})
    log_file = LOGS / f"{tag}-inference-perf.log"
    seen = 0
    try:
        deadline = time.monotonic() + len(rates) * (2 * duration + 20) + 60
        while proc.poll() is None:
            if CANCEL.is_set():
                raise RuntimeError("interrupted")
            if time.monotonic() > deadline:
                raise TimeoutError("inference-perf did not finish")
            time.sleep(0.5)
            lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if "Stage" in ln and " run " in ln]
            for line in lines[seen:]:
                log("  inference-perf: " + line.split(" - ")[-1])
            seen = len(lines)
        if proc.returncode != 0:
            raise RuntimeError(f"inference-perf exited with {proc.returncode}; see {log_file}")
    finally:
        stop_process(proc)
    return parse(work / "out", rates)


def _triplet(d: dict[str, float]) -> tuple[float, float, float]:
    return d.get("median", float("nan")), d.get("p90", float("nan")), d.get("p99", float("nan"))


def parse(out: Path, rates: list[float]) -> list[Stage]:
    records = json.loads((out / "per_request_lifecycle_metrics.json").read_text())
    records.sort(key=lambda r: r["start_time"])
    stages = []
    offset = 0
    for i, rate in enumerate(rates):
        report = json.loads((out / f"stage_{i}_lifecycle_metrics.json").read_text())
        count = int(report["load_summary"]["count"])
        mine = records[offset:offset + count]
        offset += count
        ok = report.get("successes", {})
        lat = ok.get("latency", {})
        ttft = _triplet(lat.get("time_to_first_token", {}))
        itl = lat.get("inter_token_latency", {})
        tput = ok.get("throughput", {})
        failures = int(report.get("failures", {}).get("count", 0))
        window = (min(r["start_time"] for r in mine), max(r["end_time"] for r in mine)) if mine else (0.0, 0.0)
        e2e = [r["end_time"] - r["start_time"] for r in mine if not r.get("error")]
        stages.append(Stage(rate, count, failures, ttft, (itl.get("median", float("nan")), itl.get("p99", float("nan"))),
                            tput.get("output_tokens_per_sec", float("nan")), tput.get("requests_per_sec", float("nan")),
                            window, sum(e2e) / len(e2e) if e2e else float("nan")))
    return stages
