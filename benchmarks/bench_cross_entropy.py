"""Benchmark fl.cross_entropy against F.cross_entropy (bf16, and upcast to fp32), torch.compile and
Liger-Kernel's LigerCrossEntropyLoss (GPU), forward+backward on bf16 logits.

Memory-bound: reports time, the bytes of three logits-sized passes (forward read, backward read + write)
per second as a fraction of a device-to-device copy measured in the same run, and the peak memory
allocated beyond what existed before the call (logits and targets), also as a multiple of the logits.

    python benchmarks/bench_cross_entropy.py [--out benchmarks/results/<device>-cross_entropy.md] [--variants]

``--variants`` adds a table for class weights (with label smoothing) and class-probability targets: fused
against torch (bf16, fp32 upcast) and torch.compile, fused time relative to the plain class-index fused row.

Liger-Kernel is optional (pip install liger-kernel); its rows are skipped without it. Liger
writes its gradient into the logits in place, so it runs on its own copy of them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform

import torch
import torch.nn.functional as F
import triton
from timing import median_ms, report

import fusedlayers as fl
from fusedlayers.kernels import cross_entropy as kernels

SHAPES = [(8192, 32768), (8192, 128256)]
MiB = 2**20


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of a 1 GiB tensor."""
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (median_ms(lambda: dst.copy_(src)) * 1e-3)  # freed on return


def peak_extra_bytes(fn) -> int:
    """Peak memory allocated during ``fn()`` beyond what was allocated before it (after a warm-up call)."""
    fn()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def liger_loss():
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    except Exception as e:  # noqa: BLE001  (not installed, or its import fails on this machine)
        print(f"liger_kernel unavailable ({type(e).__name__}: {e}): no Liger rows")
        return None
    return LigerCrossEntropyLoss()


def impls():
    compiled = torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False)
    out = {
        "fused": lambda x, t: fl.cross_entropy(x, t),
        "torch bf16": lambda x, t: F.cross_entropy(x, t),
        "torch fp32 upcast": lambda x, t: F.cross_entropy(x.float(), t),
        "torch.compile": compiled,
    }
    liger = liger_loss()
    if liger is not None:
        out["liger"] = liger
    return out


def bench(copy_bw: float) -> list[dict]:
    rows = []
    for n_rows, n_classes in SHAPES:
        torch.manual_seed(0)
        x = (torch.randn(n_rows, n_classes, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, n_classes, (n_rows,), device="cuda")
        t[::10] = -100
        logits_bytes = x.numel() * x.element_size()
        for name, f in impls().items():
            xi = x
            if name == "liger":  # it overwrites its input with the gradient
                xi = x.detach().clone().requires_grad_()

            def fwd_bwd(f=f, xi=xi):
                (g,) = torch.autograd.grad(f(xi, t), xi)
                return g

            def fwd(f=f, xi=xi):
                with torch.no_grad():
                    return f(xi, t)

            try:
                ms = median_ms(fwd_bwd)
                ms_fwd = median_ms(fwd) if name != "liger" else float("nan")
                peak = peak_extra_bytes(fwd_bwd)
            except torch.OutOfMemoryError:
                print(f"{name} {n_rows}x{n_classes}: out of memory")
                continue
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            bw = 3 * logits_bytes / (ms * 1e-3)
            rows.append(dict(shape=f"{n_rows}x{n_classes}", impl=name, ms=ms, ms_fwd=ms_fwd, tbs=bw / 1e12,
                             frac=bw / copy_bw, peak=peak / MiB, peak_logits=peak / logits_bytes))
            print(rows[-1])
            del xi
        del x
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def chosen_configs() -> str:
    def flags(key) -> str:
        on = [name for name, value in zip(kernels.FLAGS, key[4], strict=True) if value]
        return f" [{','.join(on)}]" if on else ""

    return "; ".join(f"{key[0]} cols<={key[1]} {key[2]}{flags(key)}: BLOCK_N={n} num_warps={w}"
                     for key, (n, w) in kernels._tuned_configs.items())


def bench_variants(n_rows: int = 8192, n_classes: int = 128256) -> list[dict]:
    """fwd+bwd ms of weighted (+ smoothing) and probability-target cross-entropy, fused against torch."""
    torch.manual_seed(0)
    x = (torch.randn(n_rows, n_classes, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, n_classes, (n_rows,), device="cuda")
    t[::10] = -100
    w = (torch.rand(n_classes, device="cuda") + 0.5).to(torch.bfloat16)
    q = torch.rand(n_rows, n_classes, device="cuda").softmax(-1).to(torch.bfloat16)
    cases = {
        "class index": (t, None, 0.0),
        "class index + weight + smoothing 0.1": (t, w, 0.1),
        "probabilities": (q, None, 0.0),
        "probabilities + weight": (q, w, 0.0),
    }
    def upcast(x, t, w, e):  # torch wants the weights in the logits' dtype
        t = t.float() if t.is_floating_point() else t
        return F.cross_entropy(x.float(), t, w.float() if w is not None else None, label_smoothing=e)

    compiled = torch.compile(upcast, dynamic=False)
    rows = []
    for case, (target, weight, e) in cases.items():
        peers = {
            "fused": lambda: fl.cross_entropy(x, target, weight, label_smoothing=e),
            "torch bf16": lambda: F.cross_entropy(x, target, weight, label_smoothing=e),
            "torch fp32 upcast": lambda: upcast(x, target, weight, e),
            "torch.compile": lambda: compiled(x, target, weight, e),
        }
        for name, f in peers.items():
            try:
                ms = median_ms(lambda f=f: torch.autograd.grad(f(), x))
            except torch.OutOfMemoryError:
                print(f"{case} {name}: out of memory")
                continue
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(dict(case=case, impl=name, ms=ms))
            print(rows[-1])
    return rows


def variants_table(rows: list[dict]) -> str:
    plain = next(r["ms"] for r in rows if r["case"] == "class index" and r["impl"] == "fused")
    lines = ["| 8192 x 128256 bf16, targets | impl | fwd+bwd ms | / fused of the case | / fused class index |",
             "|---|---|---|---|---|"]
    for r in rows:
        fused = next(x["ms"] for x in rows if x["case"] == r["case"] and x["impl"] == "fused")
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['ms'] / fused:.2f} | {r['ms'] / plain:.2f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ("| logits (bf16) | impl | fwd+bwd ms | fwd ms | TB/s (3 passes) | of copy | peak extra MiB | "
            "x logits | fused speed-up |")
    lines = [head, "|" + "---|" * 9]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells = [r for r in rows if r["shape"] == shape]
        fused = next(r for r in cells if r["impl"] == "fused")
        for r in cells:
            lines.append(f"| {shape} | {r['impl']} | {r['ms']:.3f} | {r['ms_fwd']:.3f} | {r['tbs']:.2f} | "
                         f"{r['frac']:.0%} | {r['peak']:.0f} | {r['peak_logits']:.2f} | "
                         f"{r['ms'] / fused['ms']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--variants", action="store_true", help="also time class weights and probability targets")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    rows = bench(copy_bw)
    header = (
        f"# cross_entropy -- {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, python {platform.python_version()}. Forward+backward (torch.autograd.grad) on "
        f"bf16 logits, class-index targets with every 10th ignored, reduction mean; do_bench median. "
        f"Device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write) in the same run. 'TB/s (3 passes)' is "
        "3 x logits bytes / time for every row (the fused op reads the logits in the forward, reads them and "
        "writes the gradient in the backward). 'peak extra' is the peak allocation during forward+backward "
        "beyond the logits and targets, including the returned gradient. 'fused speed-up' = that row's time / "
        "fused time. Liger runs on a copy of the logits (it writes the gradient over its input).\n"
        f"Autotuned kernel configs: {chosen_configs()}\n\n"
    )
    text = header + table(rows) + "\n"
    if args.variants:
        text += "\nClass weights and class-probability targets (fwd+bwd, torch.autograd.grad):\n\n"
        text += variants_table(bench_variants()) + "\n"
    report(text, args.out)


if __name__ == "__main__":
    main()
