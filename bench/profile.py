"""Where the EPP's CPU goes under load: py-spy samples of the `epp serve` process.

    python -m bench.profile requests --endpoints 100   # closed loop of small requests
    python -m bench.profile tokens                     # streamed responses through the EPP
    python -m bench.profile scrape --endpoints 100     # no traffic, scraping only

Needs `py-spy` (pip install py-spy). Prints the functions with the most samples, self and
inclusive, and writes bench/results/profile-<what>.txt (raw collapsed stacks, for flame graphs).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench.common import RESULTS, closed_loop, log
from bench.cost import FULL, NONE, _stream_loop, epp_stack, prompt_bodies
from bench.pods import Pods, PodSpec
from bench.stubpods import StubPods


def top(raw: Path, n: int = 25) -> str:
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        k = int(count)
        total += k
        frames = stack.split(";")
        self_counts[frames[-1]] += k
        for f in set(frames):
            inclusive[f] += k
    out = [f"{total} samples", "", "self:"]
    out += [f"  {k / total:6.1%}  {f[:140]}" for f, k in self_counts.most_common(n)]
    out += ["", "inclusive:"]
    out += [f"  {k / total:6.1%}  {f[:140]}" for f, k in inclusive.most_common(n + 10)]
    return "\n".join(out)


async def run(what: str, endpoints: int, seconds: float, native: bool = False) -> Path:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = RESULTS / f"profile-{what}.txt"
    raw.unlink(missing_ok=True)

    def record(pid: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "-f", "raw", *(["--native"] if native else []),
                                 "-o", str(raw), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    if what == "tokens":
        spec = PodSpec(count=2, profile="h100-llama3-8b", num_gpu_blocks=0, max_num_seqs=256)
        with Pods(spec, "profile") as pods, epp_stack(pods.addresses, "profile", modes=(FULL,)) as epp:
            prof = record(epp.proc.pid)
            await _stream_loop(epp.envoys[FULL].url, 16, seconds + 1, 200)
            prof.wait()
        return raw
    with StubPods(endpoints) as stubs, epp_stack(stubs.addresses, "profile", modes=(NONE,)) as epp:
        prof = record(epp.proc.pid)
        if what == "requests":
            await closed_loop(epp.envoys[NONE].url + "/v1/completions", prompt_bodies(random.Random(1), 200, 2000),
                              32, seconds + 1)
        else:
            await asyncio.sleep(seconds + 1)
        prof.wait()
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("requests", "tokens", "scrape"))
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--native", action="store_true", help="include C frames (gRPC core, protobuf, uvloop)")
    args = parser.parse_args(argv)
    log(f"profiling the EPP: {args.what}, {args.endpoints} endpoints, {args.seconds:g} s")
    raw = asyncio.run(run(args.what, args.endpoints, args.seconds, args.native))
    if not raw.exists():
        print("py-spy wrote no profile (is py-spy installed? --native needs ptrace and unwind support)", file=sys.stderr)
        return 1
    print(top(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
