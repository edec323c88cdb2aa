"""Multi-GPU training: 1 GPU against 2 GPUs with DDP (and FSDP2), through train.py.

1. throughput: ``model=gpt-small`` with stock layers, all-fused layers (custom attention, fused linear
   cross-entropy; no checkpointing: on a 141 GB GPU gpt-small does not need the memory it saves) and all-fused
   + selective checkpointing, on 1 GPU and on 2 GPUs (DDP), ``--batch-per-gpu`` sequences of 1024 tokens on
   every GPU (weak scaling, as data-parallel scaling is usually quoted): tokens/s, MFU, peak memory and the
   scaling efficiency tokens/s(2 GPUs) / (2 x tokens/s(1 GPU)); target >= 90% for all-fused;
2. loss curves: the first ``--curve-steps`` steps (train loss at every step) of all-fused + selective
   checkpointing (every fused part) on 1 GPU, on 2 GPUs
   with DDP and on 2 GPUs with FSDP2, the same global batches (the data is split, not redrawn, across ranks);
   the bf16 noise they are judged against is the gap between stock and all-fused on 1 GPU (the same math,
   rounded differently);
3. checkpoints: ``last.ckpt`` of the 2-GPU DDP and FSDP runs loaded (strictly) into a 1-device model, whose
   val loss on the same val windows must equal the one the 2-GPU run reported.

    python benchmarks/bench_distributed.py --out benchmarks/results   # 2 GPUs, ~5 min; writes h200x2-distributed.md
    python benchmarks/bench_distributed.py --smoke --out /tmp/smoke    # CPU: tiny model, gloo, a few steps

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
are set in this process and in the environment of every process it starts (Lightning's DDP launcher passes
them on to the other ranks). Each run is a subprocess ``python train.py ...`` whose Hydra folder is under
``--logdir``; runs are skipped (and reported as such) once ``--budget`` seconds have passed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # before torch / NCCL are loaded here

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FUSEDLAYERS_ROOT", str(ROOT))  # as train.py: the runs' saved configs resolve paths by it
FUSED = ["model.attention=custom", "model.softmax=custom", "model.loss=fused_linear", "model.checkpoint=none"]
FUSED_SELECTIVE = [*FUSED[:-1], "model.checkpoint=selective"]  # every fused part
STOCK = ["model.attention=stock", "model.softmax=stock", "model.loss=stock", "model.checkpoint=none"]
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


def base_overrides(args) -> list[str]:
    if args.smoke:  # tiny model on CPU, fp32
        return [
            "model=gpt-tiny", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
            "trainer.accelerator=cpu", "trainer.precision=32-true", "data.max_val_windows=8", "sample.tokens=8",
        ]  # fmt: skip
    return ["model=gpt-small", "data.max_val_windows=64", "sample.tokens=32"]


def trainer_overrides(gpus: int, strategy: str) -> list[str]:
    if gpus == 1:
        return ["trainer=gpu", "trainer.devices=1"]
    return [f"trainer={strategy}", f"trainer.devices={gpus}"]


def plan(args) -> list[dict]:
    """Every run: name, part, layers, gpus, strategy, overrides (most important first: the budget may cut the
    tail)."""
    gb, steps, csteps = args.global_batch, args.steps, args.curve_steps
    throughput, runs = [], []
    for layers, lov in (("all-fused", FUSED), ("stock", STOCK), ("all-fused + selective", FUSED_SELECTIVE)):
        for gpus in (1, 2):
            throughput.append(dict(
                name=f"throughput {layers} {gpus} GPU" + (" ddp" if gpus > 1 else ""), part="throughput",
                layers=layers, gpus=gpus, strategy="ddp" if gpus > 1 else "single",
                overrides=[*lov, *trainer_overrides(gpus, "ddp"), f"data.batch_size={args.batch_per_gpu}",
                           f"trainer.max_steps={steps}", f"data.batches_per_epoch={steps}",
                           f"trainer.log_every_n_steps={args.log_every}", "~callbacks.model_checkpoint"],
            ))  # fmt: skip
    curves = [("all-fused", 1, "single", FUSED_SELECTIVE), ("all-fused", 2, "ddp", FUSED_SELECTIVE),
              ("all-fused", 2, "fsdp", FUSED_SELECTIVE), ("stock", 1, "single", STOCK)]  # fmt: skip
    for layers, gpus, strategy, lov in curves:
        keep_ckpt = gpus > 1  # the 2-GPU checkpoints are loaded on 1 device afterwards
        runs.append(dict(
            name=f"curve {layers} {gpus} GPU {strategy}", part="curve", layers=layers, gpus=gpus,
            strategy=strategy,
            overrides=[*lov, *trainer_overrides(gpus, strategy), f"data.batch_size={gb // gpus}",
                       f"trainer.max_steps={csteps}", f"data.batches_per_epoch={csteps}",
                       "trainer.log_every_n_steps=1", *([] if keep_ckpt else ["~callbacks.model_checkpoint"])],
        ))  # fmt: skip
    return throughput[:4] + runs + throughput[4:]  # all-fused + selective throughput last


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(NO_MULTICAST, PYTHONUNBUFFERED="1")
    return env


def run_one(run: dict, args, logdir: Path, deadline: float) -> dict:
    outdir = logdir / re.sub(r"[^A-Za-z0-9_.-]+", "_", run["name"])
    res = {k: run[k] for k in ("name", "part", "layers", "gpus", "strategy")}
    left = deadline - time.time()
    if left < 30:
        print(f"\n### {run['name']}: skipped (budget spent)", flush=True)
        return {**res, "rc": "skipped"}
    cmd = [
        sys.executable, str(ROOT / "train.py"), *base_overrides(args), *run["overrides"], *args.extra,
        "~callbacks.progress_bar", "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0",
        f"hydra.run.dir={outdir}",
    ]  # fmt: skip
    print(f"\n### {run['name']}\n$ {' '.join(cmd)}", flush=True)
    shutil.rmtree(outdir, ignore_errors=True)  # no stale metrics from an earlier attempt
    t0 = time.perf_counter()
    # its own process group: on a timeout the other ranks (started by Lightning) are killed with it
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=min(args.timeout, left))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc = "timeout"
    tail = (output or "")[-3000:]
    res.update(rc=rc, process_wall_s=time.perf_counter() - t0, run_dir=str(outdir))
    if (outdir / "summary.json").exists():
        res["summary"] = json.loads((outdir / "summary.json").read_text())
    res["losses"] = train_losses(outdir)
    if rc != 0:
        res["tail"] = tail
        print(f"FAILED (rc={rc}):\n{tail}", flush=True)
    else:
        s = res.get("summary", {})
        print(f"done in {res['process_wall_s']:.0f} s: {s.get('tokens_per_s') or 0:,.0f} tok/s, "
              f"val {s.get('val_loss')}", flush=True)  # fmt: skip
    return res


def train_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "csv" / "metrics.csv"
    if not path.exists():
        return {}
    with path.open() as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


# ------------------------------------------------------------------------------------- checkpoint on 1 device
def eval_checkpoint_on_one_device(run: dict, smoke: bool) -> dict:
    """Load the run's last.ckpt strictly into a 1-device GPTLitModule and compute the val loss on the val
    windows the run validated on (its own data config), as the run does (token-weighted, bf16 autocast on GPU)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from models.lit import GPTLitModule, load_checkpoint

    run_dir = Path(run["run_dir"])
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = {"name": run["name"], "checkpoint": str(ckpt)}
    if not ckpt.is_file():
        return {**out, "error": "no single-file last.ckpt"}
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda:0")
    try:
        state = load_checkpoint(ckpt)  # torch.load(weights_only=True): tensors and plain values only
        module = GPTLitModule(**state["hyper_parameters"])
        module.load_state_dict(state["state_dict"], strict=True)  # the full weights, 1-device names and shapes
        module.to(device).eval()
        cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
        dm = instantiate(cfg.data)
        dm.setup()
        total, count = 0.0, 0
        autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" and not smoke else None
        with torch.no_grad():
            for x, y in dm.val_dataloader():
                x, y = x.to(device), y.to(device)
                if autocast is not None:
                    with autocast:
                        loss = module(x, y)
                else:
                    loss = module(x, y)
                n = int((y != -100).sum())
                total, count = total + float(loss) * n, count + n
        out.update(val_loss_1_device=total / count, val_loss_run=run.get("summary", {}).get("val_loss"),
                   n_params=sum(p.numel() for p in module.parameters()))  # fmt: skip
    except Exception as e:  # reported in the table
        out["error"] = f"{type(e).__name__}: {e}"
    return out


# ------------------------------------------------------------------------------------------------ report
def fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def throughput_table(results: list[dict], target: float) -> tuple[str, dict]:
    tput = {(r["layers"], r["gpus"]): r for r in results if r["part"] == "throughput"}
    lines = [
        "| layers | GPUs | strategy | batch per GPU | status | tokens/s | MFU | peak mem per GPU (GB) | "
        "scaling efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    eff = {}
    for (layers, gpus), r in tput.items():
        s = r.get("summary", {})
        one = tput.get((layers, 1), {}).get("summary", {}).get("tokens_per_s")
        e = None
        if gpus > 1 and one and s.get("tokens_per_s"):
            e = eff[layers] = s["tokens_per_s"] / (gpus * one)
        batch = next((o.split("=")[1] for o in r.get("overrides", []) if o.startswith("data.batch_size=")), "-")
        lines.append(
            f"| {layers} | {gpus} | {r['strategy']} | {batch} | {s.get('status', r['rc'])} | "
            f"{fmt(s.get('tokens_per_s'), ',.0f')} | {fmt(s.get('mfu'), '.1%')} | {fmt(s.get('peak_mem_gb'), '.2f')} "
            f"| {fmt(e, '.1%')} |"
        )
    fused = eff.get("all-fused")
    verdict = (
        "not measured" if fused is None else ("met" if fused >= target else "NOT met") + f" ({fused:.1%})"
    )
    return "\n".join(lines) + f"\n\nTarget: all-fused scaling efficiency >= {target:.0%}: {verdict}.\n", eff


def curve_section(results: list[dict], every: int) -> tuple[str, dict]:
    curves = {r["name"]: r for r in results if r["part"] == "curve"}
    ref = next((r for r in curves.values() if r["layers"] == "all-fused" and r["gpus"] == 1), None)
    noise_run = next((r for r in curves.values() if r["layers"] == "stock" and r["gpus"] == 1), None)
    if ref is None or not ref.get("losses"):
        return "The 1-GPU all-fused curve did not run.\n", {}
    steps = sorted(ref["losses"])

    def gaps(run):
        if run is None or not run.get("losses"):
            return None
        common = [s for s in steps if s in run["losses"]]
        if len(common) != len(steps):
            return None
        d = [abs(run["losses"][s] - ref["losses"][s]) for s in common]
        return {"max": max(d), "mean": sum(d) / len(d), "final": d[-1]}

    noise = gaps(noise_run)
    stats = {"bf16 noise (stock vs all-fused, 1 GPU)": noise}
    for r in curves.values():
        if r["gpus"] > 1:
            stats[f"{r['strategy']} 2 GPUs vs 1 GPU (all-fused)"] = gaps(r)
    order = [ref, *(r for r in curves.values() if r["gpus"] > 1), noise_run]
    order = [r for r in order if r is not None]
    head = "| step | " + " | ".join(f"{r['layers']} {r['gpus']} GPU {r['strategy']}" for r in order) + " |"
    lines = [head, "|---" * (len(order) + 1) + "|"]
    for s in steps:
        if s % every and s != steps[-1]:
            continue
        lines.append(f"| {s} | " + " | ".join(fmt(r.get("losses", {}).get(s), ".4f") for r in order) + " |")
    text = "\n".join(lines) + "\n\n| comparison | max abs gap | mean abs gap | gap at the last step | verdict |\n"
    text += "|---|---|---|---|---|\n"
    bound = None if noise is None else 2 * noise["max"] + 0.01
    for name, g in stats.items():
        if name.startswith("bf16 noise"):
            verdict = "reference"
        elif g is None:
            verdict = "not measured"
        elif bound is None:
            verdict = "no noise reference"
        else:
            verdict = "within bf16 noise" if g["max"] <= bound else "OUTSIDE bf16 noise"
        text += (
            f"| {name} | {fmt(g and g['max'], '.4f')} | {fmt(g and g['mean'], '.4f')} | "
            f"{fmt(g and g['final'], '.4f')} | {verdict} |\n"
        )
    text += (
        "\nWithin bf16 noise = max abs gap <= 2 x the stock-vs-fused max gap + 0.01"
        + (f" = {bound:.4f}" if bound is not None else "")
        + ".\n"
    )
    return text, stats


def ckpt_section(evals: list[dict]) -> str:
    lines = ["| run | checkpoint loads (strict) on 1 device | val loss on 1 device | val loss of the run | abs gap |",
             "|---|---|---|---|---|"]  # fmt: skip
    for e in evals:
        if "error" in e:
            lines.append(f"| {e['name']} | no: {e['error'][:200]} | - | - | - |")
            continue
        a, b = e.get("val_loss_1_device"), e.get("val_loss_run")
        gap = abs(a - b) if a is not None and b is not None else None
        lines.append(f"| {e['name']} | yes ({e['n_params']:,} parameters) | {fmt(a, '.4f')} | {fmt(b, '.4f')} | "
                     f"{fmt(gap, '.4f')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, gloo, a few steps (catches errors)")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="loss curves: sequences per step, all GPUs (16; smoke 8)")
    ap.add_argument("--batch-per-gpu", type=int, default=None, help="throughput: sequences per GPU (16; smoke 4)")
    ap.add_argument("--steps", type=int, default=None, help="steps per throughput run (100; smoke 12)")
    ap.add_argument("--curve-steps", type=int, default=None, help="steps of the loss curves (50; smoke 6)")
    ap.add_argument("--log-every", type=int, default=25, help="throughput runs: log (and sync) every n steps")
    ap.add_argument("--target", type=float, default=0.90, help="scaling-efficiency target (all-fused)")
    ap.add_argument("--out", default=None, help="folder for the results (benchmarks/results; smoke: --logdir)")
    ap.add_argument("--logdir", default="/tmp/bench_distributed", help="Hydra output folders of the runs")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per run")
    ap.add_argument("--budget", type=int, default=540, help="seconds for all runs; later runs are skipped")
    ap.add_argument("--extra", nargs="*", default=[], help="more train.py overrides for every run (last wins)")
    args = ap.parse_args()
    args.global_batch = args.global_batch or (8 if args.smoke else 16)
    args.batch_per_gpu = args.batch_per_gpu or (4 if args.smoke else 16)
    args.steps = args.steps or (12 if args.smoke else 100)
    args.curve_steps = args.curve_steps or (6 if args.smoke else 50)
    if args.smoke:
        args.log_every = min(args.log_every, 3)
    if args.global_batch % 2:
        ap.error("--global-batch must be even (split over 2 GPUs)")
    t_start = time.time()
    deadline = t_start + args.budget

    import torch

    if not args.smoke and torch.cuda.device_count() < 2:
        ap.error(f"needs 2 GPUs, found {torch.cuda.device_count()} (use --smoke on CPU)")
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"env: {' '.join(f'{k}={os.environ[k]}' for k in NO_MULTICAST)}", flush=True)

    results = [run_one(r, args, logdir, deadline) | {"overrides": r["overrides"]} for r in plan(args)]
    # (no CUDA context in this process while the runs use the GPUs)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0)
    evals = [eval_checkpoint_on_one_device(r, args.smoke) for r in results
             if r["part"] == "curve" and r["gpus"] > 1 and r.get("rc") == 0]  # fmt: skip

    versions = f"torch {torch.__version__}"
    for mod in ("triton", "lightning"):
        try:
            versions += f", {mod} {__import__(mod).__version__}"
        except ImportError:
            pass
    n_gpus = 2
    precision = "fp32 (smoke)" if args.smoke else "bf16-mixed"
    model = "tiny GPT (2 layers, 32 wide, block 32)" if args.smoke else "gpt-small (12 layers, 12 heads, 768 wide, block 1024, char vocab, ~85M parameters)"  # noqa: E501
    tput_text, eff = throughput_table(results, args.target)
    curve_text, curve_stats = curve_section(results, every=1 if args.smoke else 5)
    text = (
        f"# Multi-GPU training: {n_gpus}x {device}, DDP and FSDP2\n\n"
        f"{datetime.date.today()}, {versions}, {precision}, `benchmarks/bench_distributed.py"
        f"{' --smoke' if args.smoke else ''}`. {model}. all-fused = `{' '.join(FUSED)}`; all-fused + selective = "
        f"`{' '.join(FUSED_SELECTIVE)}`; stock = `{' '.join(STOCK)}`. NVLink multicast off in every process: "
        f"{', '.join(f'{k}={v}' for k, v in NO_MULTICAST.items())}.\n\n"
        f"## Throughput ({args.steps} steps, {args.batch_per_gpu} sequences per GPU)\n\n"
        f"tokens/s = all GPUs together, the first 5 steps and validation excluded; MFU per GPU against the dense "
        f"bf16 peak (6N + 12LHQT FLOPs/token, no recompute counted); scaling efficiency = tokens/s on 2 GPUs / "
        f"(2 x tokens/s on 1 GPU), the batch per GPU the same on 1 and 2 GPUs.\n\n{tput_text}\n"
        f"Loss curves and checkpoints below use all-fused + selective (every fused part), with the global batch "
        f"fixed: {args.global_batch} sequences per step (1 GPU: {args.global_batch}; 2 GPUs: "
        f"{args.global_batch // 2} per GPU); the 2-GPU run sees exactly the 1-GPU run's windows, split between "
        f"the ranks.\n\n"
        f"## Loss curves, first {args.curve_steps} steps (train loss at each step)\n\n{curve_text}\n"
        f"## Checkpoints saved on 2 GPUs, loaded on 1\n\n"
        f"DDP saves rank 0's replica; FSDP2 (`trainer=fsdp`, `save_distributed_checkpoint: false`) gathers the full "
        f"state on rank 0 into one file. Each `last.ckpt` is loaded with `load_state_dict(strict=True)` into a "
        f"1-device model, whose val loss on the run's val windows is compared with the one the run reported "
        f"(which was computed sharded over 2 GPUs).\n\n{ckpt_section(evals)}\n"
        f"Total wall time {time.time() - t_start:.0f} s (budget {args.budget} s).\n"
    )
    print("\n" + text)
    out = Path(args.out or (logdir if args.smoke else ROOT / "benchmarks" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    slug = "cpu-smoke" if args.smoke else re.sub(r"^nvidia-", "", re.sub(r"[^A-Za-z0-9]+", "-", device).lower())
    slug = slug.strip("-") + ("" if args.smoke else f"x{n_gpus}")
    (out / f"{slug}-distributed.md").write_text(text)
    raw = {"results": results, "checkpoint_evals": evals, "efficiency": eff, "curves": curve_stats}
    (out / f"{slug}-distributed.json").write_text(json.dumps(raw, indent=2, default=str))
    print(f"written: {out / f'{slug}-distributed.md'}")
    ok = all(r.get("rc") == 0 for r in results) and all("error" not in e for e in evals)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
