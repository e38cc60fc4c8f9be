"""Simulated vLLM pods for the live benchmarks: one `epp sim` process per pod.

One process per pod spreads the pods over the machine's cores, as real pods would be spread over
GPUs. Every measurement starts a fresh set, so each arm meets a cold prefix cache.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from bench.common import epp_command, free_ports, start_process, stop_process, wait_http


@dataclass(frozen=True, slots=True)
class PodSpec:
    """What each simulated pod is: the modelled GPU, its KV cache and batch limits, its speed."""

    count: int = 4
    profile: str = "a100-llama3-8b"
    num_gpu_blocks: int = 1200  # 0: the profile's full GPU
    max_num_seqs: int = 12
    max_model_len: int = 8192
    time_scale: float = 1.0  # wall seconds per modelled second
    seed: int = 0

    def describe(self) -> str:
        return (f"{self.count} simulated vLLM pods ({self.profile}, {self.num_gpu_blocks} KV blocks of 16 tokens "
                f"= {self.num_gpu_blocks * 16:,} tokens each, max_num_seqs {self.max_num_seqs}, time scale "
                f"{self.time_scale:g}), one `epp sim` process each")


@dataclass(slots=True)
class Pods:
    spec: PodSpec
    tag: str
    addresses: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}" for a in self.addresses]

    def start(self) -> None:
        s = self.spec
        try:
            for i, port in enumerate(free_ports(s.count)):
                cmd = epp_command("sim", "--pods", "1", "--base-port", str(port), "--time-scale", str(s.time_scale),
                                  "--profile", s.profile, "--max-num-seqs", str(s.max_num_seqs),
                                  "--max-model-len", str(s.max_model_len), "--seed", str(s.seed + i))
                if s.num_gpu_blocks:
                    cmd += ["--num-gpu-blocks", str(s.num_gpu_blocks)]
                self.procs.append(start_process(cmd, f"{self.tag}-pod{i}"))
                self.addresses.append(f"127.0.0.1:{port}")
            for proc, url in zip(self.procs, self.urls):
                wait_http(f"{url}/health", proc=proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)
        self.procs.clear()
        self.addresses.clear()

    def __enter__(self) -> Pods:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
