"""End-to-end training benchmark on one GPU, through train.py:

1. throughput: ``model=gpt-small trainer=gpu`` for ``--steps`` steps with each attention choice
   (stock, sdpa, custom): tokens/s, MFU, peak memory, final val loss;
2. shakespeare: ``experiment=shakespeare_char`` (nanoGPT's baby GPT, 5000 iterations) with stock layers and
   with all-fused layers: best val loss (nanoGPT reaches ~1.47) and wall time.

    python benchmarks/bench_train.py --shakespeare /path/to/tinyshakespeare.txt --out benchmarks/results

Prints a table and writes it to ``<out>/<device>-train.md`` (plus the raw summaries as JSON). Each run is
a subprocess ``python train.py ...`` whose Hydra output folder is under ``--logdir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUSED = ["model.attention=custom", "model.softmax=custom", "model.loss=fused_linear"]


def runs(args) -> list[tuple[str, str, list[str]]]:
    """(part, name, overrides) of every run."""
    out = []
    if "throughput" in args.parts:
        common = [
            "model=gpt-small",
            "trainer=gpu",
            f"data.batch_size={args.batch_size}",
            f"trainer.max_steps={args.steps}",
            f"data.batches_per_epoch={args.steps}",
            "data.max_val_windows=64",
            "sample.tokens=64",
            "trainer.log_every_n_steps=25",
        ]
        for att in args.attention:
            out.append(("throughput", f"gpt-small attention={att}", [*common, f"model.attention={att}"]))
    if "shakespeare" in args.parts:
        common = [
            "experiment=shakespeare_char",
            f"data.path={args.shakespeare}",
            "sample.tokens=100",
            f"trainer.max_steps={args.shakespeare_steps}",
        ]
        out.append(("shakespeare", "shakespeare_char stock", common))
        out.append(("shakespeare", "shakespeare_char all-fused", [*common, *FUSED]))
    return out


def run_one(name: str, overrides: list[str], logdir: Path, compile_: bool, timeout: int) -> dict:
    outdir = logdir / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *overrides,
        f"compile={str(compile_).lower()}",
        f"hydra.run.dir={outdir}",
        "callbacks.progress_bar.refresh_rate=100",
    ]
    print(f"\n### {name}\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-2500:]
    wall = time.perf_counter() - t0
    summary = {}
    if (outdir / "summary.json").exists():
        summary = json.loads((outdir / "summary.json").read_text())
    summary.update(name=name, rc=rc, process_wall_s=wall)
    if rc != 0:
        print(f"FAILED (rc={rc}):\n{tail}", flush=True)
    else:
        print(
            f"done in {wall:.0f} s: best val {summary.get('best_val_loss')}, "
            f"{summary.get('tokens_per_s') or 0:,.0f} tok/s",
            flush=True,
        )
    return summary


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    head = (
        "| run | status | steps | tokens/s | MFU | peak mem (GB) | final val loss | best val loss | "
        "train wall (s) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            " | ".join(
                [
                    f"| {r['name']}",
                    str(r.get("status", f"rc={r['rc']}")),
                    str(r.get("steps", "-")),
                    fmt(r.get("tokens_per_s"), ",.0f"),
                    fmt(r.get("mfu"), ".1%"),
                    fmt(r.get("peak_mem_gb"), ".2f"),
                    fmt(r.get("val_loss"), ".4f"),
                    fmt(r.get("best_val_loss"), ".4f"),
                    fmt(r.get("wall_time_s"), ".0f"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--parts", default="throughput,shakespeare", help="throughput,shakespeare (comma-separated)"
    )
    ap.add_argument("--steps", type=int, default=300, help="gpt-small steps per attention choice")
    ap.add_argument("--batch-size", type=int, default=16, help="gpt-small batch (x 1024 tokens)")
    ap.add_argument(
        "--attention", default="stock,sdpa,custom", help="attention choices for the throughput part"
    )
    ap.add_argument(
        "--shakespeare",
        default=os.environ.get(
            "SHAKESPEARE_PATH", str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
        ),
        help="path of tinyshakespeare.txt",
    )
    ap.add_argument("--shakespeare-steps", type=int, default=5000)
    ap.add_argument("--compile", action="store_true", help="compile=true for every run")
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the results table"
    )
    ap.add_argument("--logdir", default="/tmp/bench_train", help="Hydra output folders of the runs")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument(
        "--extra", nargs="*", default=[], help="more train.py overrides for every run (last wins)"
    )
    args = ap.parse_args()
    args.parts = args.parts.split(",")
    args.attention = args.attention.split(",")
    if "shakespeare" in args.parts and not Path(args.shakespeare).is_file():
        ap.error(f"--shakespeare {args.shakespeare}: no such file")

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    results = [
        run_one(name, [*ov, *args.extra], logdir, args.compile, args.timeout) for _, name, ov in runs(args)
    ]

    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    header = (
        f"# End-to-end training: {device}\n\n{datetime.date.today()}, {versions}, bf16-mixed, "
        f"compile={args.compile}. gpt-small: 12 layers, 12 heads, 768 wide, block 1024, batch "
        f"{args.batch_size}, char vocab, {args.steps} steps (tokens/s excludes the first 5 steps and "
        f"validation; MFU against the dense bf16 peak, 6N + 12LHQT FLOPs/token). shakespeare_char: "
        f"nanoGPT's baby GPT, {args.shakespeare_steps} iterations; all-fused = {' '.join(FUSED)}; "
        f"wall = the whole training run incl. validation.\n"
    )
    text = header + "\n" + table(results) + "\n"
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    if set(args.parts) != {"throughput", "shakespeare"}:
        slug += "-" + "-".join(args.parts)  # a partial run does not overwrite the full table
    (out / f"{slug}-train.md").write_text(text)
    (out / f"{slug}-train.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"written: {out / f'{slug}-train.md'}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
