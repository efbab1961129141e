#!/usr/bin/env python3
"""Why latency-critical requests were admitted and then late (issue 29).

usage: scripts/late-causes.py DIR [POLICY]   DIR from `sloserve loadtest
--compare --server-set log.level=debug`: DIR/POLICY/{summary.json,records.csv}
and DIR/server-POLICY.log (POLICY: adaptive by default).

The server logs one "request finished" line per latency-critical request at
debug level (qos/finishlog.go): its arrival, admission's plan (wait, execution,
room), its wait and execution as they came, the batch and the deadline's slack.
First, per model, the server's own count (no join, warm-up included): the
requests that ran, ended late there or were dropped, and the late by the
size of the batch they ran in. Then each answered request of records.csv is
matched to its line by the request's id (loadtest sends one with each request
and sloserve's line names it), or, for a run recorded without ids, to the line
whose arrival is nearest its send (which takes a neighbour's line when two
requests arrive within a millisecond, or when the way there was long). A
request late at the client is then either
  server-late  the execution ended after the deadline at the server, or
  way-late     it ended in time at the server; the way to the server (send to
               arrival) or back (the answer's way out and the client's read)
               took the slack.
For the server-late ones it prints the slack the dispatcher planned (SLO minus
the wait minus the batch's predicted execution) against the on-time ones', and
the executions' ratio of taken to predicted, and how many of the model's
batches were held back beside a running execution (qos.overlap_slowdown).
The bound: the share of requests that would be late if each ran alone at its
own wait with an execution drawn from the measured ratios (no batching, no
queue): what no admission rule on the mean removes. Last, the admitted
requests by the chance to be late admission read for them (plan_risk) against
the share of them late or dropped at the server.
"""
import bisect
import collections
import csv
import datetime
import json
import re
import sys

FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


def quantiles(xs, ps=(0, 0.25, 0.5, 0.75, 0.9, 1)):
    xs = sorted(xs)
    if not xs:
        return "-"
    return " ".join(f"{xs[int(p * (len(xs) - 1))]:.1f}" for p in ps)


def server_lines(path):
    """The server's "request finished" lines by model, in arrival order, and
    its batches held back beside a running execution by model
    (qos/overlap.go)."""
    lines = collections.defaultdict(list)
    holds = collections.Counter()
    with open(path) as f:
        for line in f:
            held = 'msg="held beside a running execution"' in line
            if not held and 'msg="request finished"' not in line:
                continue
            d = dict(FIELD.findall(line))
            d["model"] = d["model"].split("/")[0]
            if held:
                holds[d["model"]] += 1
                continue
            d["arr"] = int(d["arrival"])
            lines[d["model"]].append(d)
    for v in lines.values():
        v.sort(key=lambda d: d["arr"])
    return lines, holds


def main(out, policy="adaptive"):
    summary = json.load(open(f"{out}/{policy}/summary.json"))
    slo = {m["name"]: m["slo_ms"] for m in summary["models"] if m["class"] == "latency-critical"}
    start = datetime.datetime.fromisoformat(summary["started"].replace("Z", "+00:00")).timestamp() * 1e6
    srv, holds = server_lines(f"{out}/server-{policy}.log")
    arrivals = {m: [d["arr"] for d in v] for m, v in srv.items()}
    by_id = {(m, d["id"].strip('"')): d for m, v in srv.items() for d in v if "id" in d}
    joined = []  # (model, client outcome, client latency, server line, way there ms)
    how = collections.Counter()
    with open(f"{out}/{policy}/records.csv") as f:
        for r in csv.DictReader(f):
            m = r["model"]
            if m not in slo or r["outcome"] not in ("good", "late"):
                continue
            sent = start + float(r["sent_ms"]) * 1000
            d = by_id.get((m, r.get("id") or ""))
            if d is not None:
                how["id"] += 1
            else:
                i = bisect.bisect_left(arrivals.get(m, []), sent - 2000)
                near = srv[m][i:i + 4]
                if not near:
                    how["none"] += 1
                    continue
                d = min(near, key=lambda d: abs(d["arr"] - sent))
                how["arrival"] += 1
            joined.append([m, r["outcome"], float(r["latency_ms"]), d, (d["arr"] - sent) / 1000, sent])
    skew = unskew(joined)
    print(f"answered latency-critical requests matched to the server's lines by id {how['id']}, "
          f"by arrival {how['arrival']}, not matched {how['none']}")
    if skew is not None:
        print(f"  the server's clock against the generator's: {skew[0]:+.1f} to {skew[1]:+.1f} ms over the run "
              f"(the way there is read against the fastest around it, within a quarter of a second)")
    for m in slo:
        rows = [j for j in joined if j[0] == m]
        late = [j for j in rows if j[1] == "late"]
        s_late = [j for j in late if j[3]["outcome"] == "late"]
        w_late = [j for j in late if j[3]["outcome"] == "good"]
        n = len(rows)
        print(f"{m} (SLO {slo[m]} ms): answered {n}, late at the client {len(late)} "
              f"({100 * len(late) / max(n, 1):.1f}%): server-late {len(s_late)}, way-late {len(w_late)}")
        print_server(srv[m], holds[m])
        back = lambda j: j[2] - j[4] - (slo[m] - float(j[3]["slack_ms"]))
        way = lambda j: j[2] - (slo[m] - float(j[3]["slack_ms"]))  # there and back: durations only
        print(f"  way-late: the way there and back ms {quantiles([way(j) for j in w_late])} against the slack at the "
              f"server's end {quantiles([float(j[3]['slack_ms']) for j in w_late])}")
        print(f"  way-late: way there ms {quantiles([j[4] for j in w_late])}; back {quantiles([back(j) for j in w_late])}; "
              f"the way there the longer of the two for {sum(1 for j in w_late if j[4] > back(j))}")
        print(f"  all answered: the way there and back ms {quantiles([way(j) for j in rows], (0.5, 0.9, 0.99, 1))} (p50 p90 p99 max)")
        print(f"  server-late: way there ms {quantiles([j[4] for j in s_late])}")
        print(f"  all answered: way there ms {quantiles([j[4] for j in rows])}; back {quantiles([back(j) for j in rows])}")
        ran = lambda d: float(d["ran_ms"]) / float(d["exec_predicted_ms"])
        planned = lambda d: slo[m] - float(d["wait_ms"]) - float(d["exec_predicted_ms"])
        good = [j[3] for j in rows if j[3]["outcome"] == "good" and "ran_ms" in j[3]]
        bad = [j[3] for j in s_late if "ran_ms" in j[3]]
        print(f"  server-late: slack planned at dispatch ms {quantiles([planned(d) for d in bad])} "
              f"(on time: {quantiles([planned(d) for d in good])})")
        print(f"  server-late: batch {dict(collections.Counter(d.get('batch') for d in bad))}, "
              f"taken/predicted {quantiles([ran(d) for d in bad])}, over the SLO ms "
              f"{quantiles([-float(d['slack_ms']) for d in bad])}")
        runs = [d for d in srv[m] if "ran_ms" in d and float(d.get("exec_predicted_ms", 0)) > 0]
        ratios = sorted(ran(d) for d in runs)
        if not ratios:
            continue
        mean = sum(ratios) / len(ratios)
        cv = (sum((x - mean) ** 2 for x in ratios) / len(ratios)) ** 0.5 / mean
        print(f"  executions taken/predicted: {quantiles(ratios, (0.5, 0.9, 0.95, 0.99, 1))} "
              f"(p50 p90 p95 p99 max), CV {cv:.2f}")

        def p_late(d, wait):
            need = (slo[m] - wait) / (float(d["plan_exec_ms"]) or float(d["exec_predicted_ms"]))
            return (len(ratios) - bisect.bisect_right(ratios, need)) / len(ratios)

        at_wait = sum(p_late(d, float(d["wait_ms"])) for d in runs) / len(runs)
        alone = sum(p_late(d, 0) for d in runs) / len(runs)
        print(f"  bound: late if run alone at its own wait {100 * at_wait:.2f}%, with no wait {100 * alone:.2f}%")
        print_risk(srv[m])


def unskew(joined):
    """Reads each request's way there against the fastest way there of the
    requests sent within a quarter of a second of it (a second where
    fewer were), in place, when they were matched
    by id: the server stamps arrivals with the wall clock and the generator
    times sends from its start on the monotonic clock, and the wall clock
    of a virtual machine can step or slew during a run (measured here:
    15.4 s in one step, then 5 ms a second). Returns the least and most
    offset taken out (ms), or None when no request was matched by id."""
    if not any("id" in j[3] for j in joined):
        return None
    pts = sorted((j[5], j[4], i) for i, j in enumerate(joined))
    times = [p[0] for p in pts]
    offs = []
    for t, there, i in pts:
        for w in (0.25e6, 1e6):  # a quarter of a second each side, or a second where that has few
            lo, hi = bisect.bisect_left(times, t - w), bisect.bisect_right(times, t + w)
            if hi - lo >= 4:
                break
        off = min(p[1] for p in pts[lo:hi])
        joined[i][4] = there - off
        offs.append(off)
    return min(offs), max(offs)


def print_server(lines, held):
    """The model's requests as the server's own lines count them, with no
    join to the client's records (which matches by the nearest arrival and
    can pair the wrong two in a burst): how many ran, ended late at the
    server or were dropped, the late share by the size of the batch they
    ran in, and how many of its batches were held (held)."""
    ran = [d for d in lines if d["outcome"] in ("good", "late")]
    late = [d for d in ran if d["outcome"] == "late"]
    dropped = sum(d["outcome"] == "dropped" for d in lines)
    by = collections.defaultdict(lambda: [0, 0])
    for d in ran:
        b = by[int(d.get("batch", 0))]
        b[0] += 1
        b[1] += d["outcome"] == "late"
    sizes = ", ".join(f"{k}: {v[1]}/{v[0]}" for k, v in sorted(by.items()))
    print(f"  at the server (its own lines, no join): ran {len(ran)}, late {len(late)} "
          f"({100 * len(late) / max(len(ran), 1):.2f}%), dropped {dropped}; late by batch size {{{sizes}}}; "
          f"batches held beside a running execution {held}")


# Buckets of plan_risk, admission's chance to be late (qos tail.risk).
RISK_BUCKETS = ((0, "0"), (1e-3, "(0, 0.1%)"), (1e-2, "[0.1%, 1%)"), (float("inf"), ">= 1%"))


def print_risk(lines):
    """The admitted requests by the chance to be late admission read for
    them (plan_risk) against the share of them late or dropped at the
    server: whether the reading tells the late ones."""
    buckets = {name: [0, 0, 0.0] for _, name in RISK_BUCKETS}  # admitted, late, sum of chances
    for d in lines:
        if "plan_risk" not in d or d["outcome"] not in ("good", "late", "dropped"):
            continue
        risk = float(d["plan_risk"])
        name = next(n for hi, n in RISK_BUCKETS if (risk == 0 if hi == 0 else risk < hi))
        b = buckets[name]
        b[0] += 1
        b[1] += d["outcome"] != "good"
        b[2] += risk
    for _, name in RISK_BUCKETS:
        n, late, total = buckets[name]
        if n:
            print(f"  admission read {name}: {n} admitted, read at {100 * total / n:.2f}% on average, "
                  f"late or dropped at the server {100 * late / n:.2f}%")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:3])
