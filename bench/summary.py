"""`make bench`'s last step: the headline figures of every report, in one page.

Reads the JSON each benchmark writes next to its Markdown report (bench/results/*.json) and writes
bench/results/SUMMARY.md. Every ratio compares figures measured in the same run.
"""

from __future__ import annotations

import json
import math
import sys

from bench.common import RESULTS, write_report

PEERS = ("sglang-", "vllm-")


def _load(name: str) -> dict | None:  # type: ignore[type-arg]
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _f(x: float, scale: float = 1000.0, digits: int = 0) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:,.{digits}f}"


def routing_lines(data: dict) -> list[str]:  # type: ignore[type-arg]
    points = data["points"]
    rates = sorted({p["rate"] for p in points})
    at = {(p["arm"], p["rate"]): p for p in points}
    lines = [f"### {data['title']}", "",
             "| rate | epp p90 ms (hit) | epp-weighted p90 ms (hit) | envoy-rr p90 ms (hit) | best peer | "
             "best peer p90 ms (hit) | rr ÷ epp | best peer ÷ best epp |", "|---|---|---|---|---|---|---|---|"]

    def cell(p: dict | None) -> str:  # type: ignore[type-arg]
        if not p:
            return "–"
        hit = p["hit_rate"]
        return f"{_f(p['ttft'][1])} ({'–' if hit is None or math.isnan(hit) else f'{hit:.0%}'})"

    for r in rates:
        peers = [p for (a, rate), p in at.items() if rate == r and a.startswith(PEERS)]
        best = min(peers, key=lambda p: p["ttft"][1]) if peers else None
        epp, weighted, rr = at.get(("epp", r)), at.get(("epp-weighted", r)), at.get(("envoy-rr", r))
        epps = [p for p in (epp, weighted) if p]
        best_epp = min(epps, key=lambda p: p["ttft"][1]) if epps else None
        ratio_rr = rr["ttft"][1] / epp["ttft"][1] if rr and epp else math.nan
        ratio_peer = best["ttft"][1] / best_epp["ttft"][1] if best and best_epp else math.nan
        lines.append(f"| {r:g} | {cell(epp)} | {cell(weighted)} | {cell(rr)} | {best['arm'] if best else '–'} | "
                     f"{cell(best)} | {_f(ratio_rr, 1, 2)} | {_f(ratio_peer, 1, 2)} |")
    return lines + [""]


def cost_lines(data: dict) -> list[str]:  # type: ignore[type-arg]
    lines = ["### Picker cost", ""]
    rate = data.get("rate", {})
    for key, v in rate.items():
        if "epp" in key:
            lines.append(f"- {key}: {v['rps']:,.0f} req/s, {_f(v['cpu_per_req'], 1000, 2)} ms EPP CPU per request")
    for key, per in data.get("prompt", {}).items():
        tokens, mode = key.split()
        lines.append(f"- {int(tokens):,}-token prompt, {mode} prefix matching: {_f(per, 1000, 1)} ms EPP CPU per "
                     f"request = {per:.3f} cores per req/s (reference successor: 0.5–1 at 100k)")
    for key, v in data.get("scrape", {}).items():
        if key.endswith("50ms"):
            lines.append(f"- scraping {key.split()[0]} pods every 50 ms: {v['cores']:.2f} cores "
                         f"({v['scrapes']:,.0f} scrapes/s; reference successor: ~7.5 cores at 100 pods)")
    tok = data.get("tokens", {})
    full = next((v for k, v in tok.items() if "FULL" in k), None)
    none = next((v for k, v in tok.items() if "NONE" in k), None)
    bare = tok.get("envoy only")
    if full and none and bare:
        lines.append(f"- token path: ITL p99 {_f(full['itl_p99'], 1000, 2)} ms with bodies through the EPP, "
                     f"{_f(none['itl_p99'], 1000, 2)} ms with NONE, {_f(bare['itl_p99'], 1000, 2)} ms without the EPP; "
                     f"EPP CPU {_f(full['cpu_per_chunk'], 1e6)} µs per chunk through it vs "
                     f"{_f(none['cpu_per_chunk'], 1e6)} µs with NONE")
    return lines + [""]


def main() -> int:
    lines = ["# Benchmark summary", "", "Headline figures from bench/results/*.md (each ratio from one run). "
             "p90 = TTFT p90; hit = the pods' own prefix-cache hit rate.", ""]
    overhead = _load("overhead.json")
    if overhead:
        lines += ["### Picker overhead", "",
                  f"- closed-loop throughput with the EPP ÷ without: {overhead['throughput_ratio']:.2f}; "
                  f"p50 latency added {overhead['added_p50_ms']:.2f} ms", ""]
    cost = _load("cost.json")
    if cost:
        lines += cost_lines(cost)
    for scenario in ("prefix", "balance", "hol"):
        data = _load(f"routing-{scenario}.json")
        if data:
            lines += routing_lines(data)
    text = "\n".join(lines) + "\n"
    write_report(RESULTS / "SUMMARY.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
