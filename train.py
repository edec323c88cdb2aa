"""Train a small GPT with pluggable (stock or fused) layers.

    python train.py                                   # tiny model, built-in corpus, CPU, a few minutes
    python train.py model.attention=sdpa model.loss=custom
    python train.py model=gpt-small trainer=gpu
    python train.py experiment=shakespeare_char data.path=/path/to/tinyshakespeare.txt
    python train.py -m model.attention=stock,sdpa     # sweep; comparison table + plot in the sweep folder
    python train.py ckpt_path=logs/train/runs/.../checkpoints/last.ckpt   # resume exactly

See configs/ and docs/training.md for all options. Needs the app's packages: pip install -e ".[train]".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("FUSEDLAYERS_ROOT", str(ROOT))
# OpenMP threads that sleep rather than spin at barriers: on a busy 2-core machine spinning threads make the
# CPU run several times slower (measured here 1.5 s vs 0.7 s per step of the default model)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import hydra
    import lightning  # noqa: F401
    from omegaconf import DictConfig
except ImportError as error:  # the library installs without the app's packages
    sys.exit(f"train.py needs the training app's packages ({error}); from the repository: pip install -e \".[train]\"")


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from models.training import train

    summary = train(cfg)
    return summary.get("optimized_metric", float("nan"))  # what the Optuna sweeper minimises


if __name__ == "__main__":
    main()
