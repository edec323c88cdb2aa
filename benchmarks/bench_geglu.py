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

import torch
import torch.nn.functional as F
from bench_rms_norm import liger_unavailable
from bench_swiglu import run

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


if __name__ == "__main__":
    run("geglu", peers(), SHAPES, ", GELU's tanh form")
