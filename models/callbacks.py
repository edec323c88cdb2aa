"""Lightning callbacks: training throughput, MFU and peak memory."""

from __future__ import annotations

import pickle
import resource
import sys
import time

import lightning as L
import torch

# Dense (no sparsity) peak tensor-core FLOP/s per GPU, by a substring of torch.cuda.get_device_name(); the
# first match wins, so specific names come first. (bf16/fp16, tf32)
PEAK_FLOPS: list[tuple[str, float, float]] = [
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100", 989e12, 494.5e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989e12, 494.5e12),
    ("H200", 989e12, 494.5e12),
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L4", 121e12, 60e12),
    ("A10G", 70e12, 35e12),
]


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one device for ``precision`` (Lightning's precision string), or None if unknown."""
    half = any(p in str(precision) for p in ("16", "bf16"))
    for key, bf16, tf32 in PEAK_FLOPS:
        if key in device_name:
            if half:
                return bf16
            return tf32 if torch.backends.cuda.matmul.allow_tf32 else None
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocated CUDA memory on a GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class ThroughputMFU(L.Callback):
    """Logs ``perf/tokens_per_s`` (all devices together), ``perf/mfu`` (model FLOPs utilisation per device,
    from the model's FLOPs-per-token formula and the device's peak; only where the peak is known or given)
    and ``perf/peak_mem_gb`` every ``log_every_n_steps``. Validation time is excluded, and so are the first
    ``skip_steps`` steps from the run's average (``self.summary()``)."""

    def __init__(self, skip_steps: int = 5, peak_flops: float | None = None) -> None:
        self.skip_steps = skip_steps
        self.peak_flops_override = peak_flops
        self._reset()

    def _reset(self) -> None:
        self.window_tokens = 0
        self.window_time = 0.0
        self.total_tokens = 0
        self.total_time = 0.0
        self.steps = 0
        self._t0: float | None = None
        self.peak = None
        self.flops_per_token = 0.0
        self.last: dict[str, float] = {}
        self.world_size = 1

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def _stop(self, trainer) -> float:
        if self._t0 is None:
            return 0.0
        self._sync(trainer)
        dt = time.perf_counter() - self._t0
        self._t0 = None
        return dt

    def on_fit_start(self, trainer, pl_module) -> None:
        self._reset()
        dev = trainer.strategy.root_device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        self.peak = self.peak_flops_override or peak_flops(name, trainer.precision)
        self.flops_per_token = float(pl_module.model.flops_per_token())
        self.world_size = trainer.world_size

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._t0 is None:
            self._sync(trainer)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        tokens = batch[0].numel() * trainer.world_size
        self.steps += 1
        if self.steps <= self.skip_steps:  # warm-up (allocator, cudnn, compile): not in the average
            self._stop(trainer)
            return
        self.window_tokens += tokens
        every = max(1, trainer.log_every_n_steps)
        if (trainer.global_step % every == 0) or trainer.fast_dev_run:
            self._flush(trainer, pl_module)

    def _flush(self, trainer, pl_module) -> None:
        dt = self._stop(trainer) + self.window_time
        if self.window_tokens == 0 or dt <= 0:
            return
        self.total_tokens += self.window_tokens
        self.total_time += dt
        tps = self.window_tokens / dt
        self.last = {
            "perf/tokens_per_s": tps,
            "perf/peak_mem_gb": peak_memory_gb(trainer.strategy.root_device),
        }
        if self.peak:
            self.last["perf/mfu"] = tps / trainer.world_size * self.flops_per_token / self.peak
        pl_module.log_dict(self.last, on_step=True, rank_zero_only=True)
        self.window_tokens, self.window_time = 0, 0.0

    def on_validation_start(self, trainer, pl_module) -> None:  # pause the clock during validation
        if not trainer.sanity_checking:
            self.window_time += self._stop(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.window_tokens:
            self.total_tokens += self.window_tokens
            self.total_time += self._stop(trainer) + self.window_time
            self.window_tokens, self.window_time = 0, 0.0

    def summary(self, device: torch.device) -> dict[str, float]:
        tps = self.total_tokens / self.total_time if self.total_time > 0 else float("nan")
        mfu = tps / self.world_size * self.flops_per_token / self.peak if self.peak else float("nan")
        return {"tokens_per_s": tps, "mfu": mfu, "peak_mem_gb": peak_memory_gb(device)}


class InterruptCheckpoint(L.Callback):
    """Saves ``<dirpath>/<filename>.ckpt`` when training stops on an exception (Ctrl-C included), so that
    ``ckpt_path=`` can resume from it. (Lightning's OnExceptionCheckpoint would also make every later
    ``fit(ckpt_path=None)`` silently resume from "last", and deletes its file at a normal end.)"""

    def __init__(self, dirpath: str, filename: str = "interrupted") -> None:
        self.dirpath, self.filename = dirpath, filename

    @property
    def ckpt_path(self) -> str:
        return f"{self.dirpath}/{self.filename}.ckpt"

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, pickle.UnpicklingError):  # the checkpoint to resume from was refused: nothing ran
            return
        if trainer.state.fn == "fit" and not trainer.fast_dev_run:
            trainer.save_checkpoint(self.ckpt_path, weights_only=False)  # the full state (optimizer, loops, ...)
