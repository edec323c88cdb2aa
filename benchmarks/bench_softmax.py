"""Benchmark fl.softmax and fl.scaled_masked_softmax against torch, torch.compile and Liger-Kernel (GPU).

Memory-bound: reports TB/s and the fraction of a device-to-device copy measured in the same run.
Bytes counted: forward 2 tensors (read x, write y), forward+backward 5 (+ read grad, read y, write dx).

    python benchmarks/bench_softmax.py [--out benchmarks/results/<device>-softmax.md] [--tune] [--host]

Liger-Kernel is optional (pip install liger-kernel); its column is skipped without it.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import triton
from timing import TENSOR_BYTES, copy_bandwidth, median_ms, report, time_rows, unstable_rows

import fusedlayers as fl
from fusedlayers.kernels import softmax as kernels

COLS = [1024, 4096, 16384, 65536]


def fraction(n_tensors: int, ms: float, copy_bw: float) -> float:
    return n_tensors * TENSOR_BYTES / (ms * 1e-3) / copy_bw


def forward_backward(f, x, grad):
    def run():
        (dx,) = torch.autograd.grad(f(x), x, grad)
        return dx

    return run


def softmax_peers():
    peers = {
        "fused": lambda x: fl.softmax(x, -1),
        "torch": lambda x: torch.softmax(x, -1),
        "compile": torch.compile(lambda x: torch.softmax(x, -1), dynamic=False),
    }
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction

        peers["liger"] = LigerSoftmaxFunction.apply
    except ImportError:
        print("liger_kernel not installed: no Liger column")
    return peers


def bench_softmax() -> list[dict]:
    """Rows to time (each with its fn): every peer at every row length, forward and forward+backward."""
    rows = []
    for n_cols in COLS:
        x = torch.randn(TENSOR_BYTES // (2 * n_cols), n_cols, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_()
        grad = torch.randn_like(x)
        for name, f in softmax_peers().items():
            for mode, n_tensors, fn in (("fwd", 2, lambda f=f, x=x: f(x)),
                                        ("fwd+bwd", 5, forward_backward(f, x, grad))):
                rows.append(dict(op="softmax", cols=n_cols, mode=mode, impl=name, n_bytes=n_tensors * TENSOR_BYTES,
                                 fn=fn))
    return rows


def stock_masked(scores, scale, keep):
    return (scores * scale).masked_fill(~keep, float("-inf")).softmax(-1)


def bench_masked() -> list[dict]:
    """Rows to time: causal scaled-masked softmax on (B*H, L, L) bf16 scores of 256 MiB."""
    rows = []
    compiled = torch.compile(stock_masked, dynamic=False)
    for seq in (1024, 4096):
        scores = torch.randn(TENSOR_BYTES // (2 * seq * seq), seq, seq, device="cuda", dtype=torch.bfloat16)
        scores.requires_grad_()
        grad = torch.randn_like(scores)
        keep = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
        impls = {
            "fused": lambda s: fl.scaled_masked_softmax(s, 0.125, is_causal=True),
            "torch": lambda s, keep=keep: stock_masked(s, 0.125, keep),
            "compile": lambda s, keep=keep: compiled(s, 0.125, keep),
        }
        for name, f in impls.items():
            for mode, n_tensors, fn in (("fwd", 2, lambda f=f, s=scores: f(s)),
                                        ("fwd+bwd", 5, forward_backward(f, scores, grad))):
                rows.append(dict(op="causal masked", cols=seq, mode=mode, impl=name,
                                 n_bytes=n_tensors * TENSOR_BYTES, fn=fn))
    return rows


# Configs tried per row length by --tune: (backward kernel, SPLIT_BLOCK_N, warps, bits); None keeps the shipped choice.
# "one_pass" rows run the row kernels with these warps and bits (the backward's widening by bits, the forward's
# recomputed exp); the forward runs the one-pass kernel where the backward does, else the looped one.
TUNE_CONFIGS = {
    16384: [("one_pass", None, 4, False), ("one_pass", None, 8, True), ("one_pass", None, 16, True),
            ("one_pass", None, 16, False)],
    32768: [("one_pass", None, 16, True), ("one_pass", None, 32, True), ("split", 8192, 8, None),
            ("looped", None, None, None)],
    65536: [("split", 8192, 4, None), ("split", 8192, 8, None), ("split", 16384, 16, None),
            ("looped", None, None, None)],
    131072: [("split", 8192, 8, None), ("looped", None, None, None)],
}


def tune(copy_bw: float) -> None:
    """Sweep kernel configs per row length; prints the fraction of copy bandwidth of the kernels alone."""
    names = ("_row_forward_config", "_row_backward_config", "SPLIT_BLOCK_N", "SPLIT_WARPS")
    shipped = {name: getattr(kernels, name) for name in names}
    for n_cols, configs in TUNE_CONFIGS.items():
        x = torch.randn(TENSOR_BYTES // (2 * n_cols), n_cols, device="cuda", dtype=torch.bfloat16)
        y = torch.softmax(x, -1)
        g = torch.randn_like(x)
        for kernel, block_n, warps, bits in configs:
            kernels.SPLIT_BLOCK_N = block_n or shipped["SPLIT_BLOCK_N"]
            if kernel == "split":
                kernels.SPLIT_WARPS = warps
            elif kernel == "one_pass":
                kernels._row_forward_config = kernels._row_backward_config = lambda *args, c=(warps, bits): c
            forward = "one_pass" if kernel == "one_pass" else "looped"
            kernels.forget_plans()
            try:
                f = median_ms(lambda: kernels.softmax_forward(x, x.dtype, kernel=forward))
                b = median_ms(lambda: kernels.softmax_backward(g, y, 1.0, x.dtype, kernel=kernel))
                fb = 5 * TENSOR_BYTES / ((f + b) * 1e-3) / copy_bw
                result = f"fwd {fraction(2, f, copy_bw):.3f} bwd {fraction(3, b, copy_bw):.3f} fwd+bwd {fb:.3f}"
            except Exception as e:  # e.g. out of shared memory
                result = type(e).__name__
            for name, value in shipped.items():
                setattr(kernels, name, value)
            kernels.forget_plans()
            print(f"tune cols={n_cols} fwd {forward}, bwd {kernel} block={block_n} warps={warps} bits={bits}: "
                  f"{result}", flush=True)


def table(rows: list[dict], copy_bw: float) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    head = "| op | cols | pass | " + " | ".join(f"{i} TB/s (copy frac)" for i in impls) + " | fused / best peer |"
    lines = [head, "|" + "---|" * (impls.__len__() + 4)]
    keys = list(dict.fromkeys((r["op"], r["cols"], r["mode"]) for r in rows))
    for key in keys:
        cells = {r["impl"]: r for r in rows if (r["op"], r["cols"], r["mode"]) == key}
        best_peer = min(r["ms"] for i, r in cells.items() if i != "fused")
        line = f"| {key[0]} | {key[1]} | {key[2]} | "
        line += " | ".join(f"{cells[i]['tbs']:.2f} ({cells[i]['frac']:.0%})" if i in cells else "-" for i in impls)
        line += f" | {best_peer / cells['fused']['ms']:.3f}x |"
        lines.append(line)
    lines.append("\n" + unstable_rows(rows))
    return "\n".join(lines)


def host_time() -> str:
    """Host time per eager fwd+bwd of each peer on a 64 x 1024 bf16 input, where the GPU work is negligible, so a loop
    of calls runs at the speed of the CPU issuing them (best of 5 x 2000 calls). Where it exceeds a kernel's GPU time,
    the benchmark above measures the host."""
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    peers = {**softmax_peers(), "x * 2 (autograd's floor)": lambda t: t * 2}
    peers.pop("compile")  # compiled graphs are timed above; their host cost is not an eager call's
    lines = ["| fwd+bwd (64 x 1024 bf16, torch.autograd.grad) | host us per call |", "|---|---|"]
    for name, f in peers.items():
        fn = forward_backward(f, x, grad)
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / 2000 * 1e6)
        lines.append(f"| {name} | {best:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--tune", action="store_true", help="also sweep kernel configs")
    parser.add_argument("--host", action="store_true", help="also time each eager call's host cost")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    if args.tune:
        tune(copy_bw)
    rows = bench_softmax() + bench_masked()
    time_rows(rows, copy_bw, args.rounds)
    header = (
        f"# softmax — {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}. bf16, 256 MiB per tensor; device-to-device copy "
        f"{copy_bw / 1e12:.2f} TB/s (read + write) measured in the same run. Each row: the best of "
        f"{args.rounds} interleaved rounds of a do_bench median (every row timed once per round).\n"
        "Bytes: fwd 2 tensors, fwd+bwd 5. 'causal masked' is softmax(scores*0.125) with a causal mask on "
        "(N, L, L) scores, cols = L; the torch peer is (scores*scale).masked_fill(~mask, -inf).softmax(-1).\n\n"
    )
    text = header + table(rows, copy_bw) + "\n"
    if args.host:
        text += "\nHost time per eager call:\n\n" + host_time()
    report(text, args.out)


if __name__ == "__main__":
    main()
