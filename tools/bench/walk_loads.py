#!/usr/bin/env python3
"""Where ptxas put a one-token kernel's weight loads relative to its walk's math, from `cuobjdump -sass`.

The walk (gemv_fp4_stream.cu) computes a unit while the next unit's weights load; it is unrolled twice
(the register buffers swap), so each kernel shows two runs of HMMA (one per step), and each step's 16-byte
weight loads (LDG.E.128) should come before its run. The eighteenth session (bench/NOTES.md) found ptxas
putting the MoE FC1 walk's second-step loads at the end of that step's math -- every other unit then waits
for its weights -- and the same walk source compiling to schedules whose rounds differed by 25 % depending on
the code around it. Check here before measuring a change to these kernels.

Usage: cuobjdump -sass -arch sm_90a OBJ > X.sass; walk_loads.py X.sass [NAME-SUBSTRING ...]
(default: every stream_* kernel). Prints, per kernel: instructions, HMMA runs (first..last index, count),
and for each run the 16-byte loads issued within the 120 instructions before it and inside it."""
import re
import sys


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


def main():
    path, want = sys.argv[1], sys.argv[2:] or ["stream_"]
    with open(path) as f:
        lines = f.read().split("\n")
    for name, body in kernels(lines):
        if not any(w in name for w in want):
            continue
        hmma = [i for i, t in enumerate(body) if "HMMA" in t]
        ldg = [i for i, t in enumerate(body) if "LDG.E.128" in t]
        print(f"{name[:110]}\n  {len(body)} instructions, {len(hmma)} HMMA")
        for r in runs(hmma):
            before = [i - r[0] for i in ldg if r[0] - 120 <= i < r[0]]
            inside = [i - r[0] for i in ldg if r[0] <= i <= r[-1]]
            flag = "  <- loads inside the math" if inside else ""
            print(f"  HMMA {r[0]}..{r[-1]} ({len(r)}): LDG.128 before {before}, inside {inside}{flag}")


if __name__ == "__main__":
    main()
