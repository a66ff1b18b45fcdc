#!/usr/bin/env python3
"""Where ptxas put a one-token kernel's weight loads relative to its walk's math, from `cuobjdump -sass`.

The walk (gemv_fp4_stream.cu) computes a unit while the next unit's weights load; it is unrolled twice
(the register buffers swap), so each kernel shows two runs of HMMA (one per step), and each step's 16-byte
weight loads (LDG.E.128) should come before its run. The eighteenth session (bench/NOTES.md) found ptxas
putting the MoE FC1 walk's second-step loads at the end of that step's math -- every other unit then waits
for its weights -- and the same walk source compiling to schedules whose rounds differed by 25 % depending on
the code around it. Check here before measuring a change to these kernels.

Usage: cuobjdump -sass -arch sm_90a OBJ > X.sass; walk_loads.py X.sass [--mix] [NAME-SUBSTRING ...]
(default: every stream_* kernel). Prints, per kernel: instructions, HMMA runs (first..last index, count),
and for each run the 16-byte loads issued within the 120 instructions before it and inside it. --mix also
prints the walk loop's size per unit (the backward branch around the HMMA runs, divided by the runs in it)
and its most frequent opcodes per unit: the walks run at a fixed rate of instructions per SM (NOTES.md
nineteenth session), so this count is what a change to the unit's code moves. (The loop includes paths a
given weight does not take, e.g. the multi-part lookups of the linear kernel.)"""
import re
import sys
from collections import Counter


def kernels(lines):
    name, body = None, []
    for line in lines:
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                yield name, body
            name, body = m.group(1), []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and name:
            body.append(m.group(2))
    if name:
        yield name, body


def runs(idx, gap=60):
    out = []
    for i in idx:
        if out and i - out[-1][-1] <= gap:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def short(name):
    """The kernel's name and template arguments, without the namespace prefix and parameter list."""
    m = re.search(r"\d+(stream_\w+?)EEEv", name)
    return m.group(1) if m else name[:110]


def loop_mix(body, hmma_runs):
    """Instructions per unit in the smallest backward-branch loop holding every HMMA run, and its opcodes."""
    best = None
    for i, t in enumerate(body):
        m = re.search(r"BRA\b.*?0x([0-9a-f]+)\s*$", t)
        if not m:
            continue
        target = int(m.group(1), 16) // 16  # (sm_90 instructions are 16 bytes)
        if target >= i:
            continue
        inside = [r for r in hmma_runs if target <= r[0] and r[-1] <= i]
        if len(inside) == len(hmma_runs) and (best is None or i - target < best[1] - best[0]):
            best = (target, i, len(inside))
    if not best:
        return None
    lo, hi, units = best
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body[lo:hi + 1])
    return (hi - lo + 1) / units, {k: v / units for k, v in ops.most_common(12)}


def main():
    args = sys.argv[1:]
    mix = "--mix" in args
    args = [a for a in args if a != "--mix"]
    path, want = args[0], args[1:] or ["stream_"]
    with open(path) as f:
        lines = f.read().split("\n")
    for name, body in kernels(lines):
        if not any(w in name for w in want):
            continue
        hmma = [i for i, t in enumerate(body) if "HMMA" in t]
        ldg = [i for i, t in enumerate(body) if "LDG.E.128" in t]
        print(f"{short(name)}\n  {len(body)} instructions, {len(hmma)} HMMA")
        for r in runs(hmma):
            before = [i - r[0] for i in ldg if r[0] - 120 <= i < r[0]]
            inside = [i - r[0] for i in ldg if r[0] <= i <= r[-1]]
            flag = "  <- loads inside the math" if inside else ""
            print(f"  HMMA {r[0]}..{r[-1]} ({len(r)}): LDG.128 before {before}, inside {inside}{flag}")
        if mix and hmma:
            got = loop_mix(body, runs(hmma))
            if got:
                per_unit, ops = got
                print(f"  walk loop: {per_unit:.0f} instructions per unit; " +
                      ", ".join(f"{k} {v:.0f}" for k, v in ops.items()))


if __name__ == "__main__":
    main()
