"""Benchmark fl.swiglu against torch (``F.silu(gate) * up``), torch.compile and Liger-Kernel's SwiGLU (GPU).

Memory-bound: reports TB/s and the fraction of a device-to-device copy measured in the same run. bf16, (rows,
intermediate) = Llama-sized MLP activations (16K x 11008, 16K x 14336, 64K x 8192 ...). Bytes counted: forward 3
tensors (read gate and up, write out), forward+backward 3 + 5 (+ read dy, gate and up; write dgate and dup).

    python benchmarks/bench_swiglu.py [--out benchmarks/results/<device>-swiglu.md] [--rounds 3]

Liger-Kernel is optional (``liger_kernel.ops.swiglu.LigerSiLUMulFunction``); its column is skipped without it. Its
backward writes the gradients over its saved inputs and dy in place: it is given its own copies.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
import torch.nn.functional as F
import triton
from bench_rms_norm import forward_backward, liger_unavailable, table
from timing import copy_bandwidth, report, time_rows

import fusedlayers as fl

# (rows, intermediate): Llama-2 7B (11008), Llama-3 8B (14336), 2048-hidden models (8192 at 64K tokens)
SHAPES = [(16384, 11008), (16384, 14336), (32768, 11008), (65536, 8192)]


def stock(gate, up):
    return F.silu(gate) * up


def peers() -> dict:
    result = {"fused": fl.swiglu, "torch": stock, "compile": torch.compile(stock, dynamic=False)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError as e:
        liger_unavailable(e)
    else:
        result["liger"] = LigerSiLUMulFunction.apply
    return result


def rows_to_time(peers: dict, shapes: list, op: str) -> list[dict]:
    """fwd and fwd+bwd rows of each peer ``f(gate, up)`` (Liger's given copies: it writes over its inputs) at each
    (rows, intermediate) shape, bf16."""
    rows = []
    for n_rows, inter in shapes:
        shape = (n_rows, inter)
        gate = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        up = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for name, f in peers.items():
            if name == "liger":  # in place over its inputs and dy: its own copies
                inputs = [gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()]
                grads = [grad.clone()]
            else:
                inputs, grads = [gate, up], [grad]
            label = f"{op} {n_rows // 1024}K rows"
            rows.append(dict(op=label, cols=inter, mode="fwd", impl=name, n_bytes=3 * gate.numel() * 2,
                             fn=lambda f=f, inputs=inputs: f(*inputs)))
            rows.append(dict(op=label, cols=inter, mode="fwd+bwd", impl=name, n_bytes=8 * gate.numel() * 2,
                             fn=forward_backward(f, inputs, grads)))
    return rows


def run(op: str, peers: dict, shapes: list, what: str = "") -> None:
    """The command line of this benchmark and ``bench_geglu.py``: time ``peers`` at ``shapes``, print / write the
    table (``what``: a word on the op's variant for the header)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    rows = rows_to_time(peers, shapes, op)
    time_rows(rows, copy_bw, args.rounds)
    header = (
        f"# {op} — {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}. bf16 gate and up of (rows, intermediate) = {shapes}{what}; "
        f"device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write) measured in the same run. Each row: the best "
        f"of {args.rounds} interleaved rounds of a do_bench median; fwd+bwd computes both gradients.\n"
        "Bytes: fwd 3 tensors (gate, up read; out written), fwd+bwd 8 (+ dy, gate, up read; dgate, dup written). "
        "Target: >= 90% of copy and >= 1.0x the best of torch.compile and Liger in every row.\n\n"
    )
    report(header + table(rows).replace("| hidden |", "| intermediate |") + "\n", args.out)


if __name__ == "__main__":
    run("swiglu", peers(), SHAPES)
