"""Benchmark fl.layer_norm (plain and with the fused residual add) against torch, torch.compile and Liger-Kernel (GPU).

Memory-bound: TB/s and the fraction of a device-to-device copy measured in the same run, bytes counted as in
bench_rms_norm.py (whose machinery this script reuses): forward 2 tensors, forward+backward 5; with the residual 4
and 8.

    python benchmarks/bench_layer_norm.py [--out benchmarks/results/<device>-layer_norm.md] [--tune] [--rounds 3]

Liger-Kernel is optional (pip install liger-kernel); its column is skipped without it. Liger has no fused
add + LayerNorm: the residual rows compare with torch and torch.compile only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_rms_norm import liger_unavailable, main

import fusedlayers as fl

EPS = 1e-5


def layer_norm_peers(hidden: int, residual: bool, params: list) -> dict:
    """name -> f(x, w, b[, r]) for every peer."""
    def stock(x, w, b, r=None):
        h = x + r if r is not None else x
        y = F.layer_norm(h, (hidden,), w, b, EPS)
        return (y, h) if r is not None else y

    peers = {
        "fused": lambda x, w, b, r=None: fl.layer_norm(x, (hidden,), w, b, EPS, residual=r),
        "torch": stock,
        "compile": torch.compile(stock, dynamic=False),
    }
    if not residual:
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            peers["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
        except ImportError as e:
            liger_unavailable(e)
    return peers


if __name__ == "__main__":
    main("layer_norm", layer_norm_peers, ("weight", "bias"), rms=False,
         peers_note=" Liger has no fused add + LayerNorm: its residual cells are empty.")
