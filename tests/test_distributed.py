"""The distributed path on CPU: ``python train.py trainer=ddp|fsdp trainer.accelerator=cpu trainer.devices=2``
(2 processes, gloo) with the fused layers, against one process with the same global batch.

- the per-step train loss and the val losses of the 2-process run equal the 1-process run's (float32, tight);
- its checkpoint (DDP: rank 0's weights; FSDP: the full state gathered on rank 0) loads strictly into a
  1-process model whose weights are the 1-process run's, and resumes on 1 process exactly as the 1-process
  run's own checkpoint does (optimizer state included).

The optimizer settings make a broken path visible: no warmup and a large lr, so the weights move in 6 steps;
AdamW's eps well above most gradients, so the update depends on the gradient's scale (plain Adam is
scale-invariant and would hide gradients summed instead of averaged); gradient clipping at 1.0 is active in
the first 3 steps (a rank clipping by its shard's norm would show) and not in the last 3 (where a doubled
gradient would be clipped and show).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from models.lit import GPTLitModule, load_checkpoint
from models.training import train

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "configs")
WORLD = 2
BATCH = 4  # per process; the 1-process reference uses WORLD * BATCH
STEPS = 6  # validation after steps 3 and 6
FUSED = ["model.softmax=custom", "model.loss=fused_linear", "model.attention=custom", "model.checkpoint=selective"]
COMMON = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batches_per_epoch=3",
    "data.max_val_windows=8",  # 4 per rank: every window once
    "sample.tokens=8",
    "trainer.log_every_n_steps=1",
    "~callbacks.progress_bar",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    f"trainer.max_steps={STEPS}",
    "trainer.gradient_clip_val=1.0",  # gradient norms ~2.3, 1.3, 1.2, then 0.9, 0.7, 0.7: clipped, then not
    "optim.warmup_steps=0",
    "optim.lr=0.02",
    "optim.eps=0.01",  # > most |grad| (~1e-3): updates scale with the gradient
    *FUSED,
]
RTOL = 1e-5  # float32; the runs differ only in summation order (seen: ~2e-7)
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "FUSEDLAYERS_ROOT")


def _cfg(out: Path, cache: str, *overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*COMMON, f"paths.cache_dir={cache}", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return cfg


def _train_losses(run: Path) -> list[float]:
    with (run / "csv" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    return [float(r["train/loss"]) for r in sorted(rows, key=lambda r: int(r["step"]))]


def _state(path: Path) -> dict:
    return load_checkpoint(path)  # torch.load(weights_only=True): a 2-process checkpoint holds nothing else either


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, global batch WORLD * BATCH (in this process: also fills the token cache), then resumed
    from its last checkpoint for 2 more steps."""
    tmp = tmp_path_factory.mktemp("one_process")
    cache = str(tmp / "cache")
    run = tmp / "run"
    s = train(_cfg(run, cache, f"data.batch_size={WORLD * BATCH}"))
    assert s["status"] == "completed" and s["steps"] == STEPS and s["world_size"] == 1
    resumed = train(
        _cfg(tmp / "resumed", cache, f"data.batch_size={WORLD * BATCH}", f"trainer.max_steps={STEPS + 2}",
             f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    )  # fmt: skip
    return {"cache": cache, "run": run, "summary": s, "resumed": resumed, "tmp": tmp}


def _run_two_processes(strategy: str, out: Path, cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *COMMON,
        f"trainer={strategy}",
        "trainer.accelerator=cpu",
        f"trainer.devices={WORLD}",
        "trainer.precision=32-true",
        f"data.batch_size={BATCH}",
        f"paths.cache_dir={cache}",
        f"hydra.run.dir={out}",
    ]
    res = subprocess.run(
        cmd, cwd=out.parent, env=dict(env, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_process_and_checkpoint_loads_on_one(strategy, reference, tmp_path) -> None:
    ref_run, ref = reference["run"], reference["summary"]
    out = tmp_path / strategy
    s = _run_two_processes(strategy, out, reference["cache"])
    assert s["status"] == "completed" and s["steps"] == STEPS and s["world_size"] == WORLD

    # the same global batches, averaged gradients, the same clipping and steps: the same losses
    ref_losses, losses = _train_losses(ref_run), _train_losses(out)
    assert len(ref_losses) == len(losses) == STEPS
    assert ref_losses[0] - ref_losses[-1] > 0.15  # the weights really moved
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert [st for st, _ in s["val_history"]] == [st for st, _ in ref["val_history"]] == [3, 6]
    torch.testing.assert_close(
        torch.tensor([v for _, v in s["val_history"]]), torch.tensor([v for _, v in ref["val_history"]]),
        rtol=RTOL, atol=0,
    )  # fmt: skip

    # the checkpoint is one file with the full weights, under the 1-process names and shapes
    ckpt = out / "checkpoints" / "last.ckpt"
    assert s["checkpoint"] == str(ckpt) and ckpt.is_file()
    a, b = _state(ckpt), _state(ref_run / "checkpoints" / "last.ckpt")
    assert a["global_step"] == STEPS and a["batches_seen"] == STEPS
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k, v in b["state_dict"].items():
        assert type(a["state_dict"][k]) is torch.Tensor and a["state_dict"][k].shape == v.shape, k
        torch.testing.assert_close(a["state_dict"][k], v, rtol=1e-4, atol=1e-6, msg=k)
    # ... and loads strictly into a 1-process model that computes what the 1-process model computes
    model = GPTLitModule.load_from_checkpoint(ckpt, map_location="cpu").eval()
    ref_model = GPTLitModule.load_from_checkpoint(ref_run / "checkpoints" / "last.ckpt", map_location="cpu").eval()
    idx = torch.randint(0, model.hparams.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx, idx), ref_model(idx, idx), rtol=RTOL, atol=0)

    # resuming on 1 process (optimizer state, step, data position) continues as the 1-process run does
    r = train(
        _cfg(tmp_path / "resumed", reference["cache"], f"data.batch_size={WORLD * BATCH}",
             f"trainer.max_steps={STEPS + 2}", f"ckpt_path={ckpt}")
    )  # fmt: skip
    assert r["status"] == "completed" and r["steps"] == STEPS + 2 and r["world_size"] == 1
    torch.testing.assert_close(
        torch.tensor(_train_losses(tmp_path / "resumed")), torch.tensor(_train_losses(reference["tmp"] / "resumed")),
        rtol=RTOL, atol=0,
    )  # fmt: skip
    torch.testing.assert_close(r["val_loss"], reference["resumed"]["val_loss"], rtol=RTOL, atol=0)


def test_configs_compose() -> None:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        ddp = compose(config_name="train", overrides=["model=gpt-small", "trainer=ddp"])
        fsdp = compose(config_name="train", overrides=["model=gpt-small", "trainer=fsdp", *FUSED])
    assert ddp.trainer.strategy == "ddp" and ddp.trainer.devices == -1 and ddp.trainer.precision == "bf16-mixed"
    assert fsdp.trainer.strategy._target_ == "models.strategies.FSDP2Strategy"
    assert fsdp.trainer.strategy.save_distributed_checkpoint is False  # one file, loads on one device
    assert fsdp.trainer.devices == -1 and fsdp.trainer.precision == "bf16-mixed"
