#!/usr/bin/env python3
"""Where a whole run's GPU time goes, per kernel, from a kernel trace (tools/bench/kernel_trace.cc's CSV, or
`nsys stats --report cuda_gpu_trace --format csv`): calls, total and mean duration, share of the summed time.
For prefill and GEMM runs, where decode_timeline.py's per-step view does not apply.

Usage: kernel_sums.py TRACE.csv [--top 25] [--per N]   (--per N: totals divided by N, e.g. the number of
forward passes the run timed, so that rows read per pass)
"""
import csv
import sys
from collections import Counter, defaultdict

from decode_timeline import short


def main() -> int:
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    top = int(args[args.index("--top") + 1]) if "--top" in args else 25
    per = float(args[args.index("--per") + 1]) if "--per" in args else 1.0
    dur, calls = defaultdict(float), Counter()
    with open(args[0], newline="") as f:
        for r in csv.DictReader(f):
            name = r.get("Name", "")
            if not name or "memcpy" in name.lower() or "memset" in name.lower() or name.startswith("["):
                continue
            n = short(name)
            dur[n] += float(r["Duration (ns)"])
            calls[n] += 1
    total = sum(dur.values())
    print(f"kernels: {sum(calls.values())} calls, {total / 1e3 / per:.1f} us summed" + (f" per {per:g}" if per != 1 else ""))
    print()
    print("| kernel | calls | total us | mean us | % |")
    print("|---|---|---|---|---|")
    for n, d in sorted(dur.items(), key=lambda x: -x[1])[:top]:
        print(f"| {n[:110]} | {calls[n] / per:g} | {d / 1e3 / per:.1f} | {d / 1e3 / calls[n]:.2f} | {100 * d / total:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
