#!/usr/bin/env python3
"""Per-instruction stall samples from an `ncu --page source --csv --print-source sass` export
(scripts/gpu-ncu.sh): totals by stall reason, by opcode, and the hottest instructions with their reasons.
Usage: ncu_stalls.py FILE.sass.csv [--top N] [--range LO HI] (LO/HI: instruction addresses, hex)."""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--range", nargs=2, default=None)
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    idx = {c: i for i, c in enumerate(cols)}
    reasons = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
    lo, hi = (int(a.range[0], 16), int(a.range[1], 16)) if a.range else (0, 1 << 62)
    by_reason = collections.Counter()
    by_op = collections.Counter()
    execd = collections.Counter()
    insts = []
    total = 0
    for r in rows[head + 1:]:
        if len(r) < len(cols):
            continue
        try:
            addr = int(r[idx["Address"]], 16)
        except ValueError:
            continue
        if not lo <= addr < hi:
            continue
        src = r[idx["Source"]].strip()
        n = int(float(r[idx["Warp Stall Sampling (All Samples)"]] or 0))
        ex = int(float(r[idx["Instructions Executed"]] or 0))
        op = src.split()[0] if src else "?"
        if op.startswith("@"):
            op = src.split()[1]
        op = op.split(".")[0]
        total += n
        by_op[op] += n
        execd[op] += ex
        rs = {c[6:]: int(float(r[idx[c]] or 0)) for c in reasons}
        for k, v in rs.items():
            by_reason[k] += v
        insts.append((n, addr, src, rs, ex))
    print(f"samples {total}, instructions executed {sum(execd.values())}")
    print("by reason:", ", ".join(f"{k} {100 * v / max(total, 1):.1f}%" for k, v in by_reason.most_common(10)))
    print("by opcode (samples %, executed):")
    for k, v in by_op.most_common(16):
        print(f"  {k:10s} {100 * v / max(total, 1):5.1f}%  {execd[k]}")
    print(f"top {a.top} instructions:")
    for n, addr, src, rs, ex in sorted(insts, reverse=True)[: a.top]:
        top = ", ".join(f"{k} {v}" for k, v in sorted(rs.items(), key=lambda kv: -kv[1])[:3] if v)
        print(f"  {addr:05x} {100 * n / max(total, 1):4.1f}% ex {ex:7d}  {src[:60]:60s} {top}")


if __name__ == "__main__":
    main()
