"""Benchmark fl.geglu (GELU's tanh form, Gemma's ``gelu_pytorch_tanh``) against torch (``F.gelu(gate,
approximate="tanh") * up``), torch.compile and Liger-Kernel's GEGLU (GPU).

Memory-bound, measured as ``bench_swiglu.py`` (TB/s, the fraction of a device-to-device copy in the same run, the
same bytes counted: forward 3 tensors, forward+backward 8). bf16, (rows, intermediate) of Gemma-sized MLPs (Gemma
2B 16384, Gemma 7B 24576, Gemma 2 9B 14336, Gemma 2 2B 9216 at 64K tokens).

    python benchmarks/bench_geglu.py [--out benchmarks/results/<device>-geglu.md] [--rounds 3]

Liger-Kernel is optional (``liger_kernel.ops.geglu.LigerGELUMulFunction``, the tanh form); its column is skipped
without it. Its backward writes over its inputs and dy: it is given its own copies.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
import torch.nn.functional as F
import triton
from bench_rms_norm import liger_unavailable, table
from bench_swiglu import rows_to_time
from timing import copy_bandwidth, report, time_rows

import fusedlayers as fl

SHAPES = [(16384, 16384), (16384, 24576), (16384, 14336), (65536, 9216)]


def stock(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def peers() -> dict:
    result = {"fused": lambda gate, up: fl.geglu(gate, up, "tanh"), "torch": stock,
              "compile": torch.compile(stock, dynamic=False)}
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
    except ImportError as e:
        liger_unavailable(e)
    else:
        result["liger"] = LigerGELUMulFunction.apply
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    rows = rows_to_time(peers(), SHAPES, "geglu")
    time_rows(rows, copy_bw, args.rounds)
    header = (
        f"# geglu — {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}. bf16 gate and up of (rows, intermediate) = {SHAPES}, GELU's tanh form; "
        f"device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write) measured in the same run. Each row: the best "
        f"of {args.rounds} interleaved rounds of a do_bench median; fwd+bwd computes both gradients.\n"
        "Bytes: fwd 3 tensors (gate, up read; out written), fwd+bwd 8 (+ dy, gate, up read; dgate, dup written). "
        "Target: >= 90% of copy and >= 1.0x the best of torch.compile and Liger in every row.\n\n"
    )
    report(header + table(rows).replace("| hidden |", "| intermediate |") + "\n", args.out)


if __name__ == "__main__":
    main()
