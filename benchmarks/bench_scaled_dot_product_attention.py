"""Benchmark fl.scaled_dot_product_attention against torch SDPA's flash, cuDNN and efficient backends and
FlexAttention (GPU).

Matmul-bound: reports TFLOP/s with FLOPs counted as docs/design.md says (forward 4*B*H*L*S*D, halved when
causal; forward+backward 3.5x the forward: backward 2.5x), and the peak memory allocated by one
forward+backward beyond the inputs. Shapes: bf16, D in {64, 128, 256}, L = S in {1024, 2048, 4096, 16384},
batch * L = 16384, H * D = 2048, causal and not. Timing: triton.testing.do_bench median, random data.

    python benchmarks/bench_scaled_dot_product_attention.py [--out-dir benchmarks/results] [--sweep] [--quick]
                                                            [--no-flex]
    python benchmarks/bench_scaled_dot_product_attention.py --masks [--out-dir benchmarks/results]
    python benchmarks/bench_scaled_dot_product_attention.py --routing [--out FILE]
    python benchmarks/bench_scaled_dot_product_attention.py --host [--out FILE]
    python benchmarks/bench_scaled_dot_product_attention.py --kernels [--head-dims 64,128] [--out FILE]

--sweep times candidate block configs of each kernel per (D, causal) first (compiled in parallel
processes), prints the best, and runs the table with them. --sweep-at B,H,L,D times a wider set of
candidates on one causal shape only (gpt-small's: 16,12,1024,64) and prints the best, without the table.
FlashAttention's own package was not installed where the tables were measured, so SDPA's backends and FlexAttention
are the peers.

--masks: the masks SDPA cannot take (varlen, window, softcap) against FlexAttention, from bench_varlen_attention.py.
--routing: the Hopper kernels against the Triton kernels on calls around their MIN_FLOPS, by GPU time (what a training
step pays) and by wall time (what a call timed alone pays: the host's, for small calls).
--host: the host's time of an eager forward+backward of small calls, ours (on either kernels) against torch's SDPA.
--kernels: each kernel's GPU time in one forward+backward at the table's shapes from L = 2048, ours in both modes
against cuDNN: where a row's time goes.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import kernel_ms, kernel_us, report, round_order  # noqa: E402

import fusedlayers as fl  # noqa: E402
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper  # noqa: E402
from fusedlayers.kernels import scaled_dot_product_attention as K  # noqa: E402

DTYPE = torch.bfloat16
DEVICE = "cuda"
TOKENS, WIDTH = 16384, 2048
PEERS = ["flash", "cudnn", "efficient", "flex"]  # --no-flex drops FlexAttention (its compiles take minutes)
OURS = ["fl", "fl-det", "fl-triton"]  # fl-det: deterministic mode; fl-triton: the Triton kernels everywhere
COMPILE_LENGTH = 1024  # precompile on a small problem with the benchmark's specialization (L % 16 == 0)

# Candidate configs (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim, for --sweep.
CANDIDATES = {
    ("fwd", 64): [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3)],
    ("fwd", 128): [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4), (128, 32, 8, 3)],
    ("dkdv", 64): [(64, 128, 8, 2), (32, 64, 4, 3), (32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2)],
    ("dkdv", 128): [(16, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2), (16, 128, 8, 3)],
    ("dq", 64): [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)],
    ("dq", 128): [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 4, 2)],
}
# --sweep-at: more candidates at one causal shape: D = 64 (short sequences: smaller tiles balance better) and D = 256
# (the table's weakest head dim: 0.42-0.79x SDPA's flash backend on an H100, 2026-11-25, with the first entries here).
WIDE_CANDIDATES = {
    ("fwd", 64): [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3),
                  (64, 32, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 4, 2)],
    ("dkdv", 64): [(32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
                   (64, 64, 4, 3), (32, 128, 4, 3), (16, 64, 4, 3), (64, 128, 8, 3), (32, 64, 8, 3)],
    ("dq", 64): [(64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2),
                 (128, 64, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (128, 128, 8, 2), (64, 64, 8, 3)],
    ("fwd", 256): [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2),
                   (128, 64, 8, 1), (64, 128, 8, 2), (64, 64, 8, 3), (64, 32, 8, 3), (128, 32, 8, 3)],
    ("dkdv", 256): [(32, 32, 8, 1), (16, 64, 8, 2), (32, 64, 8, 1), (32, 64, 8, 2), (16, 32, 4, 2),
                    (32, 32, 8, 2), (64, 32, 8, 1), (16, 128, 8, 1), (32, 32, 4, 2), (64, 64, 8, 1)],
    ("dq", 256): [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2),
                  (64, 16, 4, 2), (128, 64, 8, 1), (64, 64, 4, 1), (32, 32, 4, 2), (64, 32, 4, 3)],
}
OVERRIDE = {"fwd": "FWD_CONFIG", "dkdv": "BWD_DKDV_CONFIG", "dq": "BWD_DQ_CONFIG"}


HEAD_DIMS = [64, 128, 256]  # --head-dims


def shapes(quick: bool = False):
    for d in HEAD_DIMS:
        for length in ((4096,) if quick else (1024, 2048, 4096, 16384)):
            for causal in (False, True):
                yield TOKENS // length, WIDTH // d, length, d, causal


def tflops(b, h, length, d, causal, mode, ms):
    flops = 4.0 * b * h * length * length * d * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
    return flops / (ms * 1e-3) / 1e12


def make(b, h, length, d, grad: bool):
    q, k, v = (torch.randn(b, h, length, d, device=DEVICE, dtype=DTYPE, requires_grad=grad) for _ in range(3))
    return q, k, v


_FLEX: dict = {}  # the compiled flex_attention and its causal block masks per length


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:  # static shapes: one specialised kernel per table row, as a user's fixed-shape model gets
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    mask = None
    if causal:
        key = (q.shape[-2], k.shape[-2])
        if key not in _FLEX:
            _FLEX[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, *key, device=q.device)
        mask = _FLEX[key]
    return _FLEX["fn"](q, k, v, block_mask=mask)


def attention(name):
    if name in ("fl", "fl-det", "fl-triton"):  # measure() sets fl-det's mode, turns fl-triton's Hopper kernels off
        return lambda q, k, v, c: fl.scaled_dot_product_attention(q, k, v, is_causal=c)
    if name == "flex":
        return _flex
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

    def run(q, k, v, c):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=c)

    return run


def median_ms(fn, grad_to_none=None) -> float:
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def measure(name, b, h, length, d, causal):
    """(forward ms, forward+backward ms, peak MiB of one forward+backward beyond its inputs); fl-det's backward in
    deterministic mode too (the mode is read when the backward runs)."""
    with fl.use_deterministic_attention(True) if name == "fl-det" else contextlib.nullcontext():
        return _measure(name, b, h, length, d, causal)


def _measure(name, b, h, length, d, causal):
    f = attention(name)
    hopper.enabled = name != "fl-triton"
    try:
        q, k, v = make(b, h, length, d, grad=False)
        with torch.no_grad():
            f(q, k, v, causal)
            fwd = median_ms(lambda: f(q, k, v, causal))
        del q, k, v
        q, k, v = make(b, h, length, d, grad=True)
        do = torch.randn(b, h, length, d, device=DEVICE, dtype=DTYPE)

        def step():
            f(q, k, v, causal).backward(do)

        step()
        torch.cuda.synchronize()
        for t in (q, k, v):
            t.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        both = median_ms(step, grad_to_none=[q, k, v])
        return fwd, both, peak
    except Exception as e:  # noqa: BLE001  (a backend that does not take this shape: n/a in the table)
        print(f"  {name} D={d} L={length} causal={causal}: {str(e).splitlines()[0][:100]}", flush=True)
        return None
    finally:
        hopper.enabled = True
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- --routing: the Hopper threshold

# Calls around the Hopper kernels' MIN_FLOPS, bf16: (B, H, H_kv, L, D, causal, packed documents' length or None,
# window or None). The first is the Hugging Face Llama step's (bench_integrations.py --only hf); the packed and windowed
# ones are fl.varlen_attention over 16K tokens.
ROUTING_CASES = [
    (4, 16, 4, 2048, 128, True, None, None), (1, 16, 4, 2048, 128, True, None, None),
    (16, 32, 32, 1024, 64, True, None, None), (16, 16, 16, 1024, 128, True, None, None),
    (8, 32, 32, 1024, 64, False, None, None), (8, 16, 16, 1024, 128, False, None, None),
    (2, 16, 16, 1024, 128, False, None, None), (32, 32, 32, 512, 64, False, None, None),
    (1, 16, 16, 512, 128, True, None, None), (1, 32, 8, 256, 64, False, None, None),
    (16, 8, 8, 1024, 256, True, None, None), (4, 8, 8, 1024, 256, False, None, None),
    (1, 16, 16, 16384, 128, True, 128, None), (1, 16, 16, 16384, 128, True, 512, None),
    (1, 32, 32, 16384, 64, True, 128, None), (1, 32, 32, 16384, 64, True, 512, None),
    (1, 16, 16, 16384, 128, True, None, 256), (1, 32, 32, 16384, 64, True, None, 256),
]


def _run_line() -> str:
    """The date and versions every results header starts with."""
    return (f"Date {datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, Python "
            f"{platform.python_version()}")


def _kernel_name(name: str) -> str:
    """A kernel's name without its template and argument lists or cuDNN's common prefix."""
    if name.startswith("cudnn_generated"):
        return "cudnn " + name.removeprefix("cudnn_generated_fort_native_sdpa_")[:40]
    return name.removeprefix("void ").split("(")[0].split("<")[0].rsplit("::", 1)[-1][:40].strip()


def gpu_and_wall_ms(fn, calls: int = 10) -> tuple[float, float]:
    """(the kernels' time a call, summed by torch.profiler over ``calls``; wall time a call, 2 * ``calls`` back to
    back after as many to warm up). The first is what a training step pays, its host running ahead of the GPU; the
    second is the host's time where it is larger."""
    for _ in range(2 * calls):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(2 * calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / (2 * calls) * 1e3
    return kernel_ms(fn, calls), wall


def _routing_call(b, h, h_kv, length, d, causal, doc, window):
    """A forward+backward of ``fl`` and of the peer (cuDNN; torch's flash at D256, where cuDNN has no backward) on
    one set of inputs: (fl's, the peer's or None, its forward flops)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusedlayers.backend import keys_per_row

    q = torch.randn(b, h, length, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k, v = (torch.randn(b, h_kv, length, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    flops = 4.0 * b * h * length * d * keys_per_row(doc or length, causal, (window or -1, 0 if window else -1))
    if doc is None and window is None:
        def ours():
            return torch.autograd.grad(fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                                       (q, k, v), do)

        def peer():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if d <= 128 else SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return torch.autograd.grad(out, (q, k, v), do)

        return ours, peer, flops
    q, k, v, do = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v, do))
    cu = torch.arange(0, length + 1, doc or length, device=DEVICE, dtype=torch.int32)
    span = doc or length

    def ours():
        out = fl.varlen_attention(q, k, v, cu, cu, span, span, is_causal=causal,
                                  window_size=(window, 0) if window else (-1, -1))
        return torch.autograd.grad(out, (q, k, v), do)

    return ours, None, flops


def _routed(fn, gluon: bool):
    """fn with fl's attention on the Hopper (Gluon) kernels whatever the call's size, or on the Triton kernels."""
    def call():
        min_flops, enabled = hopper.MIN_FLOPS, hopper.enabled
        hopper.MIN_FLOPS, hopper.enabled = (0, True) if gluon else (min_flops, False)
        try:
            return fn()
        finally:
            hopper.MIN_FLOPS, hopper.enabled = min_flops, enabled
    return call


def routing_table(out_path):
    """The Hopper (Gluon) kernels against the Triton kernels on calls around MIN_FLOPS, by GPU time and by wall time:
    the evidence for the threshold (docs/attention.md)."""
    lines = ["| B H H_kv L D causal | packed / window | log2 flops | GPU ms: Gluon | Triton | peer | Triton / Gluon | "
             "Gluon / peer | wall ms: Gluon | Triton | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    min_flops = hopper.MIN_FLOPS
    for b, h, h_kv, length, d, causal, doc, window in ROUTING_CASES:
        ours, peer, flops = _routing_call(b, h, h_kv, length, d, causal, doc, window)
        gluon, triton_ = gpu_and_wall_ms(_routed(ours, True)), gpu_and_wall_ms(_routed(ours, False))
        other = gpu_and_wall_ms(peer)[0] if peer else None
        runs = "Gluon" if flops >= min_flops else "Triton"
        extra = f"documents of {doc}" if doc else f"window {window}" if window else "-"
        lines.append(f"| {b} {h} {h_kv} {length} {d} {'yes' if causal else 'no'} | {extra} | {math.log2(flops):.1f} | "
                     f"{gluon[0]:.3f} | {triton_[0]:.3f} | {f'{other:.3f}' if other else 'n/a'} | "
                     f"{triton_[0] / gluon[0]:.2f} | {f'{other / gluon[0]:.2f}' if other else 'n/a'} | "
                     f"{gluon[1]:.3f} | {triton_[1]:.3f} | {runs} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    header = (f"# Hopper attention kernels around MIN_FLOPS on {torch.cuda.get_device_name()}\n\n"
              f"{_run_line()}. bf16 forward+backward (`torch.autograd.grad`); GPU ms: the kernels' "
              "time a call, summed by torch.profiler over 10 calls; wall ms: 20 calls back to back (host-bound "
              "where it exceeds the GPU time). Peer: cuDNN (torch's flash at D256); packed documents and windows "
              "are fl.varlen_attention over 16K tokens (no peer). runs: the kernels that MIN_FLOPS = "
              f"2**{min_flops.bit_length() - 1} gives the call.\n\n")
    report(header + "\n".join(lines) + "\n", out_path)


# (B, H, H_kv, L, D, causal) of --host: calls whose GPU work is far below their host time
HOST_CASES = [(1, 16, 4, 256, 128, True), (1, 12, 12, 256, 64, True)]


def host_us(fns: dict, rounds: int = 5, calls: int = 500) -> dict:
    """Host us a call of each function: ``calls`` back to back (the GPU idles, so the loop runs at the speed of the
    host issuing them), ``rounds`` rounds interleaved across the functions; (best, median) each."""
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def host_table(out_path):
    """The host's time of an eager forward+backward (``torch.autograd.grad``) of small calls: fl on the Gluon and on
    the Triton kernels, torch's SDPA on cuDNN and on flash, and ``q * 2`` (autograd's floor)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lines = ["| B H H_kv L D causal | fl Gluon | fl Triton | cuDNN | flash | q * 2 |", "|---|---|---|---|---|---|"]
    for b, h, h_kv, length, d, causal in HOST_CASES:
        q = torch.randn(b, h, length, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
        k, v = (torch.randn(b, h_kv, length, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)

        def ours():
            out = fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return torch.autograd.grad(out, (q, k, v), do)

        def sdpa(backend):
            def call():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                return torch.autograd.grad(out, (q, k, v), do)
            return call

        fns = {"gluon": _routed(ours, True), "triton": _routed(ours, False), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
               "flash": sdpa(SDPBackend.FLASH_ATTENTION), "floor": lambda: torch.autograd.grad(q * 2, q, do)}
        if hopper.gluon is None or torch.cuda.get_device_capability()[0] != 9:  # no Gluon kernels here
            fns.pop("gluon")
        us = host_us(fns)
        cells = [f"{us[name][0]:.0f} ({us[name][1]:.0f})" if name in us else "n/a"
                 for name in ("gluon", "triton", "cudnn", "flash", "floor")]
        lines.append(f"| {b} {h} {h_kv} {length} {d} {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    header = (f"# Host time of small attention calls on {torch.cuda.get_device_name()}\n\n"
              f"{_run_line()}, {platform.processor() or platform.machine()} host. bf16, eager "
              "forward+backward (`torch.autograd.grad`), us a call: best (median) of 5 interleaved rounds of 500 calls "
              "back to back, GPU work far below the host's, so the host's time. fl Gluon: MIN_FLOPS switched off, fl "
              "Triton: the Hopper kernels switched off.\n\n")
    report(header + "\n".join(lines) + "\n", out_path)


# ----------------------------------------------------------------------------- config sweep


def _set_config(kind, cfg):
    setattr(K, OVERRIDE[kind], K.Config(*cfg) if cfg is not None else None)


def _run_kernel_once(kind, b, h, length, d, causal, q, k, v, do):
    if kind == "fwd":
        K.attention_forward(q, k, v, None, None, causal, d**-0.5)
        return
    out, lse = K.attention_forward(q, k, v, None, None, causal, d**-0.5)
    dq = torch.empty_like(q) if kind == "dq" else None
    dk, dv = (torch.empty_like(k), torch.empty_like(v)) if kind == "dkdv" else (None, None)
    return lambda: K.attention_backward(do, q, k, v, out, lse, None, None, causal, d**-0.5, dq, dk, dv, None)


def _compile_job(job):
    """Worker: compile one config by running it once on a small problem with the same specialization."""
    kind, d, causal, cfg = job
    try:
        _set_config(kind, cfg)
        h = WIDTH // d
        q, k, v = make(1, h, COMPILE_LENGTH, d, grad=False)
        do = torch.randn_like(q)
        fn = _run_kernel_once(kind, 1, h, COMPILE_LENGTH, d, causal, q, k, v, do)
        if fn is not None:
            fn()
        torch.cuda.synchronize()
        return job, None
    except Exception as e:  # noqa: BLE001  (report and go on: a config that does not compile is skipped)
        return job, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def precompile(jobs, workers):
    """Compile in parallel processes; Triton's on-disk cache then serves this process."""
    failed = {}
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for job, err in pool.map(_compile_job, jobs):
            if err:
                failed[job] = err
                print(f"  compile failed {job}: {err}", flush=True)
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f}s ({len(failed)} failed)", flush=True)
    return failed


def sweep(lengths, workers, at=None):
    """Best config per (kernel, D, causal) over ``lengths`` (batch * L = TOKENS, H * D = WIDTH), or, with
    ``at`` = (B, H, L, D), over WIDE_CANDIDATES on that causal shape alone."""
    candidates = {key: cfgs for key, cfgs in WIDE_CANDIDATES.items() if key[1] == at[3]} if at else CANDIDATES
    causals = (True,) if at else (False, True)
    jobs = [(kind, d, causal, cfg) for (kind, d), cfgs in candidates.items() for causal in causals for cfg in cfgs]
    failed = precompile(jobs, workers)
    best = {}
    print("\n| kernel | D | causal | L | config (BM, BN, warps, stages) | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for (kind, d), cfgs in candidates.items():
        for causal in causals:
            scores = {}
            for cfg in cfgs:
                if (kind, d, causal, cfg) in failed:
                    continue
                _set_config(kind, cfg)
                total = 0.0
                for length in ([at[2]] if at else lengths):
                    b, h = (at[0], at[1]) if at else (TOKENS // length, WIDTH // d)
                    q, k, v = make(b, h, length, d, grad=False)
                    do = torch.randn_like(q)
                    try:
                        if kind == "fwd":
                            ms = median_ms(lambda: K.attention_forward(q, k, v, None, None, causal, d**-0.5))
                            tf = tflops(b, h, length, d, causal, "fwd", ms)
                        else:
                            ms = median_ms(_run_kernel_once(kind, b, h, length, d, causal, q, k, v, do))
                            # matmuls run: dq kernel 3 (QK^T, dO V^T, dS K), dk/dv kernel 4; the forward 2
                            tf = tflops(b, h, length, d, causal, "fwd", ms) * (1.5 if kind == "dq" else 2.0)
                    except Exception as e:  # noqa: BLE001
                        print(f"| {kind} | {d} | {causal} | {length} | {cfg} | error {type(e).__name__} | |")
                        total = float("inf")
                        break
                    total += ms / (tflops(b, h, length, d, causal, "fwd", 1.0))  # normalise shapes
                    print(f"| {kind} | {d} | {causal} | {length} | {cfg} | {ms:.3f} | {tf:.0f} |", flush=True)
                scores[cfg] = total
                _set_config(kind, None)
            if scores:
                best[(kind, d, causal)] = min(scores, key=scores.get)
    print("\nbest configs:", {f"{k[0]}-D{k[1]}-{'causal' if k[2] else 'full'}": v for k, v in best.items()},
          flush=True)
    return best


# ----------------------------------------------------------------------------- table


def device_tag() -> str:
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "a100", "l40s", "b200"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().replace(" ", "-")


def best_of(rounds, b, h, length, d, causal):
    """Each implementation's (forward ms, forward+backward ms, peak MiB), the times the least over ``rounds``
    interleaved rounds, each in a shuffled order (None where it never ran): GPU hosts have slow phases, and a
    quarter-millisecond call timed once lands in one now and then (D64 L = 1024 read 217 TFLOP/s in one run, 377-379
    in four fresh samples)."""
    res = {}
    for round_ in range(rounds):
        for name in round_order([*OURS, *PEERS], round_):
            r = measure(name, b, h, length, d, causal)
            old = res.get(name)
            res[name] = old if r is None else r if old is None else (min(old[0], r[0]), min(old[1], r[1]), r[2])
    return res


def table(best, out_path, quick, rounds):
    rows = []
    ratios = {"fwd": [], "fwd+bwd": []}
    cudnn = {"fwd": [], "fwd+bwd": []}
    vs_triton = {"fwd": [], "fwd+bwd": []}
    memory = []
    det_cudnn = {"fwd": [], "fwd+bwd": []}
    print("\n| D | L | causal | mode | fl | fl det | fl Triton | flash | cuDNN | efficient | Flex | fl/flash | "
          "fl/cuDNN | fl det/cuDNN | fl/best peer | fl/fl Triton | peak MiB fl / flash |", flush=True)
    for b, h, length, d, causal in shapes(quick):
        for kind in ("fwd", "dkdv", "dq"):
            cfg = best.get((kind, d, causal)) if best else None
            _set_config(kind, cfg)
        res = best_of(rounds, b, h, length, d, causal)
        for kind in ("fwd", "dkdv", "dq"):
            _set_config(kind, None)
        for mode, idx in (("fwd", 0), ("fwd+bwd", 1)):
            tf = {n: tflops(b, h, length, d, causal, mode, r[idx]) if r else None for n, r in res.items()}
            peers = [tf[p] for p in PEERS if tf[p]]
            best_peer = max(peers) if peers else None
            fmt = lambda x: f"{x:.0f}" if x else "n/a"
            ratio_flash = f"{tf['fl'] / tf['flash']:.2f}" if tf["fl"] and tf["flash"] else "n/a"
            ratio_best = f"{tf['fl'] / best_peer:.2f}" if tf["fl"] and best_peer else "n/a"
            ratio_cudnn = f"{tf['fl'] / tf['cudnn']:.2f}" if tf["fl"] and tf["cudnn"] else "n/a"
            ratio_det = f"{tf['fl-det'] / tf['cudnn']:.2f}" if tf["fl-det"] and tf["cudnn"] else "n/a"
            ratio_triton = f"{tf['fl'] / tf['fl-triton']:.2f}" if tf["fl"] and tf["fl-triton"] else "n/a"
            mem = ""
            if mode == "fwd+bwd":
                mf = f"{res['fl'][2]:.0f}" if res["fl"] else "n/a"
                mfl = f"{res['flash'][2]:.0f}" if res["flash"] else "n/a"
                mem = f"{mf} / {mfl}"
            row = (f"| {d} | {length} | {'yes' if causal else 'no'} | {mode} | {fmt(tf['fl'])} | "
                   f"{fmt(tf['fl-det'])} | {fmt(tf['fl-triton'])} | {fmt(tf['flash'])} | {fmt(tf['cudnn'])} | "
                   f"{fmt(tf['efficient'])} | {fmt(tf.get('flex'))} | {ratio_flash} | {ratio_cudnn} | {ratio_det} | "
                   f"{ratio_best} | {ratio_triton} | {mem} |")
            rows.append(row)
            print(row, flush=True)
            if tf["fl"] and tf["flash"]:
                ratios[mode].append((tf["fl"] / tf["flash"], d, length, causal))
            if tf["fl"] and tf["cudnn"]:
                cudnn[mode].append((tf["fl"] / tf["cudnn"], d, length, causal))
            if tf["fl-det"] and tf["cudnn"]:
                det_cudnn[mode].append((tf["fl-det"] / tf["cudnn"], d, length, causal))
            if tf["fl"] and tf["fl-triton"]:
                vs_triton[mode].append((tf["fl"] / tf["fl-triton"], d, length, causal))
            if mode == "fwd+bwd" and length == max(x[2] for x in shapes(quick)) and res["fl"] and res["flash"]:
                memory.append((res["fl"][2] / res["flash"][2], d, causal))
    header = (
        f"# scaled_dot_product_attention on {torch.cuda.get_device_name()}\n\n"
        f"{_run_line()}. bf16, batch*L = {TOKENS}, H*D = {WIDTH}, random data, "
        f"triton.testing.do_bench median, the best of {rounds} interleaved rounds (each in a shuffled order). "
        "TFLOP/s: forward 4*B*H*L*S*D (halved when causal), forward+backward "
        "3.5x that. Peers are torch SDPA pinned to one backend with torch.nn.attention.sdpa_kernel, and "
        "torch.compile(flex_attention) (causal: a block mask built once per length, outside the timing). "
        "fl: the default mode (on Hopper, D64/D128: the one-pass backward, dQ added by unordered fp32 reductions); "
        "fl det: fl inside fl.use_deterministic_attention(True) (the two passes, bitwise repeatable). "
        "fl Triton: fl with its Hopper (Gluon) kernels switched off, the Triton kernels everywhere (default mode: "
        "dQ added atomically at D128). "
        "Peak MiB: memory allocated by one forward+backward beyond the inputs.\n\n"
    )
    if best:
        header += "Block configs (BLOCK_M, BLOCK_N, warps, stages) from --sweep: " + ", ".join(
            f"{k[0]} D={k[1]} {'causal' if k[2] else 'full'}: {v}" for k, v in sorted(best.items())) + "\n\n"
    lines = ["| D | L | causal | mode | fl TFLOP/s | fl det | fl Triton | flash | cuDNN | efficient | Flex | "
             "fl/flash | fl/cuDNN | fl det/cuDNN | fl/best peer | fl/fl Triton | peak MiB fl / flash |",
             "|" + "---|" * 17, *rows]
    summary = ["", "Summary (targets: forward >= 1.2x flash, forward+backward >= 1.0x, peak memory within 10% of "
               "flash at the longest L):", ""]
    for mode in ("fwd", "fwd+bwd"):
        if ratios[mode]:
            lo, hi = min(ratios[mode]), max(ratios[mode])
            summary.append(f"- {mode}: fl/flash {lo[0]:.2f} (D={lo[1]} L={lo[2]} causal={lo[3]}) to {hi[0]:.2f}")
        if cudnn[mode]:
            lo, hi = min(cudnn[mode]), max(cudnn[mode])
            summary.append(f"- {mode}: fl/cuDNN {lo[0]:.2f} (D={lo[1]} L={lo[2]} causal={lo[3]}) to {hi[0]:.2f}")
        if det_cudnn[mode]:
            lo, hi = min(det_cudnn[mode]), max(det_cudnn[mode])
            summary.append(f"- {mode}: fl det/cuDNN {lo[0]:.2f} (D={lo[1]} L={lo[2]} causal={lo[3]}) to {hi[0]:.2f}")
        if vs_triton[mode]:
            lo, hi = min(vs_triton[mode]), max(vs_triton[mode])
            summary.append(f"- {mode}: fl/fl Triton {lo[0]:.2f} (D={lo[1]} L={lo[2]} causal={lo[3]}) to {hi[0]:.2f}")
    for ratio, d, causal in memory:
        summary.append(f"- peak memory fl/flash at the longest L, D={d} causal={causal}: {ratio:.2f}")
    print("\n".join(summary), flush=True)
    lines += summary
    if out_path:
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        with open(out_path, "w") as f:
            f.write(header + "\n".join(lines) + "\n")
        print(f"wrote {out_path}")


def _kernel_runs(d, length, causal) -> dict:
    """{fl, fl-det, cudnn: kernel_us of its forward+backward} at one table shape."""
    q, k, v = make(TOKENS // length, WIDTH // d, length, d, grad=True)
    do = torch.randn_like(q)
    runs = {}
    for name in ("fl", "fl-det", "cudnn"):
        f = attention(name)
        with fl.use_deterministic_attention(name == "fl-det"):
            fwd_bwd = lambda f=f: torch.autograd.grad(f(q, k, v, causal), (q, k, v), do)  # noqa: E731
            runs[name] = kernel_us(fwd_bwd, calls=10, warmup=5, name=_kernel_name)
    return runs


def kernels_table(out_path):
    """Each kernel's GPU time in one forward+backward of fl (default and deterministic mode) and of torch's SDPA on
    cuDNN, (B, H, L, D) leaves as in the table, from L = 2048."""
    lines = ["| D | L | causal | run | GPU us | cuDNN / this | kernels (us a call) |", "|---|---|---|---|---|---|---|"]
    for d in HEAD_DIMS:
        for length in (2048, 4096, 16384):
            for causal in (False, True):
                runs = _kernel_runs(d, length, causal)
                peer = sum(runs["cudnn"].values())
                for name, us in runs.items():
                    parts = ", ".join(f"{kernel} {t:.0f}" for kernel, t in sorted(us.items(), key=lambda kv: -kv[1]))
                    lines.append(f"| {d} | {length} | {'yes' if causal else 'no'} | {name} | {sum(us.values()):.0f} | "
                                 f"{peer / sum(us.values()):.2f} | {parts} |")
                    print(lines[-1], flush=True)
                torch.cuda.empty_cache()
    header = (f"# Attention's kernels on {torch.cuda.get_device_name()}\n\n"
              f"{_run_line()}. bf16 forward+backward (`torch.autograd.grad`), batch*L = 16384, H*D = "
              "2048; each kernel's GPU time a call, summed by torch.profiler over 10 calls back to back (no cache "
              "flush between calls, unlike the table's do_bench). fl-det: fl in deterministic mode; cudnn: torch's "
              "SDPA pinned to cuDNN.\n\n")
    report(header + "\n".join(lines) + "\n", out_path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="results file (or --out-dir: <dir>/<device>-<op>.md)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-lengths", default="4096")
    ap.add_argument("--sweep-at", default=None, help="B,H,L,D: sweep causal configs at this shape only, no table")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="time every row this many times, interleaved; keep the best")
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (its compiles take minutes)")
    ap.add_argument("--masks", action="store_true", help="varlen, window and softcap against FlexAttention only")
    ap.add_argument("--routing", action="store_true", help="the Hopper kernels against the Triton kernels around "
                    "MIN_FLOPS, by GPU time and wall time")
    ap.add_argument("--host", action="store_true", help="the host's time of small eager calls, ours and torch's")
    ap.add_argument("--kernels", action="store_true", help="each kernel's GPU time a forward+backward, ours and "
                    "cuDNN's")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--head-dims", default="64,128,256", help="the table's head dims, e.g. 64,128 (each D's rows take "
                    "minutes)")
    args = ap.parse_args()
    HEAD_DIMS[:] = [int(x) for x in args.head_dims.split(",")]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if args.no_flex:
        PEERS.remove("flex")
    if args.masks:
        from bench_varlen_attention import masks_table

        out = args.out or (os.path.join(args.out_dir, f"{device_tag()}-varlen_attention.md") if args.out_dir else None)
        masks_table(out)
        return
    if args.routing:
        routing_table(args.out)
        return
    if args.host:
        host_table(args.out)
        return
    if args.kernels:
        kernels_table(args.out)
        return
    if args.sweep_at:
        sweep([], args.workers, at=tuple(int(x) for x in args.sweep_at.split(",")))
        return
    best = sweep([int(x) for x in args.sweep_lengths.split(",")], args.workers) if args.sweep else {}
    if not args.sweep:  # compile the default configs in parallel before timing
        precompile([(kind, d, causal, None) for kind in ("fwd", "dkdv", "dq") for d in HEAD_DIMS
                    for causal in (False, True)], args.workers)
    out = args.out
    if out is None and args.out_dir is not None:
        out = os.path.join(args.out_dir, f"{device_tag()}-scaled_dot_product_attention.md")
    table(best, out, args.quick, args.rounds)


if __name__ == "__main__":
    main()
