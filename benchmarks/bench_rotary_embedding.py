"""Benchmark fl.rotary_embedding against transformers' apply_rotary_pos_emb (eager and torch.compile) and Liger-Kernel's
LigerRopeFunction (GPU).

Memory-bound: reports TB/s and the fraction of a device-to-device copy measured in the same run. Shapes (bf16): B*T =
16K positions (B=4, T=4096), H=32 query heads, H_kv=8 key heads, D=128; q and k are views of (B, T, H, D)
projections transposed to (B, H, T, D), as in transformers' attention; cos/sin (1, T, D) as transformers' rotary
embedding returns them for position_ids of batch 1. Bytes counted: forward reads q, k and writes q', k' (2 x 160 MiB),
forward+backward also reads dq', dk' and writes dq, dk (4 x 160 MiB); cos/sin (2 MiB) are not counted.

    python benchmarks/bench_rotary_embedding.py [--out benchmarks/results/<device>-rotary_embedding.md] [--rounds 3]

Liger-Kernel is optional; its column is skipped without it (its backward works in place on a copy of the upstream
gradients it is given: it gets its own copies).
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
import triton
from bench_rms_norm import copy_bandwidth, forward_backward, liger_unavailable, median_ms
from timing import report, time_rounds

import fusedlayers as fl

B, T, H, H_KV, D = 4, 4096, 32, 8, 128
QK_BYTES = B * T * (H + H_KV) * D * 2


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def stock(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (copied here so that the benchmark runs without transformers)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def peers() -> dict:
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf
    except ImportError:
        hf = stock
    result = {"fused": fl.rotary_embedding, "transformers": hf, "compile": torch.compile(hf, dynamic=False)}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        result["liger"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
    except ImportError as e:
        liger_unavailable(e)
    return result


def rows() -> list[dict]:
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, H_KV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    pos = torch.arange(T, device="cuda", dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    emb = torch.cat((pos[:, None] * inv_freq,) * 2, dim=-1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    grads = [torch.randn_like(q), torch.randn_like(k)]
    result = []
    for name, f in peers().items():
        g = [t.clone() for t in grads] if name == "liger" else grads

        def call(f=f):
            return f(q, k, cos, sin)

        result.append(dict(impl=name, mode="fwd", n_bytes=2 * QK_BYTES, fn=call))
        fb = forward_backward(lambda a, b, f=f: f(a, b, cos, sin), [q, k], g)
        result.append(dict(impl=name, mode="fwd+bwd", n_bytes=4 * QK_BYTES, fn=fb))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    table_rows = rows()
    for row in table_rows:  # compile and warm up everything before the first round
        row["fn"]()
    torch.cuda.synchronize()
    timed = time_rounds([(row.pop("fn"), median_ms) for row in table_rows], args.rounds)
    for row, times in zip(table_rows, timed, strict=True):
        bw = row["n_bytes"] / (min(times) * 1e-3)
        row.update(ms=min(times), slowest_ms=max(times), tbs=bw / 1e12, frac=bw / copy_bw)
    lines = ["| pass | impl | ms | TB/s | copy frac | fused speed-up |", "|---|---|---|---|---|---|"]
    for mode in ("fwd", "fwd+bwd"):
        cells = [r for r in table_rows if r["mode"] == mode]
        fused_ms = next(r["ms"] for r in cells if r["impl"] == "fused")
        for r in cells:
            lines.append(f"| {mode} | {r['impl']} | {r['ms']:.3f} | {r['tbs']:.2f} | {r['frac']:.0%} | "
                         f"{r['ms'] / fused_ms:.2f}x |")
    spread = [f"{r['mode']} {r['impl']} {r['slowest_ms'] / r['ms']:.2f}x" for r in table_rows
              if r["slowest_ms"] > 1.03 * r["ms"]]
    lines.append("\nRows whose slowest round took over 3% longer than their best: " + (", ".join(spread) or "none"))
    header = (
        f"# rotary_embedding — {torch.cuda.get_device_name()}\n\n{datetime.date.today()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, python {platform.python_version()}. bf16, B={B}, T={T}, H={H}, H_kv={H_KV}, "
        f"D={D}, q/k transposed views of (B, T, H, D); device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write) "
        f"measured in the same run. Each row: the best of {args.rounds} interleaved rounds of a do_bench median. "
        "Bytes: fwd 2 x (q + k), fwd+bwd 4 x (q + k). fused speed-up: the row's time / the fused time.\n\n"
    )
    report(header + "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
