"""Drive `inference-perf` (the Gateway API Inference Extension's load generator) against an arm.

inference-perf needs Python >= 3.12 and a tokenizer; `make bench-deps` makes a 3.12 venv in
`.venv-bench312/` and saves a local WordLevel tokenizer there (`bench/tokenizer.py`: the pods'
single-token words, so prompt lengths are in the pods' tokens), and runs set
HF_HUB_OFFLINE=1, so nothing is fetched at run time. The rates of an arm run in turn, one
invocation each, replaying a trace this module writes from a seed (Poisson arrivals, lognormal
prompt and output lengths: the same requests at the same moments for every arm; inference-perf
writes their text, from its own seed); its per-stage report gives TTFT, ITL and throughput, and
the stage's time window (from the per-request records, on the same monotonic clock as ours)
lines it up with our pod samples.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

from bench.common import LOGS, MODEL, REPO, log, start_process, stop_process
from bench.workloads import lognormal_int, poisson_times

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
PROMPT = (32, 6000, 800, 1.05)  # min, max, mean, coefficient of variation (lognormal)
OUTPUT = (8, 768, 80, 0.9)
TRACE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
_EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)
# inference-perf's own `poisson` timer draws from an unseeded generator (a Poisson count per
# second, spread over that second) and sends a stage's fixed count of requests: every arm got
# other arrivals, and past capacity a stage that happened to arrive 15% faster queued about twice
# as much. A trace replays the same arrivals for every arm.


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


def _lognormal(rng: random.Random, shape: tuple[int, int, int, float]) -> int:
    lo, hi, mean, cv = shape
    return lognormal_int(rng, mean, math.sqrt(math.log(1.0 + cv * cv)), lo, hi)


def trace(rate: float, duration: float, seed: int) -> list[tuple[float, int, int]]:
    """One stage's requests: (seconds from its start, prompt tokens, output tokens), Poisson
    arrivals at `rate`, lognormal lengths; the same for the same arguments."""
    rng = random.Random(f"balance-trace {seed} {rate:g} {duration:g}")
    return [(at, _lognormal(rng, PROMPT), _lognormal(rng, OUTPUT)) for at in poisson_times(rng, rate, duration)]


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> None:
    """The Azure public dataset's CSV layout, which inference-perf's `trace_replay` reads."""
    lines = [TRACE_HEADER] + [f"{(_EPOCH + timedelta(seconds=at)).strftime('%Y-%m-%d %H:%M:%S.%f')},{p},{o}"
                              for at, p, o in rows]
    path.write_text("\n".join(lines) + "\n")


def config(url: str, trace_file: Path, duration: float, out_dir: Path, seed: int) -> dict[str, object]:
    """One stage that replays `trace_file` (arrival times and lengths); `seed` draws the text."""
    replay = {"file": str(trace_file), "format": "AzurePublicDataset"}
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "random", "trace": replay},
        # An open loop: the worker never holds a request back for lack of a concurrency slot
        # (its default, 100 in flight, is reached past capacity, which would hide the queue).
        "load": {"type": "trace_replay", "trace": replay, "stages": [{"rate": 1, "duration": int(duration)}],
                 "num_workers": 1, "worker_max_concurrency": 5000, "base_seed": seed, "interval": 1.0,
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
    """Every rate in turn, one inference-perf run each (a trace holds one stage)."""
    exe = executable()
    if exe is None:
        raise FileNotFoundError(f"inference-perf not found in {VENV} (make bench-deps)")
    work = LOGS / f"{tag}-inference-perf"
    if work.exists():
        for f in work.rglob("*"):
            if f.is_file():
                f.unlink()
    stages = []
    for i, rate in enumerate(rates):
        stage_dir = work / f"stage-{i}"
        stage_dir.mkdir(parents=True, exist_ok=True)
        rows = trace(rate, duration, seed)
        write_trace(stage_dir / "trace.csv", rows)
        text_seed = seed * 1000 + i  # another text per stage, so no stage's prompts share a prefix
        cfg_path = stage_dir / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(config(url, stage_dir / "trace.csv", duration, stage_dir / "out",
                                                  text_seed)))
        _invoke(exe, cfg_path, f"{tag}-inference-perf-{i}", duration)
        stage = parse(stage_dir / "out", [rate])[0]
        if stage.count != len(rows):
            raise RuntimeError(f"inference-perf sent {stage.count} of the trace's {len(rows)} requests")
        stages.append(stage)
    return stages


def _invoke(exe: Path, cfg_path: Path, log_name: str, duration: float) -> None:
    proc = start_process([str(exe), "-c", str(cfg_path), "--log-level", "INFO"], log_name,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""})
    log_file = LOGS / f"{log_name}.log"
    seen = 0
    try:
        deadline = time.monotonic() + 2 * duration + 80
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
