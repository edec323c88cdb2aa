"""Benchmark activation checkpointing on a stack of GPT blocks (GPU).

Trains steps (forward, backward, SGD update) of L=8 stock pre-LN GPT blocks (causal attention, GELU MLP;
bf16 parameters and activations; B=8, T=1024, d=1024, 16 heads) with:

- none: no checkpointing;
- torch: torch.utils.checkpoint(use_reentrant=False) per block (the peer for "full");
- fl full: fl.checkpoint(block, x) per block;
- torch SAC: torch.utils.checkpoint with create_selective_checkpoint_contexts keeping mm/addmm/SDPA
  outputs (the peer for "selective");
- fl selective: fl.checkpoint(block, x, policy="selective") (matmul and attention outputs, attention probabilities
  and the contiguous copies of q, k^T, v and the attention output kept: on written-out attention the recompute reruns
  the dropouts, norms and GELU, not the scores or the softmax);
- fl keep-matmuls: the policy fl.ops.checkpoint.keep_matmuls, Megatron-LM's selective recomputation (matmul and
  attention outputs kept; written-out attention's scores, softmax and dropout recomputed: less memory, more time);
- fl wide-mm: fl.checkpoint with a callable policy keeping only the outputs of the widening matmuls (qkv,
  fc1); attention and the d->d matmuls are recomputed (trades more compute for less memory).

Reports the step time (triton.testing.do_bench median; ratio to 'none'), the activation memory per layer
held between forward and backward ((memory after forward - memory before) / L: what the formula counts)
and the peak during the step ((peak - memory before) / L; it includes one block's recompute and the
backward's temporaries), next to the formula s*b*h*(34 + 5*a*s/h) bytes (Korthikanti et al. 2022,
attention probabilities materialised).

Two attention implementations (--attention): "sdpa", torch's fused SDPA, which never stores the probabilities, and
"math", nanoGPT's written-out attention (softmax(q @ k^T * scale, causal) with dropout, @ v), which stores them as
the formula assumes.

    python benchmarks/bench_checkpoint.py [--out DIR] [--dropout 0.0 0.1] [--batch 8 16] [--attention sdpa math]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import platform
import re

import torch
import torch.nn.functional as F
import triton
from timing import kernel_ms
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from triton.testing import do_bench

import fusedlayers as fl

aten = torch.ops.aten
L, B, T, D, HEADS = 8, 8, 1024, 1024, 16
ATTENTION = "sdpa"  # or "math"; set per configuration by main()


class GPTBlock(nn.Module):
    """A stock pre-LN GPT block: x + drop(proj(attention(qkv(ln1 x)))), then x + drop(fc2(gelu(fc1(ln2 x))))."""

    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads, self.p, self.attention = heads, p, ATTENTION
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.p if self.training else 0.0
        if self.attention == "math":  # nanoGPT's non-flash path
            scores = (q @ k.transpose(-2, -1)) * k.shape[-1] ** -0.5
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = F.dropout(F.softmax(scores.masked_fill(future, float("-inf")), dim=-1), p) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class Stack(nn.Module):
    def __init__(self, wrap, p: float, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(d, heads, p) for _ in range(L))
        self.wrap = wrap

    def forward(self, x):
        for block in self.blocks:
            x = self.wrap(block, x)
        return x


SAC_SAVE = {aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}


def torch_sac(block, x):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return torch_checkpoint(block, x, use_reentrant=False,
                            context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def wide_matmuls(op, *args, **kwargs) -> bool:
    """Keep the outputs of matmuls with more output than input features (qkv: d->3d, fc1: d->4d)."""
    if op is aten.addmm.default:  # addmm(bias, input (n, k), weight.t() (k, m))
        return args[2].shape[1] > args[1].shape[1]
    if op is aten.mm.default:
        return args[1].shape[1] > args[0].shape[1]
    return False


VARIANTS = {
    "none": lambda block, x: block(x),
    "torch": lambda block, x: torch_checkpoint(block, x, use_reentrant=False),
    "fl full": lambda block, x: fl.checkpoint(block, x),
    "torch SAC": torch_sac,
    "fl selective": lambda block, x: fl.checkpoint(block, x, policy="selective"),
    "fl keep-matmuls": lambda block, x: fl.checkpoint(block, x, policy=fl.ops.checkpoint.keep_matmuls),
    "fl wide-mm": lambda block, x: fl.checkpoint(block, x, policy=wide_matmuls),
}
SELECTIVE = ("fl selective", "fl keep-matmuls", "fl wide-mm")  # judged against torch SAC
PEERS = {"fl full": "torch"} | dict.fromkeys(SELECTIVE, "torch SAC")


def build(name: str, p: float, shape: tuple[int, int, int, int] | None = None):
    b, t, d, heads = shape or (B, T, D, HEADS)
    torch.manual_seed(0)
    model = Stack(VARIANTS[name], p, d, heads).cuda().to(torch.bfloat16)
    x = torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    for param in model.parameters():  # gradients allocated once, outside the measured memory
        param.grad = torch.zeros_like(param)

    def step():
        opt.zero_grad(set_to_none=False)
        model(x).backward(dy)
        opt.step()

    return model, x, dy, step


def measure(name: str, p: float) -> dict:
    model, x, dy, step = build(name, p)
    step()  # warm-up (kernels selected, workspaces allocated)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=False)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = model(x)
    torch.cuda.synchronize()
    stored = torch.cuda.memory_allocated() - base
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(step, warmup=200, rep=1000, return_mode="median")
    gpu_ms = kernel_ms(step, calls=10)
    del model, x, dy, step
    # Host cost of a step: the same step on tiny tensors (B=1, T=16, d=64), where the GPU idles.
    _, _, _, tiny = build(name, p, (1, 16, 64, 2))
    host_ms = do_bench(tiny, warmup=100, rep=500, return_mode="median")
    torch.cuda.empty_cache()
    return dict(name=name, ms=ms, gpu_ms=gpu_ms, stored=stored / L, peak=peak / L, host_ms=host_ms)


def gradient_check(p: float) -> list[str]:
    """Max |grad - grad(none)| per variant, next to none's own run-to-run difference (same seed)."""
    def grads(name):
        model, x, dy, _ = build(name, p)
        torch.manual_seed(1)
        model(x).backward(dy)
        out = torch.cat([q.grad.float().flatten() for q in model.parameters()] + [x.grad.float().flatten()])
        del model, x, dy
        return out

    ref = grads("none")
    lines = [f"none vs none (run-to-run): {(grads('none') - ref).abs().max().item():.3e}"]
    for name in ("fl full", *SELECTIVE):
        lines.append(f"{name} vs none: {(grads(name) - ref).abs().max().item():.3e}")
    torch.cuda.empty_cache()
    return lines


def attention_op(p: float) -> str:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func._schema.name:
                seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    block = GPTBlock(D, HEADS, p).cuda().to(torch.bfloat16)
    with Probe(), torch.no_grad():
        block(torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16))
    return ", ".join(dict.fromkeys(seen)) or "none (q @ k^T, softmax, dropout, @ v)"


def table(rows: list[dict], p: float) -> str:
    sbh = T * B * D
    formula = sbh * (34 + 5 * HEADS * T / D)
    none = next(r for r in rows if r["name"] == "none")
    out = [f"### {ATTENTION} attention, B={B}, dropout {p}\n",
           f"Formula s*b*h*(34 + 5*a*s/h) = {formula / 2**20:.0f} MiB per layer "
           f"(= {formula / sbh:.0f} sbh bytes); 2*s*b*h = {2 * sbh / 2**20:.0f} MiB; "
           f"attention op: {attention_op(p)}.\n",
           "| variant | step ms | vs none | GPU ms/step | vs none | act. MiB/layer (after fwd) | sbh bytes | vs none | "
           "peak MiB/layer | host ms/step (tiny) | vs peer (time, GPU time, act. memory) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = next((q for q in rows if q["name"] == PEERS.get(r["name"])), None)
        vs_peer = (f"{PEERS[r['name']]}: {r['ms'] / peer['ms']:.3f}x time, {r['gpu_ms'] / peer['gpu_ms']:.3f}x GPU, "
                   f"{r['stored'] / peer['stored']:.3f}x mem" if peer else "")
        out.append(f"| {r['name']} | {r['ms']:.2f} | {r['ms'] / none['ms'] - 1:+.1%} | {r['gpu_ms']:.2f} | "
                   f"{r['gpu_ms'] / none['gpu_ms'] - 1:+.1%} | {r['stored'] / 2**20:.1f} | "
                   f"{r['stored'] / sbh:.2f} | {r['stored'] / none['stored'] - 1:+.1%} | {r['peak'] / 2**20:.1f} | "
                   f"{r['host_ms']:.2f} | {vs_peer} |")
    return "\n".join(out) + "\n"


def targets(rows: list[dict]) -> str:
    r = {row["name"]: row for row in rows}
    if "none" not in r:
        return ""
    over = {n: r[n]["ms"] / r["none"]["ms"] - 1 for n in r}
    gpu = {n: r[n]["gpu_ms"] / r["none"]["gpu_ms"] - 1 for n in r}
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines = [""]
    if {"torch", "fl full"} <= r.keys():
        full_mem = r["fl full"]["stored"] / r["torch"]["stored"] - 1
        lines.append(
            f"- full: activation memory {full_mem:+.1%} vs torch (target within 5%): {verdict(abs(full_mem) <= 0.05)}; "
            f"step overhead {over['fl full']:+.1%} vs torch's {over['torch']:+.1%} (target: no larger): "
            f"{verdict(over['fl full'] <= over['torch'])}; in GPU time {gpu['fl full']:+.1%} vs {gpu['torch']:+.1%}: "
            f"{verdict(gpu['fl full'] <= gpu['torch'])}")
    for name in SELECTIVE:
        if name in r:
            saved = 1 - r[name]["stored"] / r["none"]["stored"]
            lines.append(f"- {name}: activation memory {saved:.1%} less than none (target >= 50%): "
                         f"{verdict(saved >= 0.5)}; step overhead {over[name]:+.1%} (target <= 10%): "
                         f"{verdict(over[name] <= 0.10)}; in GPU time {gpu[name]:+.1%}: {verdict(gpu[name] <= 0.10)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    global B, ATTENTION
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="directory for <device>-checkpoint.md")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--batch", type=int, nargs="+", default=[B], help="batch sizes (the issue's is 8)")
    parser.add_argument("--attention", nargs="+", choices=("sdpa", "math"), default=["sdpa", "math"])
    parser.add_argument("--no-check", action="store_true", help="skip the gradient comparison")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    text = (f"# checkpoint — {device}\n\n{datetime.date.today()}, torch {torch.__version__}, triton "
            f"{triton.__version__}, python {platform.python_version()}. {L} GPT blocks, bf16 parameters and "
            f"activations, B={B}, T={T}, d={D}, {HEADS} heads; a step is forward + backward (random grad "
            f"of the output) + SGD update, do_bench median. 'act.' = memory held between forward and backward "
            f"per layer; 'peak' = step peak over the memory before forward, per layer. sbh = s*b*h.\n\n")
    text += ("'GPU ms/step' is the step's kernels' own durations summed by torch.profiler (10 steps): the device's "
             "share of the step, without the time the GPU waits for the CPU. "
             "'host ms/step (tiny)' is the same step on B=1, T=16, d=64 tensors, where the GPU waits on the CPU: "
             "the host's cost of launching a step; a variant whose host cost exceeds the GPU time of the real step "
             "is bound by the CPU.\n\n")
    print(text, flush=True)
    for attention, batch, p in itertools.product(args.attention, args.batch, args.dropout):
        ATTENTION, B = attention, batch  # module-level settings that build() and table() read
        rows, failed = [], []
        for name in args.variants:
            try:
                rows.append(measure(name, p))
            except Exception as e:  # a peer that cannot run this configuration: say so, keep going
                failed.append(f"- {name} failed: {type(e).__name__}: {str(e)[:300]}")
                torch.cuda.empty_cache()
        part = table(rows, p) + targets(rows) + ("\n".join(failed) + "\n" if failed else "")
        if not args.no_check:
            try:
                lines = gradient_check(p)
            except Exception as e:
                lines = [f"failed: {type(e).__name__}: {str(e)[:300]}"]
            part += "\nGradients (max abs difference over all parameters and the input):\n\n"
            part += "\n".join(f"- {line}" for line in lines) + "\n"
        print(part, flush=True)
        text += part + "\n"
        if args.out:  # after each configuration, so a cut-off run keeps what it measured
            short = re.search(r"\b([a-z]\d{2,4})\b", device.lower())  # "NVIDIA H100 80GB HBM3" -> h100
            slug = short.group(1) if short else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
            path = os.path.join(args.out, f"{slug}-checkpoint.md")
            with open(path, "w") as f:
                f.write(text)
            print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
