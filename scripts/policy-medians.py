#!/usr/bin/env python3
"""Medians over repeated policy comparisons (BENCHMARKS.md).

usage: scripts/policy-medians.py DIR...   each DIR holds one comparison.json
from `sloserve loadtest --compare`. Prints, per policy, the latency-critical
(LC) goodput and attainment and the best-effort (BE) throughput of every
run and their medians, and the ratios of adaptive to the others computed
within each run (side by side), with their medians.
"""
import json
import statistics
import sys


def figures(run):
    lc = [m for m in run["models"] if m["class"] == "latency-critical"]
    be = [m for m in run["models"] if m["class"] != "latency-critical"]
    lc_req = sum(m["requests"] for m in lc)
    lc_good = sum(m["outcomes"].get("good", 0) for m in lc)
    return {
        "lc_goodput": sum(m["goodput"] for m in lc),
        "lc_attainment": lc_good / lc_req if lc_req else 0.0,
        "be_throughput": sum(m["throughput"] for m in be),
        "lc_p99": {m["name"]: m["p99_ms"] for m in lc},
    }


def main(dirs):
    per = {}  # policy -> list of figures, one per run
    for d in dirs:
        with open(f"{d}/comparison.json") as f:
            comp = json.load(f)
        for run in comp["runs"]:
            per.setdefault(run["policy"], []).append(figures(run))
    n = len(dirs)
    print(f"{n} runs: {', '.join(dirs)}\n")
    print("| policy | LC goodput, req/s | LC attainment | BE throughput, req/s |")
    print("|---|---|---|---|")
    for pol, fs in per.items():
        def cell(key, fmt):
            vals = [f[key] for f in fs]
            return ", ".join(fmt(v) for v in vals) + f" (median **{fmt(statistics.median(vals))}**)"
        print(f"| {pol} | {cell('lc_goodput', lambda v: f'{v:.2f}')} | "
              f"{cell('lc_attainment', lambda v: f'{100*v:.1f}%')} | {cell('be_throughput', lambda v: f'{v:.1f}')} |")
    if "adaptive" in per:
        print("\n| ratio | LC goodput | BE throughput |")
        print("|---|---|---|")
        for other in per:
            if other == "adaptive":
                continue
            a, o = per["adaptive"], per[other]
            lc = [x["lc_goodput"] / y["lc_goodput"] for x, y in zip(a, o) if y["lc_goodput"]]
            be = [x["be_throughput"] / y["be_throughput"] for x, y in zip(a, o) if y["be_throughput"]]
            print(f"| adaptive / {other} | {', '.join(f'{v:.2f}' for v in lc)} (median **{statistics.median(lc):.2f}x**) | "
                  f"{', '.join(f'{v:.2f}' for v in be)} (median **{statistics.median(be):.2f}x**) |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
