#!/usr/bin/env python3
"""Where a decode step's time goes, from a kernel trace of nibble_e2e_bench (graph nodes included).

Usage: decode_timeline.py TRACE.csv [--last-kernel NAME,NAME] [--skip 16]   (default: sample_kernel,argmax_split_kernel)
  TRACE.csv: what tools/bench/kernel_trace.cc writes (scripts/gpu-check.sh bench `profile` runs both), or
  `nsys stats --report cuda_gpu_trace --format csv` of a run under `nsys profile --cuda-graph-trace=node`.

A decode step is the run of kernels that ends with the sampling kernel. For each kernel name over the
steady-state steps (the first --skip steps and any step whose kernel count differs from the most common
one are left out) it prints: calls per step, mean duration, and mean *advance* -- how far the kernel's end
moves the step's running end time (end_i - max(end_j, j < i)): with programmatic dependent launch the
kernels overlap, so the durations add up to more than the step; the advances add up to the step exactly.
"""
import csv
import re
import sys
from collections import Counter, defaultdict


def short(name: str) -> str:
    name = re.sub(r"^void ", "", name)
    name = name.replace("(anonymous namespace)::", "").replace("nb::cuda::", "")
    name = re.sub(r"\((nb::cuda::)?WKind\)", "K", name)  # template arguments (WKind)3 -> K3
    name = re.sub(r"\(.*$", "", name)  # arguments
    return name


def main() -> int:
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    path, last, skip = args[0], "sample_kernel,argmax_split_kernel", 16
    if "--last-kernel" in args:
        last = args[args.index("--last-kernel") + 1]
    if "--skip" in args:
        skip = int(args[args.index("--skip") + 1])
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            name = r.get("Name", "")
            if not name or "memcpy" in name.lower() or "memset" in name.lower() or name.startswith("["):
                continue
            start = int(float(r["Start (ns)"]))
            dur = int(float(r["Duration (ns)"]))
            rows.append((start, start + dur, short(name)))
    rows.sort()
    steps, cur = [], []
    for k in rows:
        cur.append(k)
        if any(n in k[2] for n in last.split(",")):
            steps.append(cur)
            cur = []
    if not steps:
        print(f"no step ends with a kernel named like {last}")
        return 1
    common = Counter(len(s) for s in steps).most_common(1)[0][0]
    keep = [s for s in steps[skip:] if len(s) == common]
    print(f"steps: {len(steps)} found, {len(keep)} kept (kernels per step: {common})")
    dur, adv, calls = defaultdict(float), defaultdict(float), Counter()
    total = 0.0
    for s in keep:
        end = s[0][0]
        total += (s[-1][1] - s[0][0])
        for (a, b, n) in s:
            dur[n] += b - a
            adv[n] += max(0, b - end)
            end = max(end, b)
            calls[n] += 1
    n_steps = len(keep)
    total /= n_steps
    print(f"mean step (first kernel start to sampling end): {total / 1000:.1f} us")
    gaps = [b[0][0] - a[-1][1] for a, b in zip(steps[skip:], steps[skip + 1:])]
    if gaps:
        gaps.sort()
        print(f"median gap between steps (sampling end to the next step's first kernel; host): "
              f"{gaps[len(gaps) // 2] / 1000:.1f} us")
    print()
    print("| kernel | calls/step | mean us | advance us/step | % of step |")
    print("|---|---|---|---|---|")
    for n in sorted(adv, key=lambda n: -adv[n]):
        c = calls[n] / n_steps
        print(f"| {n[:90]} | {c:.0f} | {dur[n] / calls[n] / 1000:.2f} | {adv[n] / n_steps / 1000:.1f} | "
              f"{100 * adv[n] / n_steps / total:.1f}% |")
    # One layer of a middle step in time order: start and end relative to the step's first kernel.
    s = keep[len(keep) // 2]
    t0 = s[0][0]
    print()
    print("one step, kernels 0..40 in time order (us from the step's start):")
    for (a, b, n) in s[:40]:
        print(f"  {(a - t0) / 1000:8.2f} {(b - t0) / 1000:8.2f}  {(b - a) / 1000:6.2f}  {n[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
