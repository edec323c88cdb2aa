"""LightningModule: the GPT, AdamW with weight-decay groups, warmup + cosine schedule, token-weighted loss
metrics, perplexity, and a text sample generated at the end of each validation."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
from torchmetrics import MeanMetric

from models.data import tokenizer_from_json
from models.gpt import GPT, GPTConfig

OPTIM_DEFAULTS = dict(
    lr=1e-3,
    min_lr_ratio=0.1,
    warmup_steps=100,
    decay_steps=None,
    weight_decay=0.1,
    betas=(0.9, 0.99),
    eps=1e-8,
    fused=None,
)
SAMPLE_DEFAULTS = dict(prompt="\n", tokens=200, temperature=0.8, top_k=None, seed=0)


def lr_lambda(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``decay_steps``, flat after."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - min_lr_ratio)


class GPTLitModule(L.LightningModule):
    def __init__(
        self,
        model: dict,
        vocab_size: int,
        optim: dict | None = None,
        sample: dict | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        unknown = set(optim or {}) - set(OPTIM_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown optim keys {sorted(unknown)}; valid keys: {', '.join(OPTIM_DEFAULTS)}")
        self.optim = {**OPTIM_DEFAULTS, **(optim or {})}
        self.sample_cfg = {**SAMPLE_DEFAULTS, **(sample or {})}
        self.model = GPT(GPTConfig.from_dict({**dict(model), "vocab_size": vocab_size}))
        self.tokenizer = tokenizer_from_json(tokenizer) if tokenizer else None
        self.train_loss = MeanMetric()  # over the current logging window, weighted by tokens
        self.val_loss = MeanMetric()  # over the val set, weighted by tokens
        self.batches_seen = 0  # training batches consumed: the data position (kept in checkpoints)
        self.last_train_loss = float("nan")
        self.val_history: list[tuple[int, float]] = []
        self.last_sample: str | None = None
        self._rng_to_restore = None

    # ------------------------------------------------------------------------------------------ steps
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(idx, targets)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.train_loss.update(loss.detach(), (y != -100).sum())
        if (self.global_step + 1) % max(1, self.trainer.log_every_n_steps) == 0 or self.trainer.fast_dev_run:
            self.last_train_loss = float(self.train_loss.compute())
            self.train_loss.reset()
            self.log("train/loss", self.last_train_loss, on_step=True, prog_bar=True, rank_zero_only=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._rng_to_restore is not None:  # resumed: continue the RNG stream (dropout) exactly
            _set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.batches_seen += 1

    def on_train_end(self) -> None:
        if self.train_loss.update_count:  # steps since the last log: the final train loss covers them
            self.last_train_loss = float(self.train_loss.compute())
            self.train_loss.reset()

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.val_loss.update(self.model(x, y), (y != -100).sum())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        if self.trainer.sanity_checking:
            return
        self.val_history.append((int(self.global_step), float(loss)))
        best = min(v for _, v in self.val_history)  # over the whole run, resumes included
        self.log_dict(
            {"val/loss": loss, "val/ppl": torch.exp(loss), "val/loss_best": best},
            prog_bar=True,
            sync_dist=True,
        )
        # a sharded (FSDP) model gathers its weights in forward, a collective: then every rank generates
        if self.sample_cfg["tokens"] and self.tokenizer is not None:
            if self.trainer.is_global_zero or _is_sharded(self.model):
                sample = self.generate_text()
                if self.trainer.is_global_zero:
                    self.last_sample = sample
                    self._log_sample(sample)

    # -------------------------------------------------------------------------------------- sharding
    def configure_model(self) -> None:
        """Under ``trainer=fsdp`` (``models.strategies.FSDP2Strategy``, or any Lightning
        ``ModelParallelStrategy`` with ``tensor_parallel_size=1``): shard the GPT with FSDP2 over the
        data-parallel mesh (``GPT.shard``). Other strategies: nothing. Idempotent (Lightning calls it again
        for a ``validate`` after ``fit``)."""
        try:
            from lightning.pytorch.strategies import ModelParallelStrategy
        except ImportError:  # lightning < 2.4: no FSDP2 strategy, nothing to shard for
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, ModelParallelStrategy) or _is_sharded(self.model):
            return
        mesh = strategy.device_mesh
        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(
                "the GPT has no tensor-parallel plan: use tensor_parallel_size=1 (trainer=fsdp does), got "
                f"{mesh['tensor_parallel'].size()}"
            )
        self.model.shard(mesh["data_parallel"])

    # ------------------------------------------------------------------------------------------- sample
    def generate_text(self, prompt: str | None = None, tokens: int | None = None) -> str:
        cfg = self.sample_cfg
        prompt = cfg["prompt"] if prompt is None else prompt
        ids = self.tokenizer.encode(prompt) or [0]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(int(cfg["seed"]))
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(idx, tokens or cfg["tokens"], cfg["temperature"], cfg["top_k"], gen)
        finally:
            self.model.train(was_training)
        return self.tokenizer.decode(out[0].tolist())

    def _log_sample(self, text: str) -> None:
        if self.trainer.global_rank != 0:
            return
        for logger in self.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):  # TensorBoard
                experiment.add_text("sample", f"```\n{text}\n```", self.global_step)
            if getattr(logger, "log_dir", None):
                path = Path(logger.log_dir) / "samples.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a", encoding="utf-8") as f:
                    f.write(f"=== step {self.global_step}\n{text}\n")

    # --------------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self):
        o = self.optim
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": o["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        fused = o["fused"]
        if fused is None:  # fused AdamW on CUDA, except where Lightning refuses it: mixed precision + clipping
            clipping = bool(self.trainer.gradient_clip_val) if self._trainer is not None else False
            mixed = self._trainer is not None and "mixed" in str(self.trainer.precision)
            fused = all(p.is_cuda for p in decay + no_decay) and not (clipping and mixed)
        opt = torch.optim.AdamW(
            groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=fused or None
        )
        decay_steps = o["decay_steps"] or self._total_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, o["warmup_steps"], decay_steps, o["min_lr_ratio"])
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def _total_steps(self) -> int:
        if self.trainer.max_steps and self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        steps = self.trainer.estimated_stepping_batches
        return int(steps) if math.isfinite(steps) else 10_000

    # -------------------------------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["batches_seen"] = self.batches_seen
        checkpoint["val_history"] = list(self.val_history)
        checkpoint["rng_state"] = _get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.batches_seen = int(checkpoint.get("batches_seen", 0))
        self.val_history = [tuple(x) for x in checkpoint.get("val_history", [])]
        self._rng_to_restore = checkpoint.get("rng_state")


def _is_sharded(module: torch.nn.Module) -> bool:
    """True when ``module`` has been sharded with FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:  # torch < 2.6
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:  # a torch without torch.distributed
            return False
    return isinstance(module, FSDPModule)


def _get_rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
