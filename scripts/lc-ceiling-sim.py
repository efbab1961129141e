#!/usr/bin/env python3
"""The physics of the policy benchmarks: what SLO attainment the
latency-critical (LC) models of a scenario could reach on this machine if
they ran with nothing else on it (BENCHMARKS.md, "What the machine allows").

usage: scripts/lc-ceiling-sim.py

A discrete-event simulation of the LC models of loadtest/scenarios/
diurnal.yaml and colocation.yaml: gamma arrivals (CV 1.5) with the
scenario's diurnal rate, one execution at a time per model (one instance),
each execution its solo time on the whole 2-core device (2 intra-op
threads) +-10%. "alone" gives each model the machine to itself; "together"
lets the two LC models share it, each at half speed while both execute
(processor sharing), which is the best any policy can do for them once the
best-effort work yields completely. Solo times: ocr-det 24.8 ms, ocr-rec
28.9 ms (BENCHMARKS.md). Five seeds; medians.
"""
import math
import random
import statistics


def diurnal(lo, hi, period, peak):
    return lambda t: lo + (hi - lo) * (0.5 + 0.5 * math.cos(2 * math.pi * (t / period - peak)))


def arrivals(rate, T, cv, rng):
    k, t, out = 1 / (cv * cv), 0.0, []
    while True:
        t += rng.gammavariate(k, 1 / (k * rate(t)))
        if t >= T:
            return out
        out.append(t)


def simulate(models, T, seed, together):
    rng = random.Random(seed)
    events = sorted((a, i) for i, m in enumerate(models) for a in arrivals(m["rate"], T, 1.5, rng))
    queue = [[] for _ in models]
    running = [None] * len(models)  # [work left, arrival]
    good, n = [0] * len(models), [0] * len(models)
    now, k = 0.0, 0

    def work(i):
        return models[i]["solo"] * rng.uniform(0.9, 1.1)

    while k < len(events) or any(running):
        busy = [i for i, r in enumerate(running) if r]
        speed = 0.5 if together and len(busy) > 1 else 1.0
        done = min(((running[i][0] / speed, i) for i in busy), default=(math.inf, None))
        arrive = events[k][0] - now if k < len(events) else math.inf
        dt = min(done[0], arrive)
        for i in busy:
            running[i][0] -= dt * speed
        now += dt
        if done[0] <= arrive:
            i = done[1]
            n[i] += 1
            good[i] += now - running[i][1] <= models[i]["slo"]
            running[i] = [work(i), queue[i].pop(0)] if queue[i] else None
        else:
            a, i = events[k]
            k += 1
            if running[i] is None:
                running[i] = [work(i), a]
            else:
                queue[i].append(a)
    return sum(good) / sum(n), [g / c for g, c in zip(good, n)]


SCENARIOS = {
    "diurnal (4m day)": (240, [
        {"name": "ocr-det", "rate": diurnal(2, 10, 240, 0.25), "solo": 0.0248, "slo": 0.125},
        {"name": "ocr-rec", "rate": diurnal(2, 9, 240, 0.6), "solo": 0.0289, "slo": 0.150},
    ]),
    "colocation (2m day)": (120, [
        {"name": "ocr-det", "rate": diurnal(1, 8, 120, 0.45), "solo": 0.0248, "slo": 0.125},
        {"name": "ocr-rec", "rate": diurnal(1, 7, 120, 0.55), "solo": 0.0289, "slo": 0.150},
    ]),
}

for name, (T, models) in SCENARIOS.items():
    for together in (False, True):
        runs = [simulate(models, T, seed, together) for seed in range(1, 6)]
        total = statistics.median(r[0] for r in runs)
        per = ", ".join(f"{m['name']} {100 * statistics.median(r[1][i] for r in runs):.1f}%" for i, m in enumerate(models))
        print(f"{name:22s} {'together' if together else 'alone':8s}: LC attainment {100 * total:.1f}% ({per})")
