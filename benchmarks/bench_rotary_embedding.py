"""Benchmark fl.rotary_embedding against transformers' apply_rotary_pos_emb (eager and torch.compile) and Liger-Kernel's
LigerRopeFunction (GPU).

Memory-bound: reports TB/s and the fraction of a device-to-device copy measured in the same run. Shapes (bf16): q
and k are views of (B, T, H, D) projections transposed to (B, H, T, D), as in transformers' attention, D=128 and
H_kv = H/4 (GQA); query hidden sizes H*D of 2048, 4096 and 8192 at B*T = 16K positions (B=4, T=4096) and 4096 at 64K
positions (B=16); cos/sin (1, T, D) as transformers' rotary embedding returns them for position_ids of batch 1.
Bytes counted: forward reads q, k and writes q', k' (2 x (q + k)), forward+backward also reads dq', dk' and writes
dq, dk (4 x (q + k)); cos/sin (2 MiB) are not counted. At 16K positions and hidden 2048 a forward+backward moves
about 0.3 ms of data: the rows there show host time as much as the kernels (each impl's eager launch cost).

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
from bench_rms_norm import forward_backward, liger_unavailable, table
from timing import copy_bandwidth, report, time_rows

import fusedlayers as fl

D = 128
SHAPES = [(4, 4096, 16), (4, 4096, 32), (4, 4096, 64), (16, 4096, 32)]  # (B, T, query heads); H_kv = H / 4


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
    result = []
    impls = peers()
    for B, T, H in SHAPES:
        H_KV = H // 4
        qk_bytes = B * T * (H + H_KV) * D * 2
        q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k = torch.randn(B, T, H_KV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        pos = torch.arange(T, device="cuda", dtype=torch.float32)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
        emb = torch.cat((pos[:, None] * inv_freq,) * 2, dim=-1)[None]
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
        grads = [torch.randn_like(q), torch.randn_like(k)]
        op = f"rotary {B * T // 1024}K positions"
        for name, f in impls.items():
            g = [t.clone() for t in grads] if name == "liger" else grads

            def call(f=f, q=q, k=k, cos=cos, sin=sin):
                return f(q, k, cos, sin)

            common = dict(op=op, cols=H * D, impl=name)
            result.append(dict(common, mode="fwd", n_bytes=2 * qk_bytes, fn=call))
            fb = forward_backward(lambda a, b, f=f, cos=cos, sin=sin: f(a, b, cos, sin), [q, k], g)
            result.append(dict(common, mode="fwd+bwd", n_bytes=4 * qk_bytes, fn=fb))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    table_rows = rows()
    time_rows(table_rows, copy_bw, args.rounds)
    header = (
        f"# rotary_embedding — {torch.cuda.get_device_name()}\n\n{datetime.date.today()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, python {platform.python_version()}. bf16, D={D}, H_kv = H/4, 'hidden' = H*D of "
        f"q; q/k transposed views of (B, T, H, D); device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write) "
        f"measured in the same run. Each row: the best of {args.rounds} interleaved rounds of a do_bench median. "
        "Bytes: fwd 2 x (q + k), fwd+bwd 4 x (q + k). Target: >= 90% of copy and >= 1.0x the best of torch.compile "
        "and Liger in every row.\n\n"
    )
    report(header + table(table_rows) + "\n", args.out)


if __name__ == "__main__":
    main()
