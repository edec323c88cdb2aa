"""Benchmark fl.linear_cross_entropy against eager F.linear + F.cross_entropy, torch.compile of the same,
Liger-Kernel's LigerFusedLinearCrossEntropyLoss and (torch >= 2.13) torch's own chunked F.linear_cross_entropy
(GPU), forward+backward, in two settings:

- "bf16": bf16 x and W. Rows for our default (fp32 grad_W accumulator) and for the opt-in accumulation in the
  weight's dtype (``accumulation_dtype=torch.bfloat16``: the accumulator is the gradient).
- "autocast": fp32 x and fp32 (master) W under ``torch.autocast("cuda", torch.bfloat16)``, as mixed-precision
  training calls the LM head: the matmuls run in bf16, grad_W is fp32 (ours: the fp32 accumulator is the
  gradient itself, no extra fp32 copy).
- "softcap": bf16 x and W, the logits soft-capped at 30 before the loss (Gemma 2's final_logit_softcapping), ours
  (``softcap=30``) against Liger's ``softcap`` and the written-out eager / compiled form.

Matmul-bound: reports time, TFLOP/s counting the three matmuls (6 N H V flops), the time of those three
matmuls alone (cuBLAS, bf16, same shapes, measured in the same run), and the peak memory allocated beyond the
inputs (x, W, targets), including the returned gradients of x and W. Then the accuracy of each row's gradients
against a float64 evaluation (chunked, same inputs): max |error| of grad_W and grad_x relative to max |grad|.

    python benchmarks/bench_linear_cross_entropy.py [--out benchmarks/results/<device>-linear_cross_entropy.md]
                                                    [--tune] [--rounds 5] [--settings bf16 autocast softcap]

Each implementation is timed in ``--rounds`` interleaved rounds (its best round reported, its slowest shown): on a
shared host a slow phase then costs every row one round instead of one row every round.

``--tune`` also sweeps the chunk size (both accumulators) and times the CE kernels on one chunk.
Liger-Kernel is optional (pip install liger-kernel); its rows are skipped without it.
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
from timing import median_ms, report, time_rounds

import fusedlayers as fl
from fusedlayers.kernels import cross_entropy as ce_kernels
from fusedlayers.ops import linear_cross_entropy as lce_ops

N, H, V = 8192, 2048, 128256
MiB = 2**20
BF16 = torch.bfloat16
SOFTCAP = 30.0


def eager_upcast(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w), t)


def eager_softcap(x, w, t):
    return F.cross_entropy(torch.tanh(F.linear(x, w).float() / SOFTCAP) * SOFTCAP, t)


def liger_impl(softcap=None):
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # noqa: BLE001
        print(f"liger_kernel unavailable ({type(e).__name__}: {e}): no Liger rows")
        return None
    liger = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
    return lambda x, w, t: liger(w, x, t)


def torch_chunked_impl():
    """torch >= 2.13's own chunked op (its default options: fp32 accumulation, its auto chunking)."""
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        print(f"torch {torch.__version__} has no F.linear_cross_entropy: no torch-chunked row")
        return None
    options = torch.nn.LinearCrossEntropyOptions()
    return lambda x, w, t: F.linear_cross_entropy(x, w, t, options=options)


def impls(setting: str, tune: bool) -> dict:
    if setting == "softcap":
        out = {"fused": lambda x, w, t: fl.linear_cross_entropy(x, w, t, softcap=SOFTCAP),
               "fused bf16-acc": lambda x, w, t: fl.linear_cross_entropy(x, w, t, softcap=SOFTCAP,
                                                                         accumulation_dtype=BF16),
               "eager (fp32 logits)": eager_softcap,
               "torch.compile": torch.compile(eager_softcap, dynamic=False)}
        liger = liger_impl(SOFTCAP)
        if liger is not None:
            out["liger"] = liger
        return out
    out = {"fused": lambda x, w, t: fl.linear_cross_entropy(x, w, t)}
    if setting == "bf16":
        out["fused bf16-acc"] = lambda x, w, t: fl.linear_cross_entropy(x, w, t, accumulation_dtype=BF16)
        if tune:
            for c in (1024, 2048):
                out[f"fused chunk={c}"] = lambda x, w, t, c=c: fl.linear_cross_entropy(x, w, t, chunk_size=c)
            for c in (256, 512, 1024, 4096):
                out[f"fused bf16-acc chunk={c}"] = lambda x, w, t, c=c: fl.linear_cross_entropy(
                    x, w, t, chunk_size=c, accumulation_dtype=BF16)
        out["eager (fp32 logits)"] = eager_upcast
        out["eager (bf16 logits)"] = eager
        out["torch.compile"] = torch.compile(eager_upcast, dynamic=False)
    else:
        out["eager"] = eager  # autocast: bf16 logits, cross-entropy in fp32 (autocast's rule)
        out["torch.compile"] = torch.compile(eager, dynamic=False)
    for name, make in (("torch chunked", torch_chunked_impl), ("liger", liger_impl)):
        f = make()
        if f is not None:
            out[name] = f
    return out


def matmuls_alone(x, w) -> float:
    """x @ W^T, dlogits @ W and dlogits^T @ x at the full sizes (cuBLAS, bf16): the floor for any chunking."""
    logits = torch.empty(N, V, device="cuda", dtype=BF16)
    gx = torch.empty_like(x)
    gw = torch.empty_like(w)

    def run():
        torch.mm(x, w.t(), out=logits)
        torch.mm(logits, w, out=gx)
        torch.mm(logits.t(), x, out=gw)

    return median_ms(run)  # the buffers are freed on return


def tune_chunk_kernels(copy_bw: float) -> list[str]:
    """The two CE kernels on one 4096-row chunk of logits (forward read; backward read + write in place)."""
    chunk = torch.randn(4096, V, device="cuda").to(BF16)
    t = torch.randint(0, V, (4096,), device="cuda")
    loss = torch.empty(4096, device="cuda")
    lse = torch.empty(2, 4096, device="cuda")
    g = torch.tensor(1.0 / 4096, device="cuda")

    def run():
        ce_kernels.cross_entropy_forward(chunk, t, -100, 0.0, 0.0, loss, lse)
        ce_kernels.cross_entropy_backward(g, chunk, t, lse, -100, 0.0, 0.0, out=chunk)

    ms = median_ms(run)
    frac = 3 * chunk.numel() * 2 / (ms * 1e-3) / copy_bw
    line = f"CE kernels on a 4096 x {V} chunk (forward + in-place backward): {ms:.3f} ms, {frac:.0%} of a copy"
    print(line)
    return [line]


def float64_gradients(x, w, t, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x, grad_W of the mean cross-entropy (of the soft-capped logits) in float64, 1024 rows at a time (the
    float64 logits never whole)."""
    x64, w64 = x.double(), w.double()
    keep = t != -100
    count = keep.sum()
    gx = torch.empty_like(x64)
    gw = torch.zeros_like(w64)
    for start in range(0, N, 1024):
        rows = slice(start, start + 1024)
        logits = x64[rows] @ w64.t()
        p = torch.softmax(torch.tanh(logits / softcap) * softcap if softcap else logits, -1)
        tc = t[rows]
        p[torch.arange(p.shape[0], device=p.device), tc.clamp(min=0)] -= 1.0
        if softcap:
            p *= torch.cosh(logits / softcap).pow(-2)
        del logits
        p *= (keep[rows].double() / count)[:, None]
        gx[rows] = p @ w64
        gw.addmm_(p.t(), x64[rows])
        del p
    return gx, gw


def bench(setting: str, tune: bool, rounds: int) -> tuple[list[dict], float]:
    torch.manual_seed(0)
    dtype = torch.float32 if setting == "autocast" else BF16
    x = torch.randn(N, H, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(V, H, device="cuda") / H**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    t[::10] = -100
    mm_ms = matmuls_alone(x.detach().to(BF16), w.detach().to(BF16))
    g64x, g64w = float64_gradients(x.detach(), w.detach(), t, SOFTCAP if setting == "softcap" else None)
    rows, timed = [], []
    for name, f in impls(setting, tune).items():
        def fwd_bwd(f=f):
            with torch.autocast("cuda", dtype=BF16, enabled=setting == "autocast"):
                loss = f(x, w, t)
            return torch.autograd.grad(loss, (x, w))

        try:  # accuracy and peak memory first, one implementation at a time (also compiles and warms up)
            gx, gw = fwd_bwd()
            err_w = ((gw.double() - g64w).abs().max() / g64w.abs().max()).item()
            err_x = ((gx.double() - g64x).abs().max() / g64x.abs().max()).item()
            del gx, gw
            peak = peak_extra_bytes(fwd_bwd)
        except Exception as e:  # noqa: BLE001  (out of memory, or a peer that does not take this setting)
            print(f"{setting} {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(dict(setting=setting, impl=name, peak=peak / MiB, err_w=err_w, err_x=err_x))
        timed.append((fwd_bwd, median_ms))
    # then the times, in interleaved rounds (timing.time_rounds): a slow phase of the host costs one round of every
    # row instead of every round of one row; each row keeps its best round
    for row, times in zip(rows, time_rounds(timed, rounds), strict=True):
        row.update(ms=min(times), slowest_ms=max(times), tflops=6 * N * H * V / (min(times) * 1e-3) / 1e12)
        print(row)
    return rows, mm_ms


def table(rows: list[dict], mm_ms: float) -> str:
    compiled = next((r for r in rows if r["impl"] == "torch.compile"), None)
    liger = next((r for r in rows if r["impl"] == "liger"), None)
    lines = ["| impl | fwd+bwd ms | slowest round ms | TFLOP/s (3 matmuls) | x matmuls alone | time / torch.compile | "
             "peak extra MiB | peak / Liger | grad_W err | grad_x err |", "|---" * 10 + "|"]
    for r in rows:
        vs_compile = f"{r['ms'] / compiled['ms']:.3f}" if compiled else "-"
        vs_liger = f"{r['peak'] / liger['peak']:.2f}" if liger else "-"
        lines.append(f"| {r['impl']} | {r['ms']:.2f} | {r['slowest_ms']:.2f} | {r['tflops']:.0f} | "
                     f"{r['ms'] / mm_ms:.2f} | {vs_compile} | {r['peak']:.0f} | {vs_liger} | {r['err_w']:.2e} | "
                     f"{r['err_x']:.2e} |")
    mm_tflops = 6 * N * H * V / (mm_ms * 1e-3) / 1e12
    lines.append(f"| three matmuls alone (cuBLAS, bf16) | {mm_ms:.2f} | - | {mm_tflops:.0f} | 1.00 |" + " - |" * 5)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    parser.add_argument("--tune", action="store_true", help="also sweep chunk sizes and time the CE kernels")
    parser.add_argument("--rounds", type=int, default=5,
                        help="time every implementation this many times, interleaved; keep the best")
    parser.add_argument("--settings", nargs="+", default=["bf16", "autocast", "softcap"],
                        choices=["bf16", "autocast", "softcap"])
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    tuned = tune_chunk_kernels(copy_bw) if args.tune else []
    cuda = torch.device("cuda")
    default_fp32 = lce_ops.default_chunk_size(N, V, BF16, cuda)
    default_narrow = lce_ops.default_chunk_size(N, V, BF16, cuda, V * H * 2)
    default_master = lce_ops.default_chunk_size(N, V, BF16, cuda, V * H * 2)  # capped at the bf16 weight copy
    text = (
        f"# linear_cross_entropy -- {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, python {platform.python_version()}. N={N} tokens, H={H}, V={V}, every 10th target "
        "ignored, reduction mean; forward+backward = torch.autograd.grad(loss, (x, W)); do_bench median, the best of "
        f"{args.rounds} interleaved rounds. 'peak "
        "extra' is the peak allocation beyond x, W and the targets, including the returned gradients. 'grad err' "
        "is max |grad - grad_float64| / max |grad_float64|. eager = F.cross_entropy(F.linear(x, W).float(), t) "
        "(logits upcast to fp32, as common in training code) or on the bf16 logits; torch.compile compiles the "
        "fp32-upcast version (bf16) / the autocast version. Our default chunk: "
        f"{default_fp32} rows with the fp32 grad_W accumulator ({V * H * 4 / MiB:.0f} MiB), {default_narrow} rows "
        f"with the bf16 accumulator (bf16-acc; the accumulator is the gradient, {V * H * 2 / MiB:.0f} MiB), "
        f"{default_master} rows under autocast with fp32 master weights. Device-to-device copy "
        f"{copy_bw / 1e12:.2f} TB/s.\n"
    )
    for setting in args.settings:
        rows, mm_ms = bench(setting, args.tune, args.rounds)
        title = {"bf16": "bf16 x and W", "autocast": "autocast(bf16), fp32 x and fp32 master W (grad_W fp32)",
                 "softcap": f"bf16 x and W, logits soft-capped at {SOFTCAP:g} (Gemma 2)"}[setting]
        text += f"\n## {title}\n\n" + table(rows, mm_ms) + "\n"
    if tuned:
        text += "\n" + "\n".join(f"- {line}" for line in tuned) + "\n"
    report(text, args.out)


if __name__ == "__main__":
    main()
