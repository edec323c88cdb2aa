"""Benchmark fl.varlen_attention, sliding windows and soft-capping against FlexAttention on the same masks (GPU).

The masks SDPA cannot take, one row of 16K tokens, H * D = 2048, bf16: packed documents of 64-4096
tokens (fl.varlen_attention vs a document mask, and vs our dense causal kernel on the documents padded to the
longest), sliding windows of 1024 and 4096 keys, and Gemma 2's soft-cap (50) causal and not. TFLOP/s count only the
(query, key) pairs the mask keeps, so a kernel that computes masked-out blocks scores lower; our dense causal kernel
at L = 16K is the yardstick row. FlexAttention: torch.compile(flex_attention), one mask_mod compiled per head dim.

    python benchmarks/bench_varlen_attention.py [--out-dir benchmarks/results]
    (also: python benchmarks/bench_scaled_dot_product_attention.py --masks)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scaled_dot_product_attention import DEVICE, DTYPE, WIDTH, device_tag, median_ms  # noqa: E402
from timing import round_order  # noqa: E402

import fusedlayers as fl  # noqa: E402

MASK_TOKENS = 16384
SOFTCAP = 50.0  # Gemma 2's attention soft-cap


def document_lengths(total: int, lo: int = 64, hi: int = 4096, seed: int = 0) -> list[int]:
    """Log-uniform document lengths in [lo, hi] packed to exactly ``total`` tokens (the last one fills the row)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        n = int(round(math.exp(math.log(lo) + torch.rand((), generator=g).item() * math.log(hi / lo))))
        lens.append(min(n, total - sum(lens)))
    return lens


def kept_pairs(n: int, left: int = -1, lens: list[int] | None = None) -> int:
    """(query, key) pairs a causal mask keeps over ``n`` tokens: within documents of ``lens``, or for a window of
    ``left`` keys back (-1: all)."""
    if lens is not None:
        return sum(m * (m + 1) // 2 for m in lens)
    if left < 0:
        return n * (n + 1) // 2
    return sum(min(i + 1, left + 1) for i in range(n))


class FlexMasks:
    """FlexAttention, compiled once per head dim: one mask_mod reads its document ids, window and causality from
    tensors (changed in place between cases, so nothing recompiles), with and without the soft-cap score_mod."""

    def __init__(self, n: int):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.cache_size_limit = 64
        self.n, self.create_block_mask = n, create_block_mask
        self.doc = torch.zeros(n, dtype=torch.int32, device=DEVICE)
        self.left = torch.tensor(n, device=DEVICE)
        self.causal = torch.tensor(True, device=DEVICE)
        self.flex = torch.compile(flex_attention)
        doc, left, causal = self.doc, self.left, self.causal

        def mask_mod(b, h, q, kv):
            return (doc[q] == doc[kv]) & ((q >= kv) | ~causal) & (q - kv <= left)

        def softcap(score, b, h, q, kv):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        self.mask_mod, self.softcap = mask_mod, softcap

    def set(self, causal: bool, left: int = -1, lens: list[int] | None = None):
        self.causal.fill_(causal)
        self.left.fill_(left if left >= 0 else self.n)
        if lens is None:
            self.doc.zero_()
        else:
            self.doc.copy_(torch.repeat_interleave(torch.arange(len(lens), device=DEVICE, dtype=torch.int32),
                                                   torch.tensor(lens, device=DEVICE)))
        self.block_mask = self.create_block_mask(self.mask_mod, None, None, self.n, self.n, device=DEVICE)

    def __call__(self, q, k, v, softcap: bool):
        return self.flex(q, k, v, block_mask=self.block_mask, score_mod=self.softcap if softcap else None)


def time_pair(run, inputs, rounds: int = 1) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of ``run(*inputs)``: of the round (of ``rounds``) with the fastest
    forward+backward, as the interleaved rounds in ``masks_table`` keep them; inputs require grad."""
    if rounds > 1:
        return min((time_pair(run, inputs) for _ in range(rounds)), key=lambda t: t[1])
    with torch.no_grad():
        run(*inputs)
        fwd = median_ms(lambda: run(*inputs))
    out = run(*inputs)
    do = torch.randn_like(out)

    def step():
        run(*inputs).backward(do)

    step()
    return fwd, median_ms(step, grad_to_none=list(inputs))


def mask_cases():
    lens = document_lengths(MASK_TOKENS)
    yield "packed documents 64-4096", dict(causal=True, lens=lens)
    for left in (1024, 4096):
        yield f"window {left}", dict(causal=True, left=left)
    yield "softcap, causal", dict(causal=True, softcap=True)
    yield "softcap", dict(causal=False, softcap=True)
    yield "dense causal (yardstick)", dict(causal=True, dense=True)


def masks_table(out_path, rounds: int = 2):
    n = MASK_TOKENS
    lens = document_lengths(n)
    print(f"\ndocuments: {len(lens)}, lengths {min(lens)}-{max(lens)}, mean {n / len(lens):.0f}", flush=True)
    rows = []
    header = ("| D | mask | mode | fl TFLOP/s | FlexAttention | padded (fl dense) | fl/Flex | fl / fl dense causal |")
    print(header, flush=True)
    for d in (64, 128):
        h = WIDTH // d
        flex = FlexMasks(n)
        results = {}
        for name, case in mask_cases():
            causal, left, softcap = case["causal"], case.get("left", -1), case.get("softcap", False)
            docs = case.get("lens")
            flops = 4.0 * h * d * (kept_pairs(n, left, docs) if causal else n * n)
            q, k, v = (torch.randn(n, h, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
            qf, kf, vf = (torch.randn(1, h, n, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
            cu = torch.tensor([0, *itertools.accumulate(docs or [n])], dtype=torch.int32, device=DEVICE)
            longest = max(docs or [n])
            window = (left, 0) if left >= 0 else (-1, -1)
            cap = SOFTCAP if softcap else 0.0
            if case.get("dense"):
                ours = time_pair(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=True), (qf, kf, vf),
                                 rounds)
                theirs = None
            else:
                flex.set(causal, left, docs)
                best = {"fl": (1e9, 1e9), "flex": (1e9, 1e9)}
                calls = {"fl": (lambda a, b, c: fl.varlen_attention(a, b, c, cu, cu, longest, longest, is_causal=causal,
                                                                    window_size=window, softcap=cap), (q, k, v)),
                         "flex": (lambda a, b, c: flex(a, b, c, softcap), (qf, kf, vf))}
                for r in range(rounds):  # interleaved: a slow phase of the host lands on both; first in turn
                    for impl in round_order(("fl", "flex"), r):
                        best[impl] = min(best[impl], time_pair(*calls[impl]), key=lambda t: t[1])
                ours, theirs = best["fl"], best["flex"]
            padded = None
            if docs:  # every document padded to the longest, our dense causal kernel
                qp, kp, vp = (torch.randn(len(docs), h, longest, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
                              for _ in range(3))
                padded = time_pair(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=True),
                                   (qp, kp, vp))
                del qp, kp, vp
            results[name] = (flops, ours, theirs, padded)
            torch.cuda.empty_cache()
        dense_flops, dense, _, _ = results["dense causal (yardstick)"]
        for name, (flops, ours, theirs, padded) in results.items():
            for mode, i, factor in (("fwd", 0, 1.0), ("fwd+bwd", 1, 3.5)):
                tf = lambda ms: flops * factor / (ms[i] * 1e-3) / 1e12 if ms else None  # noqa: E731
                fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
                yard = dense_flops * factor / (dense[i] * 1e-3) / 1e12
                vs_flex = f"{tf(ours) / tf(theirs):.2f}" if theirs else "-"
                row = (f"| {d} | {name} | {mode} | {fmt(tf(ours))} | {fmt(tf(theirs))} | {fmt(tf(padded))} | "
                       f"{vs_flex} | {tf(ours) / yard:.2f} |")
                rows.append(row)
                print(row, flush=True)
    text = (
        f"# Attention masks SDPA cannot take, against FlexAttention, on {torch.cuda.get_device_name()}\n\n"
        f"Date {datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}. bf16, one row of "
        f"{n} tokens, H * D = {WIDTH}, random data, triton.testing.do_bench median, the best of {rounds} interleaved "
        "rounds (fl and FlexAttention alternating, each first in every other round; forward and forward+backward of "
        "the same round). TFLOP/s count "
        "only the (query, key) pairs the mask keeps (4 * H * D per pair forward, 3.5x that forward+backward). fl: "
        "fl.varlen_attention (packed documents, causal within each; windows and soft-cap as one sequence of 16K), "
        "its key intervals cached across calls with the same cu_seqlens as in a model's layers. FlexAttention: "
        "torch.compile(flex_attention) with a block mask built once outside the timing (document ids, causal, "
        "window) and, for soft-cap, a tanh score_mod. Padded: the documents padded to the longest, our dense causal "
        f"kernel on ({len(lens)}, H, {max(lens)}, D). Documents: {len(lens)}, {min(lens)}-{max(lens)} tokens "
        f"(log-uniform, seed 0). Last column: our TFLOP/s over our dense causal kernel's at L = {n}.\n\n"
        + header + "\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
        print(f"wrote {out_path}")




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="results file (or --out-dir: <dir>/<device>-varlen_attention.md)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="time every row this many times, interleaved; keep the best")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    out = args.out or (os.path.join(args.out_dir, f"{device_tag()}-varlen_attention.md") if args.out_dir else None)
    masks_table(out, args.rounds)


if __name__ == "__main__":
    main()
