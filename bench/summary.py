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
    for key, v in data.get("pick", {}).items():
        lines.append(f"- the pick over {key} candidates: {_f(v['per_candidate'], 1e6, 1)} µs per candidate, "
                     f"{_f(v['request'], 1e6)} µs for the director's whole request (in-process)")
    for key, v in data.get("scrape", {}).items():
        if key.endswith("process") or key.endswith("in-loop"):
            lines.append(f"- scraping {key.split()[0]} pods ({key.split()[1]} pages, {key.split()[2]}) every 50 ms: "
                         f"{v['cores']:.2f} cores, metrics age {_f(v['age_mean'], 1000, 1)} ms mean "
                         f"({v['scrapes']:,.0f} scrapes/s; reference successor: ~7.5 cores at 100 pods)")
    tok = data.get("tokens", {})
    shipped = next((v for k, v in tok.items() if "shipped" in k), None)
    reference = next((v for k, v in tok.items() if "reference" in k), None)
    bare = tok.get("envoy only")
    if shipped and reference and bare:
        lines.append(f"- token path: ITL p99 {_f(shipped['itl_p99'], 1000, 2)} ms on the shipped config (added "
                     f"{_f(shipped['itl_p99_added'], 1000, 2)} ms), {_f(reference['itl_p99'], 1000, 2)} ms with every "
                     f"chunk through the EPP, {_f(bare['itl_p99'], 1000, 2)} ms without the EPP; EPP CPU "
                     f"{_f(reference['cpu_per_chunk'], 1e6)} µs per chunk through it vs "
                     f"{_f(shipped['cpu_per_chunk'], 1e6)} µs on the shipped config")
    return lines + [""]


def summary_text() -> str:
    """SUMMARY.md from the committed results (a test holds the committed file to it)."""
    lines = ["# Benchmark summary", "", "Headline figures from bench/results/*.md (each ratio from one run). "
             "p90 = TTFT p90; hit = the pods' own prefix-cache hit rate.", ""]
    overhead = _load("overhead.json")
    if overhead:
        lines += ["### Picker overhead", "",
                  f"- closed-loop throughput with the EPP ÷ without: {overhead['throughput_ratio']:.2f} (shipped "
                  f"Envoy config; `--workers 1` / `2`: {overhead.get('throughput_ratio_workers_1', math.nan):.2f} / "
                  f"{overhead.get('throughput_ratio_workers_2', math.nan):.2f}); p99 latency added at 200 req/s "
                  f"{overhead.get('added_p99_ms_shipped_200', math.nan):.2f} ms (p50 added in the closed loop, "
                  f"mostly its queueing: {overhead.get('added_p50_ms_shipped', math.nan):.2f} ms)", ""]
    cost = _load("cost.json")
    if cost:
        lines += cost_lines(cost)
    for scenario in ("prefix", "balance", "hol"):
        data = _load(f"routing-{scenario}.json")
        if data:
            lines += routing_lines(data)
    return "\n".join(lines) + "\n"


def main() -> int:
    text = summary_text()
    write_report(RESULTS / "SUMMARY.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
