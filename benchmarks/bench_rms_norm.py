"""Benchmark fl.rms_norm (plain and with the fused residual add) against torch, torch.compile and Liger-Kernel (GPU).

Memory-bound: reports TB/s and the fraction of a device-to-device copy measured in the same run. Bytes counted (bf16,
256 MiB per tensor, hidden 2048 / 4096 / 8192 = 64K / 32K / 16K rows): forward 2 tensors (read x, write y),
forward+backward 5 (+ read dy, read x, write dx); with the residual, forward 4 (read x and r, write y and h = x + r),
forward+backward 8 (+ read dy, dh and h, write dx = dr). The weight, its gradient and the per-row statistics are not
counted (a few MB).

    python benchmarks/bench_rms_norm.py [--out benchmarks/results/<device>-rms_norm.md] [--tune] [--rounds 3]

Liger-Kernel is optional (pip install liger-kernel); its column is skipped without it. Its RMSNorm runs
with its defaults (casting mode "llama", backward in place over dy: it is given its own copy of dy).
bench_layer_norm.py reuses this script's machinery.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform

import torch
import torch.nn.functional as F
import triton
from timing import TENSOR_BYTES, copy_bandwidth, median_ms, report, time_rows, unstable_rows

import fusedlayers as fl
from fusedlayers.kernels import _norm as kernels

COLS = [2048, 4096, 8192]
EPS = 1e-6


def forward_backward(f, inputs, grads):
    """A call of f(*inputs) and the gradients of every input (all require grad) for upstream ``grads``."""
    def run():
        out = f(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, inputs, grads[: len(outs)])

    return run


def liger_unavailable(e: Exception) -> None:
    if not getattr(liger_unavailable, "said", False):
        print(f"liger_kernel unavailable ({type(e).__name__}: {e}): no Liger column")
        liger_unavailable.said = True


def liger_rms_norm(hidden: int):
    """Liger's RMSNorm module and its fused add + RMSNorm (None where liger_kernel lacks them)."""
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError as e:
        liger_unavailable(e)
        return None, None
    norm = LigerRMSNorm(hidden, eps=EPS).to("cuda", torch.bfloat16)
    try:
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
        add_norm = LigerFusedAddRMSNorm(hidden, eps=EPS).to("cuda", torch.bfloat16)
    except ImportError:
        add_norm = None
    return norm, add_norm


def rms_norm_peers(hidden: int, residual: bool, params: list) -> dict:
    """name -> f(x, w[, r]) for every peer (Liger's modules get ``params`` as theirs)."""
    def stock(x, w, r=None):
        h = x + r if r is not None else x
        y = F.rms_norm(h, (hidden,), w, EPS)
        return (y, h) if r is not None else y

    peers = {
        "fused": lambda x, w, r=None: fl.rms_norm(x, (hidden,), w, EPS, residual=r),
        "torch": stock,
        "compile": torch.compile(stock, dynamic=False),
    }
    norm, add_norm = liger_rms_norm(hidden)
    if residual and add_norm is not None:
        add_norm.weight = params[0]
        peers["liger"] = lambda x, w, r: add_norm(x, r)
    elif not residual and norm is not None:
        norm.weight = params[0]
        peers["liger"] = lambda x, w: norm(x)
    return peers


def norm_rows(op: str, make_peers, param_names: tuple[str, ...]) -> list[dict]:
    """Rows to time: every peer at every hidden size, plain and with the residual, forward and forward+backward.
    ``make_peers(hidden, residual, params)`` gives name -> f(x, *params[, r])."""
    rows = []
    for hidden, residual in itertools.product(COLS, (False, True)):
        n_rows = TENSOR_BYTES // (2 * hidden)
        x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        params = [torch.nn.Parameter(torch.randn(hidden, device="cuda", dtype=torch.bfloat16) * 0.5 + 1)
                  for _ in param_names]
        inputs = [x, *params]
        if residual:
            inputs.append(torch.randn_like(x, requires_grad=True))
        grads = [torch.randn_like(x), torch.randn_like(x)]
        fwd_tensors, fb_tensors = (4, 8) if residual else (2, 5)
        for name, f in make_peers(hidden, residual, params).items():
            g = [t.clone() for t in grads] if name == "liger" else grads  # Liger writes dx over dy
            label = f"{op} + residual" if residual else op
            rows.append(dict(op=label, cols=hidden, mode="fwd", impl=name, n_bytes=fwd_tensors * TENSOR_BYTES,
                             fn=lambda f=f, inputs=inputs: f(*inputs)))
            rows.append(dict(op=label, cols=hidden, mode="fwd+bwd", impl=name, n_bytes=fb_tensors * TENSOR_BYTES,
                             fn=forward_backward(f, inputs, g)))
    return rows


def table(rows: list[dict]) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    head = ("| op | hidden | pass | " + " | ".join(f"{i} TB/s (copy frac)" for i in impls)
            + " | fused / best peer | fused / best of compile, Liger |")
    lines = [head, "|" + "---|" * (len(impls) + 5)]
    keys = list(dict.fromkeys((r["op"], r["cols"], r["mode"]) for r in rows))
    for key in keys:
        cells = {r["impl"]: r for r in rows if (r["op"], r["cols"], r["mode"]) == key}
        best_peer = min(r["ms"] for i, r in cells.items() if i != "fused")
        best_target = min(r["ms"] for i, r in cells.items() if i in ("compile", "liger"))
        line = f"| {key[0]} | {key[1]} | {key[2]} | "
        line += " | ".join(f"{cells[i]['tbs']:.2f} ({cells[i]['frac']:.0%})" if i in cells else "-" for i in impls)
        line += f" | {best_peer / cells['fused']['ms']:.3f}x | {best_target / cells['fused']['ms']:.3f}x |"
        lines.append(line)
    lines.append("\n" + unstable_rows(rows))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- --tune

# Swept per hidden size, the backward only (the forward's first choices already run at copy bandwidth): rows per step,
# warps, programs per SM, pipeline depth, each with 4 to 64 elements per thread. The kernel alone on bf16 (x, weight,
# dx, dw, and db for LayerNorm). Programs per SM is a launch parameter: configs that differ only there share a compile.
TUNE_BACKWARD = ([(1, w, p, s) for w in (8, 16, 32) for p in (1, 2, 4) for s in (2, 3)]
                 + [(1, w, 1, 1) for w in (8, 16, 32)] + [(2, 16, 2, 2), (2, 32, 1, 2), (4, 32, 1, 2)])


def _per_thread(block_m: int, warps: int, hidden: int) -> int:
    return block_m * hidden // (32 * warps)


def tune(copy_bw: float, rms: bool) -> list[str]:
    """Sweep backward kernel configs per hidden size; prints the fraction of copy bandwidth of the kernel alone (3
    tensors), and keeps the best in BWD_CONFIGS for the rest of the run. Returns those entries, as lines to paste into
    fusedlayers/kernels/_norm.py."""
    chosen = []
    op = "rms" if rms else "layer"
    for hidden in COLS:
        x = torch.randn(TENSOR_BYTES // (2 * hidden), hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        b = None if rms else torch.randn_like(w)
        g = torch.randn_like(x)
        _, _, stats = kernels.norm_forward(x, hidden, w, b, None, EPS, x.dtype, rms)
        results = []
        for config in [tuple(kernels.backward_config(hidden, rms)), *TUNE_BACKWARD]:
            if not 4 <= _per_thread(config[0], config[1], hidden) <= 64:
                continue
            kernels.BWD_CONFIGS[(op, hidden)] = kernels.BwdConfig(*config)
            kernels.forget_plans()
            try:
                ms = median_ms(lambda: kernels.norm_backward(g, x, hidden, w, stats, None, x.dtype, True, True,
                                                             not rms, rms, bias_dtype=w.dtype))
                frac = 3 * TENSOR_BYTES / (ms * 1e-3) / copy_bw
                results.append((frac, kernels.BwdConfig(*config)))
                print(f"tune {op} hidden={hidden} bwd {kernels.BwdConfig(*config)}: {frac:.3f}", flush=True)
            except Exception as e:  # e.g. out of resources
                print(f"tune {op} hidden={hidden} bwd {kernels.BwdConfig(*config)}: {type(e).__name__}")
        kernels.BWD_CONFIGS.pop((op, hidden), None)
        if results:
            frac, best = max(results, key=lambda r: r[0])
            kernels.BWD_CONFIGS[(op, hidden)] = best
            chosen.append(f"BWD_CONFIGS[({op!r}, {hidden})] = {best!r}  # kernel alone {frac:.3f} of copy")
            print("best", chosen[-1], f"(first choice {results[0][0]:.3f})", flush=True)
        kernels.forget_plans()
    return chosen


def main(op: str = "rms_norm", make_peers=rms_norm_peers, param_names=("weight",), rms: bool = True,
         peers_note: str = "") -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--tune", action="store_true",
                        help="first sweep backward kernel configs; the best run the table (and are printed)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    chosen = tune(copy_bw, rms) if args.tune else []
    rows = norm_rows(op, make_peers, param_names)
    time_rows(rows, copy_bw, args.rounds)
    header = (
        f"# {op} — {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}. bf16, 256 MiB per tensor (hidden 2048 / 4096 / 8192: 64K / 32K / 16K "
        f"rows), weight{'s' if len(param_names) > 1 else ''} bf16; device-to-device copy {copy_bw / 1e12:.2f} TB/s "
        f"(read + write) measured in the same run. Each row: the best of {args.rounds} interleaved rounds of a "
        "do_bench median (every row timed once per round); fwd+bwd computes the gradients of the input, the "
        "parameters (and the residual).\n"
        "Bytes: fwd 2 tensors (x read, y written), fwd+bwd 5 (+ dy read, x read, dx written); with the residual fwd "
        "4 (x, r read; y, h written), fwd+bwd 8 (+ dy, dh, h read; dx written). Target: >= 90% of copy and >= 1.0x "
        f"the best of torch.compile and Liger in every row.{peers_note}\n\n"
    )
    if chosen:
        header += "Kernel configs tuned in this run (--tune), used by the fused rows:\n\n" + "\n".join(
            f"    {line}" for line in chosen) + "\n\n"
    report(header + table(rows) + "\n", args.out)


if __name__ == "__main__":
    main()
