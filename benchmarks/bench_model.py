"""End-to-end: train steps of gpt-small or llama-small with stock, compiled and fused layers, in one run.

gpt-small (12 layers, 12 heads, 768 wide, T=1024, vocabulary 50304) or llama-small (the same sizes with RMSNorm,
SwiGLU width 2048, rotary positions and 4 key/value heads: configs/model/llama-small.yaml), bf16 autocast, fused
AdamW, random token batches. Per variant: tokens/s, MFU (6N + 12LHQT FLOPs/token over the device's dense bf16
peak), peak memory and time per step, timed with CUDA events after warm-up (compiled variants: no recompiles allowed
while timed).

    python benchmarks/bench_model.py --out benchmarks/results/h200-model.md [--profile] [--batch 64]
    python benchmarks/bench_model.py --model llama-small --out benchmarks/results/h200-model-llama.md
    python benchmarks/bench_model.py --model llama-small --seq 8192 --batch 8 --only "sdpa,all fused,stock + compile"

The default batch, 64 sequences (65,536 tokens a step), is the one the results table reports: the stock row needs
about 107 GB there (an H200); on a smaller GPU pass --batch 16 or 32 (MFU is then 1-3 points lower).
    python benchmarks/bench_model.py --smoke        # CPU, tiny model: checks the script runs

``--profile`` adds torch.profiler's top kernels of the all-fused model.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the app (models/) runs from the repository

from models.callbacks import peak_flops  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
MODELS = {  # name -> (config, the fused twin of each stock part)
    "gpt-small": (SMALL, dict(attention="custom", loss="fused_linear", norm="fused_layernorm")),
    "llama-small": (
        dict(SMALL, n_kv_head=4, bias=False, norm="rmsnorm", mlp="swiglu", position="rotary"),
        dict(attention="custom", loss="fused_linear", norm="fused_rmsnorm", mlp="fused_swiglu",
             position="fused_rotary"),
    ),
}


def variants_of(model: str) -> list[tuple[str, dict, str | None]]:
    """(name, model overrides, torch.compile mode or None): stock, each fused part alone, all fused."""
    fused = MODELS[model][1]
    parts = [(f"{key}={value}", {key: value}, None) for key, value in fused.items()]
    if model == "gpt-small":  # the softmax inside the stock attention, and torch's SDPA
        parts.insert(0, ("sdpa", dict(attention="sdpa"), None))
        parts.insert(2, ("softmax=custom (stock attention)", dict(softmax="custom"), None))
        parts.insert(4, ("loss=custom", dict(loss="custom"), None))
    else:
        parts.insert(0, ("sdpa", dict(attention="sdpa"), None))
    return [
        ("stock", {}, None),
        ("stock + compile", {}, "default"),
        *parts,
        ("checkpoint=selective", dict(checkpoint="selective"), None),
        ("all fused", fused, None),
        ("all fused + selective checkpoint", {**fused, "checkpoint": "selective"}, None),
        ("all fused + compile", fused, "default"),
        ("all fused + compile max-autotune-no-cudagraphs", fused, "max-autotune-no-cudagraphs"),
        ("all fused + compile reduce-overhead", fused, "reduce-overhead"),
    ]


def build(overrides: dict, args, device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    size = dict(n_layer=2, n_head=4, n_embd=64, block_size=64) if args.smoke else dict(block_size=args.seq)
    cfg = GPTConfig(vocab_size=args.vocab, **{**MODELS[args.model][0], **size, **overrides})
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    return model, opt


def train_step(model, opt, idx, targets, autocast):
    torch.compiler.cudagraph_mark_step_begin()  # reduce-overhead: a new step, earlier outputs may be reused
    with autocast:
        loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def measure(name: str, overrides: dict, mode: str | None, args, device) -> dict:
    if device.type == "cuda":  # the previous variant's cached blocks must not count as this one's reserved peak
        gc.collect()
        torch.cuda.empty_cache()
    model, opt = build(overrides, args, device)
    T = model.config.block_size
    if mode is not None:  # the model (forward + backward), as nanoGPT does; the fused AdamW step stays eager
        torch._dynamo.reset()
        model = torch.compile(model, mode=mode, fullgraph=True)  # no graph break allowed
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, T + 1), generator=gen).to(device) for _ in range(4)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    for i in range(args.warmup):
        b = batches[i % len(batches)]
        train_step(model, opt, b[:, :-1], b[:, 1:], autocast)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    recompile_guard = torch._dynamo.config.patch(error_on_recompile=True) if mode else nullcontext()
    with recompile_guard:
        start = time.perf_counter()
        for i in range(args.steps):
            b = batches[i % len(batches)]
            loss = train_step(model, opt, b[:, :-1], b[:, 1:], autocast)
        sync()
        seconds = time.perf_counter() - start
    tokens_per_s = args.batch * T * args.steps / seconds
    raw = getattr(model, "_orig_mod", model)
    peak = peak_flops(torch.cuda.get_device_name(), "bf16-mixed") if device.type == "cuda" else None
    return dict(
        name=name, ms=1e3 * seconds / args.steps, tokens_per_s=tokens_per_s,
        mfu=raw.flops_per_token(T) * tokens_per_s / peak if peak else None,
        peak_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        # reserved includes CUDA-graph pools (reduce-overhead), which "allocated" misses: they are set up in warm-up
        reserved_gb=torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
        loss=loss.item(),
    )


def profile_all_fused(args, device) -> str:
    model, opt = build(MODELS[args.model][1], args, device)
    T = model.config.block_size
    b = torch.randint(0, args.vocab, (args.batch, T + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    for _ in range(3):
        train_step(model, opt, b[:, :-1], b[:, 1:], autocast)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            train_step(model, opt, b[:, :-1], b[:, 1:], autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)


def table(rows: list[dict]) -> str:
    base = next((r["tokens_per_s"] for r in rows if r["name"] == "stock"), rows[0]["tokens_per_s"])
    lines = ["| variant | ms/step | tokens/s | vs stock | MFU | peak GB | peak reserved GB | loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak, reserved = (f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("peak_gb", "reserved_gb"))
        lines.append(f"| {r['name']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{mfu} | {peak} | {reserved} | {r['loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default="gpt-small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024, help="T, tokens per sequence (long context: --seq 8192 --batch 8)")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated variant names to run (default: all)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, no compile: checks the script runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.vocab, args.warmup, args.steps = 2, 512, 1, 2
    device = torch.device("cpu" if args.smoke else "cuda")
    variants = [v for v in variants_of(args.model) if not (args.smoke and v[2])]
    if args.only:
        variants = [v for v in variants if v[0] in args.only.split(",")]
    # eager variants first, the slowest compiles last: a time limit cuts the least
    run_order = sorted(variants, key=lambda v: (v[2] is not None, v[2] == "max-autotune-no-cudagraphs"))
    profile = profile_all_fused(args, device) if args.profile else None
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    head = (f"# {args.model} training steps — {device_name}\n\n{datetime.date.today()}, torch {torch.__version__}. "
            f"B={args.batch}, T={64 if args.smoke else args.seq}, vocab {args.vocab}, bf16 autocast, fused AdamW, "
            f"{args.warmup} warm-up + {args.steps} timed steps on random tokens.\n\n")
    rows = {}
    for name, overrides, mode in run_order:
        try:
            rows[name] = measure(name, overrides, mode, args, device)
        except Exception as e:  # one failing variant must not lose the others' numbers
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        ordered = [rows[v[0]] for v in variants if v[0] in rows]
        text = head + table(ordered) + "\n"
        if profile:
            text += "\n## Top kernels, all fused (3 steps)\n\n```\n" + profile + "\n```\n"
        print(table([rows[name]]), flush=True)
        if args.out:  # rewritten after every variant: a time limit keeps what was measured
            with open(args.out, "w") as f:
                f.write(text)
    print(text)


if __name__ == "__main__":
    main()
