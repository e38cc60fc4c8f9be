"""`epp sim` argument handling and a real run until SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from epp.sim import cli

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_build_the_config() -> None:
    cfg = cli.config_from_args(parse("--model", "m", "--lora", "a,b", "--lora", "c",
                                     "--time-scale", "0.1", "--max-num-seqs", "8",
                                     "--scheduling-policy", "priority", "--batching", "prefill_first",
                                     "--num-gpu-blocks", "5000", "--no-prefix-caching"))
    assert cfg.model == "m" and cfg.lora_adapters == ("a", "b", "c") and cfg.time_scale == 0.1
    e = cfg.engine
    assert e.max_num_seqs == 8 and e.scheduling_policy == "priority" and e.batching == "prefill_first"
    assert e.num_gpu_blocks == 5000 and not e.enable_prefix_caching and e.max_loras == 4


def test_profile_sets_the_kv_capacity() -> None:
    assert cli.config_from_args(parse("--profile", "a100-llama3-8b")).engine.num_gpu_blocks == 28437


def test_invalid_config_is_an_error_exit() -> None:
    assert cli.run(parse("--time-scale", "0")) == 2
    assert cli.run(parse("--max-model-len", "8192", "--num-gpu-blocks", "100")) == 2  # > KV cache
    assert cli.run(parse("--tokenizer", "/no/such/dir")) == 2


def test_tokenizer_flag() -> None:
    assert cli.config_from_args(parse()).tokenizer == "bpe"  # a real tokenizer by default
    assert cli.config_from_args(parse("--tokenizer", "tiny")).tokenizer == "tiny"
    assert cli.config_from_args(parse("--tokenizer", "chars4")).tokenizer == "chars4"


def test_runs_until_sigterm() -> None:
    code = ("import argparse, sys\n"
            "from epp.sim import cli\n"
            "p = argparse.ArgumentParser(); cli.add_arguments(p)\n"
            "sys.exit(cli.run(p.parse_args(['--pods', '2', '--base-port', '0', '--time-scale', '0.01'])))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            assert proc.stdout is not None
            urls = [proc.stdout.readline().split()[1] for _ in range(2)]
            for url in urls:
                with urllib.request.urlopen(url + "/health", timeout=10) as r:
                    assert r.status == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
