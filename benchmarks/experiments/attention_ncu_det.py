"""Experiment (H200, under Nsight Compute): the deterministic mode's two D128 backward passes at L 4096 (not causal,
B 4, H 16, bf16): the dQ pass (`_attn_bwd_dq_hopper`, one query block a program) and the warp-specialized dK/dV pass
(`_attn_bwd_hopper` without dQ), whose tile products run about 20% slower than the dQ pass's (`--kernels`), to see
where; then a summary of the dK/dV pass's per-instruction warp-stall samples:

    ncu --kernel-name regex:"_attn_bwd_hopper|_attn_bwd_dq_hopper" --launch-skip 2 --launch-count 2 --set full \
        --import-source yes -o det python benchmarks/experiments/attention_ncu_det.py
    ncu --import det.ncu-rep --kernel-name _attn_bwd_hopper --page source --csv --print-source sass > dkdv.csv
    python benchmarks/experiments/attention_ncu_det.py dkdv.csv

The summary: each stall reason's samples over the kernel, and the instructions with the most samples, with the
reasons that hold them.
"""
import csv
import sys

if len(sys.argv) > 1:
    lines = open(sys.argv[1]).read().splitlines()
    first = next(i for i, line in enumerate(lines) if "Warp Stall Sampling" in line)  # past the kernel-name line
    rows = list(csv.DictReader(lines[first:]))
    cols = list(rows[0])
    print("columns:", cols)
    total_col = next(c for c in cols if "Warp Stall Sampling (All" in c)
    reasons = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != total_col and "Not" not in c]

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0
    totals = {c: sum(num(r[c]) for r in rows) for c in reasons + [total_col]}
    print("samples by reason:", sorted(((round(v), c) for c, v in totals.items()), reverse=True)[:25])
    src = next(c for c in cols if c.lower() in ("source", "sass"))
    addr = next((c for c in cols if "Address" in c), None)
    for r in sorted(rows, key=lambda r: -num(r[total_col]))[:70]:
        top = sorted(((num(r[c]), c) for c in reasons if num(r[c]) > 0), reverse=True)[:3]
        why = ", ".join(f"{c}={v:.0f}" for v, c in top)
        print(f"{r.get(addr, '')} {num(r[total_col]):7.0f} {r[src][:70]:70s} {why}")
    sys.exit()

import torch  # noqa: E402

import fusedlayers as fl  # noqa: E402

q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
with fl.use_deterministic_attention(True):
    for _ in range(2):
        fl.scaled_dot_product_attention(q, k, v).backward(g)
torch.cuda.synchronize()
