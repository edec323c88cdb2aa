"""Benchmark fl.linear_cross_entropy against eager F.linear + F.cross_entropy, torch.compile of the same and
Liger-Kernel's LigerFusedLinearCrossEntropyLoss (GPU), forward+backward in bf16.

Matmul-bound: reports time, TFLOP/s counting the three matmuls (6 N H V flops), the time of those three
matmuls alone (cuBLAS, same shapes, measured in the same run), and the peak memory allocated beyond the
inputs (x, W, targets), including the returned gradients of x and W.

    python benchmarks/bench_linear_cross_entropy.py [--out benchmarks/results/<device>-linear_cross_entropy.md]
                                                    [--tune]

``--tune`` also sweeps the chunk size and times the CE kernels on one chunk.
Liger-Kernel is optional (carried as a wheel to the lent GPU); its row is skipped without it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform

import torch
import torch.nn.functional as F
import triton
from bench_cross_entropy import copy_bandwidth, peak_extra_bytes  # the same measurements for both
from timing import report
from triton.testing import do_bench

import fusedlayers as fl
from fusedlayers.kernels import cross_entropy as ce_kernels
from fusedlayers.ops import linear_cross_entropy as lce_ops

N, H, V = 8192, 2048, 128256
MiB = 2**20


def median_ms(fn, rep: int = 300) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def eager_upcast(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def eager_bf16(x, w, t):
    return F.cross_entropy(F.linear(x, w), t)


def impls(chunk_sizes=(None,)):
    out = {}
    for c in chunk_sizes:
        name = "fused" if c is None else f"fused chunk={c}"
        out[name] = lambda x, w, t, c=c: fl.linear_cross_entropy(x, w, t, chunk_size=c)
    out["eager (fp32 logits)"] = eager_upcast
    out["eager (bf16 logits)"] = eager_bf16
    out["torch.compile"] = torch.compile(eager_upcast, dynamic=False)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as e:  # noqa: BLE001
        print(f"liger_kernel unavailable ({type(e).__name__}: {e}): no Liger row")
    return out


def matmuls_alone(x, w) -> float:
    """x @ W^T, dlogits @ W and dlogits^T @ x at the full sizes (cuBLAS, bf16): the floor for any chunking."""
    logits = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
    gx = torch.empty_like(x)
    gw = torch.empty_like(w)

    def run():
        torch.mm(x, w.t(), out=logits)
        torch.mm(logits, w, out=gx)
        torch.mm(logits.t(), x, out=gw)

    return median_ms(run)  # the buffers are freed on return


def tune_chunk_kernels(copy_bw: float) -> list[str]:
    """The two CE kernels on one 4096-row chunk of logits (forward read; backward read + write in place)."""
    chunk = torch.randn(4096, V, device="cuda").to(torch.bfloat16)
    t = torch.randint(0, V, (4096,), device="cuda")
    loss = torch.empty(4096, device="cuda")
    lse = torch.empty(4096, device="cuda")
    g = torch.tensor(1.0 / 4096, device="cuda")

    def run():
        ce_kernels.cross_entropy_forward(chunk, t, -100, 0.0, 0.0, loss, lse)
        ce_kernels.cross_entropy_backward(g, chunk, t, lse, -100, 0.0, 0.0, out=chunk)

    ms = median_ms(run)
    frac = 3 * chunk.numel() * 2 / (ms * 1e-3) / copy_bw
    line = f"CE kernels on a 4096 x {V} chunk (forward + in-place backward): {ms:.3f} ms, {frac:.0%} of a copy"
    print(line)
    return [line]


def bench(tune: bool) -> tuple[list[dict], float]:
    torch.manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    t[::10] = -100
    mm_ms = matmuls_alone(x.detach(), w.detach())
    rows = []
    chunk_sizes = (None, 1024, 2048) if tune else (None,)
    for name, f in impls(chunk_sizes).items():
        def fwd_bwd(f=f):
            return torch.autograd.grad(f(x, w, t), (x, w))

        try:
            ms = median_ms(fwd_bwd)
            peak = peak_extra_bytes(fwd_bwd)
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory")
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(dict(impl=name, ms=ms, tflops=6 * N * H * V / (ms * 1e-3) / 1e12, peak=peak / MiB))
        print(rows[-1])
    return rows, mm_ms


def table(rows: list[dict], mm_ms: float) -> str:
    fused = next(r for r in rows if r["impl"] == "fused")
    lines = ["| impl | fwd+bwd ms | TFLOP/s (3 matmuls) | x matmuls alone | peak extra MiB | time / fused |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['ms'] / mm_ms:.2f} | {r['peak']:.0f} | "
                     f"{r['ms'] / fused['ms']:.2f} |")
    lines.append(f"| three matmuls alone (cuBLAS) | {mm_ms:.2f} | {6 * N * H * V / (mm_ms * 1e-3) / 1e12:.0f} | "
                 "1.00 | - | - |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--tune", action="store_true", help="also sweep chunk sizes and the fused kernel config")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    tuned = tune_chunk_kernels(copy_bw) if args.tune else []
    rows, mm_ms = bench(args.tune)
    default_chunk = lce_ops.default_chunk_size(N, V, torch.bfloat16, torch.device("cuda"))
    header = (
        f"# linear_cross_entropy -- {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, python {platform.python_version()}. N={N} tokens, H={H}, V={V}, bf16 x and W, "
        "no bias, every 10th target ignored, reduction mean; forward+backward = torch.autograd.grad(loss, "
        "(x, W)); do_bench median. 'peak extra' is the peak allocation beyond x, W and the targets, including "
        "the returned gradients. eager = F.cross_entropy(F.linear(x, W).float(), t) (logits upcast to fp32, "
        "as common in training code) or on the bf16 logits; torch.compile compiles the fp32-upcast version. "
        f"The fused op's default chunk here: {default_chunk} rows (fp32 grad_W accumulator, "
        f"{V * H * 4 / MiB:.0f} MiB). Device-to-device copy {copy_bw / 1e12:.2f} TB/s.\n\n"
    )
    text = header + table(rows, mm_ms) + "\n"
    if tuned:
        text += "\n" + "\n".join(f"- {line}" for line in tuned) + "\n"
    report(text, args.out)


if __name__ == "__main__":
    main()
