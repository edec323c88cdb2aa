"""Benchmark fl.fake_quantize against torch's fake-quant ops, eager and torch.compile (GPU).

The issue's case: per-channel (axis 0) int8 fake quantization of an 8192 x 8192 fp32 weight, with
random qparams and random data:

- forward: torch.fake_quantize_per_channel_affine vs fl.fake_quantize(..., axis=0);
- forward+backward (torch.autograd.grad w.r.t. the weight; STE with the clipping mask);
- learnable: forward+backward of torch._fake_quantize_learnable_per_channel_affine vs fl.fake_quantize with
  scale and zero point requiring grad (LSQ), grad_factor 1 / sqrt(8192 * 127);
- also (FakeQuantLinear's default path) dynamic symmetric per-channel int8 (scales from max|w| in the same
  kernel) vs torch computing amax then its per-channel op, and dynamic per-token int8 activations
  (16384 x 4096 fp32) vs torchao's formula written in torch (choose qparams, fake quant).

Memory-bound: every row reports time, and the bytes the fused kernels move for that case divided by the
row's time, as a fraction of a device-to-device copy of the same tensor measured in the same run (the same
byte count for every row of a case, so the fraction is a speed on one scale). The fused kernels move
8.125 B/element forward (read x, write y and the bit-packed mask), 8.125 B/element in the straight-through
backward (read dy and the mask, write dx) and 12 B/element in the LSQ backward (read x and dy, write dx; its
per-tile partial sums are negligible).

    python benchmarks/bench_fake_quantize.py [--out benchmarks/results/<device>-fake_quantize.md] [--sweep] [--host]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import re
import time

import torch
import triton
from timing import kernel_ms, report, time_rounds
from triton.testing import do_bench

import fusedlayers as fl
from fusedlayers.kernels import fake_quantize as kernels
from fusedlayers.ops import fake_quantize as fq_ops
from fusedlayers.ops._eager import call

N = 8192
TOKENS, WIDTH = 16384, 4096
QMIN, QMAX = -128, 127
DEVICE = "cuda"
COMPILE = dict(dynamic=False)
DRY_RUN = False
FWD_BYTES = 4 + 4 + 1 / 8  # read x, write y and a mask bit (fp32)
STE_BWD_BYTES = 4 + 4 + 1 / 8  # read dy and a mask bit, write dx


def median_ms(fn, rep: int = 200) -> float:
    if DRY_RUN:  # CPU smoke test of the script itself: a rough wall-clock timer
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e3
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(x: torch.Tensor) -> float:
    """Bytes read + written per second by a device-to-device copy of ``x``."""
    dst = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / (median_ms(lambda: dst.copy_(x)) * 1e-3)


def grad_of(f, x, g, *extra):
    """forward + backward: the gradients w.r.t. x (and extra), no accumulation into .grad."""
    def run():
        return torch.autograd.grad(f(x, *extra), (x, *extra), g)
    return run


def torchao_per_token(x):
    """torchao's choose_qparams_per_token_asymmetric + fake quant, in torch."""
    mn = torch.clamp(x.amin(-1, keepdim=True), max=0.0)
    mx = torch.clamp(x.amax(-1, keepdim=True), min=0.0)
    scale = torch.clamp((mx - mn) / float(QMAX - QMIN), min=torch.finfo(torch.float32).eps)
    zf = torch.where((QMIN + mn / scale) + (QMAX + mx / scale) > 0, QMIN - mn / scale, QMAX - mx / scale)
    zp = torch.clamp(zf, QMIN, QMAX).round()
    q = torch.round(x * (1.0 / scale)) + zp
    mask = (q >= QMIN) & (q <= QMAX)
    y = (q.clamp(QMIN, QMAX) - zp) * scale
    return y, mask


class _TorchaoPerToken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y, mask = torchao_per_token(x)
        ctx.save_for_backward(mask)
        return y

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask


def torch_dynamic_per_channel(w):
    scale = torch.clamp(w.detach().abs().amax(1) / ((QMAX - QMIN) / 2), min=torch.finfo(torch.float32).eps)
    return torch.fake_quantize_per_channel_affine(w, scale, torch.zeros_like(scale, dtype=torch.int32), 0, QMIN, QMAX)


def bench(copy_bw_of, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    w = torch.randn(N, N, device=DEVICE) * 0.05
    scale = torch.rand(N, device=DEVICE) * 2e-3 + 2e-4
    zp = torch.randint(-10, 10, (N,), device=DEVICE, dtype=torch.int32)
    g = torch.randn_like(w)
    numel = w.numel()
    copy_bw = copy_bw_of(w)
    fwd_bytes, ste_bytes, lsq_bytes = FWD_BYTES * numel, (FWD_BYTES + STE_BWD_BYTES) * numel, (FWD_BYTES + 12) * numel

    timed = []  # (fn, timer) per row, timed together at the end (timing.time_rounds)

    def add(case, impl, fn, nbytes, timer=median_ms, copy_bw=copy_bw):
        fn()
        sync()
        rows.append(dict(case=case, impl=impl, nbytes=nbytes, copy_bw=copy_bw))
        timed.append((fn, timer))

    # --- static per channel, forward
    stock = lambda x: torch.fake_quantize_per_channel_affine(x, scale, zp, 0, QMIN, QMAX)  # noqa: E731
    fused = lambda x: fl.fake_quantize(x, scale, zp, QMIN, QMAX, 0)  # noqa: E731
    fused_op = lambda x: torch.ops.fusedlayers.fake_quantize(x, scale, zp, QMIN, QMAX, 0, 0, 1.0)[0]  # noqa: E731
    fused_fast = lambda x: call(fq_ops.fake_quantize, x, scale, zp, QMIN, QMAX, 0, 0, 1.0)[0]  # noqa: E731
    compiled = torch.compile(stock, **COMPILE)
    case = "per-channel int8 fwd"
    with torch.no_grad():
        for impl, f in (("torch eager", stock), ("torch.compile", compiled), ("fused (fl.fake_quantize)", fused),
                        ("fused (no arg checks)", fused_fast), ("fused (dispatcher op)", fused_op)):
            add(case, impl, lambda f=f: f(w), fwd_bytes)
    # --- forward + backward (STE)
    wr = w.clone().requires_grad_()
    case = "per-channel int8 fwd+bwd"
    for impl, f in (("torch eager", stock), ("torch.compile", compiled), ("fused (fl.fake_quantize)", fused),
                    ("fused (no arg checks)", fused_fast), ("fused (dispatcher op)", fused_op)):
        add(case, impl, grad_of(f, wr, g), ste_bytes)
    if not DRY_RUN:
        for impl, f in (("torch eager, GPU kernel time", stock), ("fused, GPU kernel time", fused_fast)):
            add(case, impl, grad_of(f, wr, g), ste_bytes, timer=kernel_ms)
    # --- learnable (LSQ), forward + backward
    gf = 1.0 / math.sqrt(N * QMAX)
    s_l = scale.clone().requires_grad_()
    z_l = zp.float().requires_grad_()
    stock_l = lambda x, s, z: torch._fake_quantize_learnable_per_channel_affine(x, s, z, 0, QMIN, QMAX, gf)  # noqa: E731
    fused_l_api = lambda x, s, z: fl.fake_quantize(x, s, z, QMIN, QMAX, 0, grad_factor=gf)  # noqa: E731
    fused_l = lambda x, s, z: call(fq_ops.fake_quantize, x, s, z, QMIN, QMAX, 0, 0, gf)[0]  # noqa: E731
    fused_l_op = lambda x, s, z: torch.ops.fusedlayers.fake_quantize(x, s, z, QMIN, QMAX, 0, 0, gf)[0]  # noqa: E731
    compiled_l = torch.compile(stock_l, **COMPILE)
    case = "learnable per-channel int8 fwd+bwd"
    for impl, f in (("torch eager", stock_l), ("torch.compile", compiled_l), ("fused (fl.fake_quantize)", fused_l_api),
                    ("fused (no arg checks)", fused_l), ("fused (dispatcher op)", fused_l_op)):
        add(case, impl, grad_of(f, wr, g, s_l, z_l), lsq_bytes)
    if not DRY_RUN:
        for impl, f in (("torch eager, GPU kernel time", stock_l), ("fused, GPU kernel time", fused_l)):
            add(case, impl, grad_of(f, wr, g, s_l, z_l), lsq_bytes, timer=kernel_ms)
    # --- dynamic symmetric per channel (FakeQuantLinear's weight path), forward + backward
    case = "dynamic per-channel int8 fwd+bwd"
    fused_d = lambda x: call(fq_ops.fake_quantize_dynamic, x, QMIN, QMAX, N, True)[0]  # noqa: E731
    compiled_d = torch.compile(torch_dynamic_per_channel, **COMPILE)
    for impl, f in (("torch eager", torch_dynamic_per_channel), ("torch.compile", compiled_d), ("fused", fused_d)):
        add(case, impl, grad_of(f, wr, g), ste_bytes)
    # --- dynamic per-token int8 activations, forward + backward
    x = (torch.randn(TOKENS, WIDTH, device=DEVICE) * 3).requires_grad_()
    gx = torch.randn_like(x)
    copy_bw_x = copy_bw_of(x.detach())
    case = f"per-token int8 activations {TOKENS}x{WIDTH} fwd+bwd"
    compiled_t = torch.compile(_TorchaoPerToken.apply, **COMPILE)
    fused_t = lambda t: call(fq_ops.fake_quantize_dynamic, t, QMIN, QMAX, WIDTH, False)[0]  # noqa: E731
    for impl, f in (("torchao formula eager", _TorchaoPerToken.apply), ("torchao formula torch.compile", compiled_t),
                    ("fused", fused_t)):
        add(case, impl, grad_of(f, x, gx), (FWD_BYTES + STE_BWD_BYTES) * x.numel(), copy_bw=copy_bw_x)
    for row, times in zip(rows, time_rounds(timed, rounds), strict=True):
        ms = min(times)
        nbytes, copy_bw = row.pop("nbytes"), row.pop("copy_bw")
        row.update(ms=ms, slowest_ms=max(times), frac=nbytes / (ms * 1e-3) / copy_bw, tbs=nbytes / ms / 1e9)
        print(row, flush=True)
    return rows


def sweep() -> str:
    """Time the static forward / STE backward / LSQ backward at a few tile sizes (for tuning)."""
    torch.manual_seed(0)
    w = torch.randn(N, N, device=DEVICE) * 0.05
    scale = torch.rand(N, device=DEVICE) * 2e-3 + 2e-4
    zf = torch.zeros(N, device=DEVICE)
    g = torch.randn_like(w)
    layout = (N, N, N, kernels.PER_ROW)
    lines = []
    old = kernels.TILE_ELEMENTS
    for tile in (2048, 4096, 8192):
        kernels.TILE_ELEMENTS = tile
        kernels._tile_config.cache_clear()
        fwd = median_ms(lambda: kernels.fake_quantize_forward(w, scale, zf, QMIN, QMAX, layout, 1))
        _, mask = kernels.fake_quantize_forward(w, scale, zf, QMIN, QMAX, layout, 1)
        bwd = median_ms(lambda: kernels.fake_quantize_ste_backward(g, mask, N, N))  # noqa: B023
        lsq = median_ms(lambda: kernels.fake_quantize_lsq_backward(g, w, scale, zf, QMIN, QMAX, layout, 0, 0.1))
        dyn = median_ms(lambda: kernels.fake_quantize_dynamic_forward(w, QMIN, QMAX, N, True, 1e-7))
        lines.append(f"tile {tile}: fwd {fwd:.3f} ms, ste bwd {bwd:.3f} ms, lsq bwd {lsq:.3f} ms, "
                     f"dynamic fwd {dyn:.3f} ms")
        print(lines[-1], flush=True)
    kernels.TILE_ELEMENTS = old
    kernels._tile_config.cache_clear()
    return "\n".join(lines)


def host_overhead() -> str:
    """Host time per call of each fused path and its torch peer on a 64 x 64 weight (the GPU work is
    negligible, so a loop of calls runs at the speed of the CPU issuing them), and the parts of the fused
    path: the Triton launch alone, the launcher, the op without and with autograd."""
    torch.manual_seed(0)
    n = 64
    w = (torch.randn(n, n, device=DEVICE) * 0.05).requires_grad_()
    scale = (torch.rand(n, device=DEVICE) * 2e-3 + 2e-4).requires_grad_()
    zp = torch.randint(-10, 10, (n,), device=DEVICE).float().requires_grad_()
    zp_i = zp.detach().int()
    g = torch.randn_like(w)
    s_, z_ = scale.detach(), zp.detach()
    layout = (n, n, n, kernels.PER_ROW)
    op = torch.ops.fusedlayers.fake_quantize
    cases = {} if DRY_RUN else {  # (the launcher alone needs a GPU)
        "fused: kernels.fake_quantize_forward (launcher + Triton launch)":
            lambda: kernels.fake_quantize_forward(w.detach(), s_, z_, QMIN, QMAX, layout, 0),
    }
    cases |= {
        "fused: forward, no grad": lambda: call(fq_ops.fake_quantize, w.detach(), s_, z_, QMIN, QMAX, 0, 0, 1.0),
        "fused: op forward, no grad (dispatcher)": lambda: op(w.detach(), s_, z_, QMIN, QMAX, 0, 0, 1.0),
        "fused: op forward, recording autograd (dispatcher)": lambda: op(w, s_, z_, QMIN, QMAX, 0, 0, 1.0),
        "fused: straight-through fwd+bwd": grad_of(
            lambda x: call(fq_ops.fake_quantize, x, s_, z_, QMIN, QMAX, 0, 0, 1.0)[0], w, g),
        "fused: straight-through fwd+bwd (dispatcher)": grad_of(
            lambda x: op(x, s_, z_, QMIN, QMAX, 0, 0, 1.0)[0], w, g),
        "torch: per-channel fwd+bwd": grad_of(
            lambda x: torch.fake_quantize_per_channel_affine(x, s_, zp_i, 0, QMIN, QMAX), w, g),
        "fused: learnable fwd+bwd": grad_of(
            lambda x, s, z: call(fq_ops.fake_quantize, x, s, z, QMIN, QMAX, 0, 0, 0.01)[0], w, g, scale, zp),
        "torch: learnable fwd+bwd": grad_of(
            lambda x, s, z: torch._fake_quantize_learnable_per_channel_affine(x, s, z, 0, QMIN, QMAX, 0.01), w, g,
            scale, zp),
        "torch: x * 2 fwd+bwd (autograd's floor)": grad_of(lambda x: x * 2, w, g),
    }
    lines = ["| path (64 x 64 weight) | host us per call |", "|---|---|"]
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(1000):
            fn()
        sync()
        lines.append(f"| {name} | {(time.perf_counter() - start) * 1e3:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| case | impl | ms | TB/s (fused bytes) | of copy | fused speed-up | slowest round ms |",
             "|" + "---|" * 7]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = [r for r in rows if r["case"] == case]
        fused = min((r for r in cells if r["impl"].startswith("fused")), key=lambda r: r["ms"])
        for r in cells:
            lines.append(f"| {case} | {r['impl']} | {r['ms']:.3f} | {r['tbs']:.2f} | {r['frac']:.0%} | "
                         f"{r['ms'] / fused['ms']:.2f}x | {r['slowest_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    parser.add_argument("--out-dir", default=None, help="write it to DIR/<device>-fake_quantize.md")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels at several tile sizes")
    parser.add_argument("--dry-run", action="store_true", help="run the script on CPU at tiny sizes (no timing)")
    parser.add_argument("--host", action="store_true", help="also time the host side of each path (tiny weight)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (each row: its best)")
    args = parser.parse_args()
    if args.dry_run:
        global N, TOKENS, WIDTH, DEVICE, COMPILE, DRY_RUN
        N, TOKENS, WIDTH, DEVICE, COMPILE, DRY_RUN = 256, 512, 256, "cpu", dict(backend="eager"), True
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    host_text = host_overhead() if args.host else ""
    sweep_text = sweep() if args.sweep else ""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    copies = {}

    def copy_bw_of(t):
        copies[tuple(t.shape)] = copy_bandwidth(t)
        return copies[tuple(t.shape)]

    rows = bench(copy_bw_of, args.rounds)
    copy_text = ", ".join(f"{'x'.join(map(str, k))} fp32 {v / 1e12:.2f} TB/s" for k, v in copies.items())
    header = (
        f"# fake_quantize -- {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, python {platform.python_version()}. 8192 x 8192 fp32 weight, per-channel (axis 0) "
        "int8 [-128, 127], random data and qparams; each row the best of "
        f"{args.rounds} interleaved rounds (every row timed once per round) of a do_bench median; "
        "forward+backward via torch.autograd.grad "
        f"(no .grad accumulation). Device-to-device copy (read + write) in the same run: {copy_text}. "
        "'TB/s (fused bytes)' is the fused kernels' traffic for the case (8.125 B/element forward: x, y and a "
        "mask bit; 16.25 B/element forward+backward with the straight-through gradient, 20.125 with LSQ's) / that "
        "row's time, 'of copy' the same as a fraction of the copy; 'fused speed-up' = "
        "row time / fastest fused time. 'fl.fake_quantize' is the public call with its argument checks (the qparam "
        "values checked once per tensor version, no sync after that); '(no arg checks)' is the same call after "
        "the checks "
        "(the op's body under its autograd, what FakeQuantLinear does); '(dispatcher op)' calls "
        "torch.ops.fusedlayers directly (what torch.compile sees); ', GPU kernel time' rows are the same "
        "forward+backward timed as the sum of its "
        "kernels' durations (torch.profiler, 20 calls): GPU time without the waits for the host between kernels. "
        f"Tile: {kernels.TILE_ELEMENTS} elements per program.\n\n"
    )
    text = header + table(rows) + "\n"
    if host_text:
        text += "\nHost time per call (the CPU issuing the work; no GPU wait at this size):\n\n" + host_text + "\n"
    if sweep_text:
        text += "\nTile sweep (fused kernels alone):\n\n```\n" + sweep_text + "\n```\n"
    if args.out_dir:
        slug = re.sub(r"[^a-z0-9]+", "-", device.lower().removeprefix("nvidia ")).strip("-")
        args.out = os.path.join(args.out_dir, f"{slug}-fake_quantize.md")
    report(text, args.out)


if __name__ == "__main__":
    main()
