"""The QAT outcome: fp vs int4 post-training quantization vs int4 QAT, on the small GPT.

1. train the tiny GPT (configs/model/gpt-tiny) in fp32 on the built-in corpus for ``--steps`` steps;
2. PTQ: quantize its Linear weights to int4, one scale per 32 input features (model.quant=int4's recipe),
   with ``fl.qat.prepare`` + ``fl.qat.convert`` and no training;
3. QAT: from the same fp weights, fine-tune ``--qat-steps`` steps with int4 fake quantization, then convert;
4. control: the fp model fine-tuned the same ``--qat-steps`` steps, to separate QAT's gain from extra training.

Reports val loss for each and the recovered fraction (PTQ - QAT) / (PTQ - fp). Runs on CPU in a few minutes:

    python benchmarks/bench_qat.py --out benchmarks/results/cpu-qat.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import sys
import time
from pathlib import Path

import torch
from timing import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the app (models/) runs from the repository

import fusedlayers as fl  # noqa: E402
from models.data import TextDataModule  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from models.layers import QUANT  # noqa: E402


def batches(dm: TextDataModule, first: int, count: int):
    windows = dm.train_dataloader()
    for g in range(first, first + count):
        yield windows.batch(g)


def train(model: GPT, dm: TextDataModule, first: int, steps: int, lr: float) -> None:
    """AdamW with linear warmup and cosine decay to lr/10 over ``steps`` (the recipe of configs/train.yaml)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    warmup = max(1, steps // 10)

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    for x, y in batches(dm, first, steps):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


@torch.no_grad()
def val_loss(model: torch.nn.Module, dm: TextDataModule) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in dm.val_dataloader():
        total += model(x, y).item() * y.numel()
        count += y.numel()
    return total / count


def int4(model: GPT) -> GPT:
    """A copy of ``model`` with model.quant=int4's fake quantization on its Linear layers."""
    quantized = copy.deepcopy(model)
    QUANT.get("int4")(quantized, None)
    return quantized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="fp training steps")
    ap.add_argument("--qat-steps", type=int, default=200, help="QAT (and fp control) fine-tuning steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qat-lr", type=float, default=3e-4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(1337)
    start = time.time()
    dm = TextDataModule(block_size=128, batch_size=32, max_val_windows=256, cache_dir=".cache/data")
    dm.prepare_data()
    dm.setup()
    fp = GPT(GPTConfig(vocab_size=dm.vocab_size))
    train(fp, dm, 0, args.steps, args.lr)
    results = {"fp": val_loss(fp, dm)}

    results["PTQ int4"] = val_loss(fl.qat.convert(int4(fp)), dm)

    qat = int4(fp)
    train(qat, dm, args.steps, args.qat_steps, args.qat_lr)
    results["QAT int4 (fake-quant)"] = val_loss(qat, dm)
    results["QAT int4 (converted)"] = val_loss(fl.qat.convert(qat), dm)

    control = copy.deepcopy(fp)
    train(control, dm, args.steps, args.qat_steps, args.qat_lr)
    results["fp + same fine-tuning (control)"] = val_loss(control, dm)
    results["PTQ int4 of the control"] = val_loss(fl.qat.convert(int4(control)), dm)

    qat_loss = results["QAT int4 (converted)"]
    recovered = (results["PTQ int4"] - qat_loss) / (results["PTQ int4"] - results["fp"])
    ptq_c, fp_c = results["PTQ int4 of the control"], results["fp + same fine-tuning (control)"]
    recovered_control = (ptq_c - qat_loss) / (ptq_c - fp_c)
    text = (
        f"# QAT outcome — CPU, tiny GPT on the built-in corpus\n\n{datetime.date.today()}, torch {torch.__version__}. "
        f"gpt-tiny (4 layers, 128 wide, block 128), char-level KJV, batch 32; fp trained {args.steps} steps "
        f"(lr {args.lr}), QAT and the fp control fine-tuned {args.qat_steps} steps (lr {args.qat_lr}) on the "
        "following batches. int4 = weights of every block Linear, one scale per 32 input features, symmetric "
        "(model.quant=int4); the tied embedding / LM head stays fp. Val loss over 256 val windows.\n\n"
        "| model | val loss |\n|---|---|\n"
        + "".join(f"| {k} | {v:.4f} |\n" for k, v in results.items())
        + f"\nRecovered fraction (PTQ - QAT) / (PTQ - fp), as the issue defines it: **{recovered:.0%}** (target: at "
        "least 50%). That definition credits QAT with the fine-tuning steps themselves; against the control "
        "(fp and PTQ after the same extra steps), (PTQ(control) - QAT) / (PTQ(control) - control) = "
        f"**{recovered_control:.0%}**. Wall time {time.time() - start:.0f} s.\n"
    )
    report(text, args.out)


if __name__ == "__main__":
    main()
