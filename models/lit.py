"""LightningModule: the GPT (or a Hugging Face model, ``models.hf``, when the model config has ``arch``), AdamW
with weight-decay groups, warmup + cosine schedule, token-weighted loss metrics, perplexity, and a text sample
generated at the end of each validation.

Checkpoints load safely: with ``torch.load(weights_only=True)`` (``load_checkpoint``, ``GPTLitModule.
load_from_checkpoint``, and resuming through ``models.training``), which unpickles tensors and plain Python
values only. What our checkpoints hold is exactly that (Lightning's state, the model and optimizer state, the
hyper-parameters as plain containers, the tokenizer as its JSON string, RNG states as ByteTensors, the data
position as an int), so ``SAFE_GLOBALS`` is empty. A file holding anything else is refused before anything of
it is unpickled, with an ``UnsafeCheckpointError`` naming the offending globals and what to do.
"""

from __future__ import annotations

import inspect
import math
import os
import pickle
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

# Classes / functions our checkpoints may legitimately hold beyond torch's weights_only allowlist (tensors,
# OrderedDict, plain Python types): none (see the module docstring). Register one here only if it is data.
SAFE_GLOBALS: list = []
if SAFE_GLOBALS:
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holding objects other than tensors and plain Python values, refused by ``weights_only`` loading."""


def _refusal(path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refused to load checkpoint {path}: its pickle refers to {what} (not tensors or plain Python values). "
        "Checkpoints load with torch.load(weights_only=True), which does not unpickle arbitrary objects "
        "(unpickling can run code). If you trust this file and those objects are data, register their classes "
        "before loading with torch.serialization.add_safe_globals([...]) (or add them to models.lit.SAFE_GLOBALS); "
        "otherwise, only if you trust it, load it once with torch.load(path, weights_only=False) and save it again "
        "holding tensors and plain Python values only."
    )


def check_checkpoint_is_safe(path) -> None:
    """Raise ``UnsafeCheckpointError`` naming them if the checkpoint file ``path`` holds globals that ``weights_only``
    loading refuses. Reads the pickle only, not the tensors. Paths that are not local files (Lightning's "last",
    remote URLs, distributed-checkpoint folders) and torch without the scan are left to the load itself."""
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None or not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return
    try:
        unsafe = scan(path)
    except (ValueError, RuntimeError):  # not a torch.save zip file: the load says what is wrong with it
        return
    if unsafe:
        raise _refusal(path, ", ".join(sorted(unsafe)))


def load_checkpoint(path, map_location="cpu") -> dict:
    """One of our checkpoints as a dict, loaded with ``torch.load(weights_only=True)``; a file holding arbitrary
    objects raises ``UnsafeCheckpointError``."""
    check_checkpoint_is_safe(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as e:
        raise _refusal(path, "objects that the weights-only unpickler refuses") from e


def weights_only_kwargs(load_fn) -> dict:
    """``{"weights_only": True}`` if Lightning's ``load_fn`` (``Trainer.fit``, ``load_from_checkpoint``) takes it
    (Lightning >= 2.6), else ``{}``: older Lightning calls torch.load without it, which is weights_only from
    torch 2.6 on."""
    try:
        return {"weights_only": True} if "weights_only" in inspect.signature(load_fn).parameters else {}
    except (TypeError, ValueError):
        return {}


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
        if "arch" in model:  # a Hugging Face transformers model (configs/model/hf.yaml): the GPT's interface
            from models.hf import build

            self.model = build(model, vocab_size)
        else:
            self.model = GPT(GPTConfig.from_dict({**dict(model), "vocab_size": vocab_size}))
        self.tokenizer = tokenizer_from_json(tokenizer) if tokenizer else None
        self.train_loss = MeanMetric()  # over the current logging window, weighted by tokens
        self.val_loss = MeanMetric()  # over the val set, weighted by tokens
        self.batches_seen = 0  # training batches consumed: the data position (kept in checkpoints)
        self.last_train_loss = float("nan")
        self.val_history: list[tuple[int, float]] = []
        self.last_sample: str | None = None
        self._rng_to_restore = None

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's ``load_from_checkpoint``, loading with ``weights_only=True`` (pass ``weights_only=False`` to
        load a trusted file that holds other objects); a file holding arbitrary objects raises
        ``UnsafeCheckpointError``."""
        load = super().load_from_checkpoint
        if kwargs.get("weights_only", True):
            check_checkpoint_is_safe(checkpoint_path)
            kwargs = {**weights_only_kwargs(load), **kwargs}
        try:
            return load(checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs)
        except UnsafeCheckpointError:
            raise
        except pickle.UnpicklingError as e:
            raise _refusal(checkpoint_path, "objects that the weights-only unpickler refuses") from e

    # ------------------------------------------------------------------------------------------ steps
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(idx, targets)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, *packed = batch  # data.pack=true adds the documents' cumulative lengths
        loss = self.model(x, y, cu_seqlens=packed[0]) if packed else self.model(x, y)
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
