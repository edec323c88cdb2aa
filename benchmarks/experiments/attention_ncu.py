"""Experiment (H200, under Nsight Compute): one D128 forward+backward at L 2048 (not causal, B 8, H 16, bf16), for
per-instruction warp-stall sampling of the one-pass backward kernel, then a summary of the report:

    ncu --kernel-name regex:_attn_bwd_hopper --set full --import-source yes -o bwd \\
        python benchmarks/experiments/attention_ncu.py
    ncu --import bwd.ncu-rep --page source --csv --print-source sass > bwd.csv
    python benchmarks/experiments/attention_ncu.py bwd.csv

The summary: each stall reason's samples over the kernel, and the instructions with the most samples, with the
reasons that hold them.
"""
import csv
import sys

if len(sys.argv) > 1:
    lines = open(sys.argv[1]).read().splitlines()
    rows = list(csv.DictReader(lines[next(i for i, x in enumerate(lines) if x.startswith('"Address"')):]))
    cols = list(rows[0])
    total_col = next(c for c in cols if "Warp Stall Sampling (All" in c)
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0
    totals = {c: sum(num(r[c]) for r in rows) for c in reasons + [total_col]}
    print("samples by reason:", sorted(((round(v), c) for c, v in totals.items()), reverse=True)[:25])
    src = next(c for c in cols if c.lower() in ("source", "sass"))
    addr = next((c for c in cols if "Address" in c), None)
    for r in sorted(rows, key=lambda r: -num(r[total_col]))[:60]:
        top = sorted(((num(r[c]), c) for c in reasons if num(r[c]) > 0), reverse=True)[:3]
        why = ", ".join(f"{c}={v:.0f}" for v, c in top)
        print(f"{r.get(addr, '')} {num(r[total_col]):7.0f} {r[src][:70]:70s} {why}")
    sys.exit()

import torch  # noqa: E402

import fusedlayers as fl  # noqa: E402

q, k, v = (torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
fl.scaled_dot_product_attention(q, k, v).backward(g)
torch.cuda.synchronize()
