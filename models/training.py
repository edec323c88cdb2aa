"""The training run behind ``train.py``: builds data, model, callbacks, loggers and trainer from the Hydra
config, fits, validates at the end, writes ``summary.json`` into the run's output folder and prints the
summary (val loss, perplexity, tokens/s, checkpoint path, a text sample)."""

from __future__ import annotations

import json
import logging
import math
import pickle
import signal
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from models.callbacks import InterruptCheckpoint, ThroughputMFU
from models.layers import REGISTRIES
from models.lit import GPTLitModule, UnsafeCheckpointError, _refusal, check_checkpoint_is_safe, weights_only_kwargs

log = logging.getLogger("train")


def _lightning_console_once() -> None:
    """In a Hydra job, Lightning's log lines go through the root logger's handlers only: Hydra's console (once) and
    the run's log file. ``import lightning`` gives the "lightning" logger a console handler of its own while its
    records still reach the root logger, so every line was printed twice. Its advert for a cloud logger, printed by
    every ``Trainer``, is dropped, and so is a deprecation warning that Lightning's own code triggers on torch >= 2.10
    (nothing a user of this script can act on)."""
    if not HydraConfig.initialized():  # a test or a notebook: Lightning's own handler is the console
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _no_cloud_tip not in rank_zero.filters:
        rank_zero.addFilter(_no_cloud_tip)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def _no_cloud_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def validate_choices(cfg: DictConfig) -> None:
    """Fail at startup, with the valid names, on an unknown layer choice (an HF model: also on invalid sizes)."""
    if "arch" in cfg.model:  # a Hugging Face model (models/hf.py): its own choices
        from models.hf import HFConfig

        HFConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        return
    for key, registry in REGISTRIES.items():
        registry.check(cfg.model.get(key))


def _instantiate_dict(section: DictConfig | None) -> list:
    if not section:
        return []
    return [instantiate(c) for c in section.values() if isinstance(c, DictConfig) and "_target_" in c]


def _in_multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


def _overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def _write_json(path: Path, data: dict) -> None:
    if rank_zero_only.rank != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_json_default))
    tmp.replace(path)


def _json_default(x: Any):
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def train(cfg: DictConfig) -> dict:
    """Run one training job; returns the summary dict (also written to ``<output_dir>/summary.json``).

    In a multirun (sweep) with ``continue_on_error``, an exception is recorded in the summary as
    ``status: failed`` and the sweep goes on; otherwise it propagates.
    """
    out = Path(cfg.paths.output_dir)
    summary: dict[str, Any] = {"status": "running", "overrides": _overrides(), "output_dir": str(out)}
    _write_json(out / "summary.json", summary)
    t0 = time.perf_counter()
    try:
        _train(cfg, summary, t0)
    except Exception as e:
        summary.update(
            status="failed", error=f"{type(e).__name__}: {e}", wall_time_s=time.perf_counter() - t0
        )
        _write_json(out / "summary.json", summary)
        if not (_in_multirun() and cfg.get("continue_on_error", False)):
            raise
        log.error("job failed (the sweep goes on):\n%s", traceback.format_exc())
    return summary


@contextmanager
def _stop_on_ctrl_c(trainer: L.Trainer):
    """The first Ctrl-C asks Lightning to stop after the current step (``trainer.should_stop``); a second one
    interrupts at once, as Python's default handler does. A KeyboardInterrupt raised wherever the main thread happens
    to be (a data loader's iterator, a checkpoint write) once left a run hanging in CI; a flag leaves the stop to
    the training loop. Yields {"pressed": bool}. Outside the main thread (no signals there) it changes nothing."""
    state = {"pressed": False}
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_ctrl_c(signum, frame):
        if state["pressed"]:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        state["pressed"] = True
        trainer.should_stop = True
        log.warning("Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)")

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


def _train(cfg: DictConfig, summary: dict, t0: float) -> None:
    out = Path(cfg.paths.output_dir)
    validate_choices(cfg)
    _lightning_console_once()
    if cfg.get("matmul_precision"):
        torch.set_float32_matmul_precision(cfg.matmul_precision)
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup()
    baseline = dm.unigram_baseline()
    module = GPTLitModule(
        model=OmegaConf.to_container(cfg.model, resolve=True),
        vocab_size=dm.vocab_size,
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        sample=OmegaConf.to_container(cfg.sample, resolve=True),
        tokenizer=dm.tokenizer.to_json(),
    )
    if dm.pack is True and not getattr(module.model, "supports_packing", lambda: False)():
        raise ValueError("data.pack=true trains on packed documents through fl.varlen_attention: it needs the GPT "
                         f"with model.attention=custom (got model.attention={cfg.model.get('attention')!r}"
                         f"{', an HF model' if 'arch' in cfg.model else ''})")
    if cfg.get("compile"):
        module.model.compile()  # in place: parameter names (and checkpoints) stay as without compile

    callbacks = _instantiate_dict(cfg.get("callbacks"))
    loggers = _instantiate_dict(cfg.get("logger"))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    n_params = sum(p.numel() for p in module.model.parameters())
    summary.update(
        n_params=n_params,
        unigram_baseline=baseline,
        vocab_size=dm.vocab_size,
        train_tokens=len(dm.train_tokens),
        val_tokens=len(dm.val_tokens),
    )
    log.info(
        "model: %.2fM parameters, vocab %d; data: %d train / %d val tokens; unigram baseline %.4f",
        n_params / 1e6,
        dm.vocab_size,
        len(dm.train_tokens),
        len(dm.val_tokens),
        baseline,
    )

    interrupted = False
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path:
        check_checkpoint_is_safe(ckpt_path)  # refused before training starts, naming what it holds
    on_exc = next((c for c in callbacks if isinstance(c, InterruptCheckpoint)), None)
    try:
        with _stop_on_ctrl_c(trainer) as ctrl_c, warnings.catch_warnings():
            # A run that stops before its first validation (max_steps or max_time inside the first epoch) has
            # ModelCheckpoint warn that val/loss is missing: the final validation and last.ckpt come below. (A monitor
            # missing after a validation ran still raises, in Lightning.)
            warnings.filterwarnings("ignore", message=r"`ModelCheckpoint\(monitor='val/loss'\)` could not find")
            # torch.load(weights_only=True): tensors and plain values only (see models.lit)
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, **weights_only_kwargs(trainer.fit))
        # any rank's Ctrl-C stopped every rank after the step it was in (Lightning syncs should_stop); all ranks save
        # the full state together, for ckpt_path= to resume
        if trainer.strategy.reduce_boolean_decision(ctrl_c["pressed"], all=False):
            interrupted = True
            if on_exc is not None and not trainer.fast_dev_run:
                trainer.save_checkpoint(on_exc.ckpt_path, weights_only=False)
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as e:  # what the scan could not see (torch without it, a remote file)
        raise _refusal(ckpt_path, "objects that the weights-only unpickler refuses") from e
    except SystemExit:  # a second Ctrl-C: Lightning's sys.exit(1) after saving the on-exception checkpoint
        if trainer.state.status.value != "interrupted":
            raise
        interrupted = True
    interrupted = interrupted or trainer.interrupted

    perf = next((c for c in callbacks if isinstance(c, ThroughputMFU)), None)
    ckpt = next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None)
    last_val_step = module.val_history[-1][0] if module.val_history else None
    if not interrupted and not trainer.fast_dev_run and last_val_step != trainer.global_step:
        # stopped between validations (max_time, or max_steps not a multiple of data.batches_per_epoch):
        # the final weights get a val loss, and last.ckpt the final state
        trainer.validate(module, datamodule=dm, verbose=False)
        if (
            ckpt is not None
            and ckpt.save_last
            and getattr(ckpt, "_last_global_step_saved", None) != trainer.global_step
        ):
            ckpt.last_model_path = str(
                Path(ckpt.dirpath) / f"{ckpt.CHECKPOINT_NAME_LAST}{ckpt.FILE_EXTENSION}"
            )
            trainer.save_checkpoint(ckpt.last_model_path, weights_only=False)  # the full state, as ModelCheckpoint

    val_loss = module.val_history[-1][1] if module.val_history else float("nan")
    checkpoint = None
    if interrupted and on_exc is not None and Path(on_exc.ckpt_path).exists():
        checkpoint = on_exc.ckpt_path
    elif ckpt is not None:
        checkpoint = ckpt.last_model_path or ckpt.best_model_path or None
    max_steps = int(trainer.max_steps or -1)
    if not interrupted and not trainer.fast_dev_run and 0 < trainer.global_step < max_steps:
        summary["note"] = (
            f"stopped by trainer.max_time={cfg.trainer.get('max_time')} before "
            f"trainer.max_steps={max_steps} (a slow or busy machine)"
        )
    summary.update(
        status="interrupted" if interrupted else "completed",
        steps=int(trainer.global_step),
        train_loss=_finite(module.last_train_loss),
        val_loss=_finite(val_loss),
        best_val_loss=min((v for _, v in module.val_history), default=None),
        perplexity=_finite(math.exp(val_loss)) if math.isfinite(val_loss) else None,
        val_history=module.val_history,
        checkpoint=checkpoint,
        best_checkpoint=(ckpt.best_model_path or None) if ckpt is not None else None,
        sample=module.last_sample,
        wall_time_s=time.perf_counter() - t0,
        device=torch.cuda.get_device_name() if trainer.strategy.root_device.type == "cuda" else "cpu",
        precision=str(trainer.precision),
        world_size=trainer.world_size,
    )
    if perf is not None:
        summary.update({k: _finite(v) for k, v in perf.summary(trainer.strategy.root_device).items()})
    metric = cfg.get("optimized_metric")
    if metric and metric in trainer.callback_metrics:
        summary["optimized_metric"] = float(trainer.callback_metrics[metric])
    _write_json(out / "summary.json", summary)
    print_summary(summary)
    if interrupted:
        raise SystemExit(130)


def _fmt(x, spec: str = ".4f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


@rank_zero_only
def print_summary(s: dict) -> None:
    lines = [
        "",
        f"==== {s['status']} after {s.get('steps', 0)} steps in {s.get('wall_time_s', 0):.1f} s ====",
        *([f"note             : {s['note']}"] if s.get("note") else []),
        f"unigram baseline : {_fmt(s.get('unigram_baseline'))} nats/token",
        f"train loss       : {_fmt(s.get('train_loss'))}",
        f"val loss         : {_fmt(s.get('val_loss'))}  (best {_fmt(s.get('best_val_loss'))})",
        f"perplexity       : {_fmt(s.get('perplexity'), '.3f')}",
        f"tokens/s         : {_fmt(s.get('tokens_per_s'), ',.0f')}",
        f"MFU              : {_fmt(s.get('mfu'), '.1%')}",
        f"peak memory      : {_fmt(s.get('peak_mem_gb'), '.2f', ' GB')}",
        f"checkpoint       : {s.get('checkpoint') or 'none'}",
    ]
    if s["status"] == "interrupted" and s.get("checkpoint"):
        lines.append(
            f"resume with      : python train.py {' '.join(s.get('overrides', []))} "
            f"ckpt_path={s['checkpoint']}"
        )
    if s.get("sample"):
        lines += ["sample:", "-" * 60, s["sample"], "-" * 60]
        if s.get("checkpoint"):
            lines.append(f"more samples     : python -m models.sample ckpt_path={s['checkpoint']} num_samples=3")
    print("\n".join(lines), flush=True)
