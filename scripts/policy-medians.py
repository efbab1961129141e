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
        "offered_lc": sum(m["requests"] for m in lc) / run["duration_s"],
        "per_model": {m["name"]: (m["attainment"], m["p99_ms"], m["throughput"]) for m in run["models"]},
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
        # A policy's LC goodput cannot pass the LC rate offered: adaptive /
        # other is bounded by offered / other's goodput.
        print("\n| bound on adaptive / other LC goodput (offered / other's goodput) | runs | median |")
        print("|---|---|---|")
        for other in per:
            if other == "adaptive":
                continue
            bounds = [y["offered_lc"] / y["lc_goodput"] for y in per[other] if y["lc_goodput"]]
            print(f"| {other} | {', '.join(f'{v:.2f}x' for v in bounds)} | {statistics.median(bounds):.2f}x |")
    print("\nPer model, attainment / p99 / throughput (req/s), run by run:\n")
    names = list(next(iter(per.values()))[0]["per_model"])
    print("| policy | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for pol, fs in per.items():
        cells = []
        for n in names:
            cells.append("; ".join(f"{100*f['per_model'][n][0]:.1f}% / {f['per_model'][n][1]:.0f} ms / {f['per_model'][n][2]:.1f}" for f in fs))
        print(f"| {pol} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
