"""Generate text from a checkpoint that train.py wrote (loaded weights-only, as resuming does).

    python -m models.sample ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt
    python -m models.sample ckpt_path=... prompt="In the beginning" tokens=500 temperature=0.9 top_k=40 num_samples=3

Options, key=value as for train.py: ``prompt``, ``tokens``, ``temperature``, ``top_k``, ``seed`` (each defaults to the
run's own ``sample`` settings), ``num_samples`` (1; sample i uses seed + i) and ``device`` (``auto``: the GPU if
there is one). The layers are the run's: a model trained with fused layers samples with them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

OPTIONS = dict(ckpt_path=None, prompt=None, tokens=None, temperature=None, top_k=None, seed=None, num_samples=1,
               device="auto")
USAGE = "usage: python -m models.sample ckpt_path=PATH [" + "] [".join(f"{k}=..." for k in list(OPTIONS)[1:]) + "]"


def parse(argv: list[str]) -> dict:
    """The options from ``key=value`` arguments; an unknown key or a missing ckpt_path raises SystemExit with the
    usage line."""
    given = OmegaConf.to_container(OmegaConf.from_dotlist(argv))
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise SystemExit(f"unknown option(s) {', '.join(unknown)}\n{USAGE}")
    options = {**OPTIONS, **given}
    if not options["ckpt_path"]:
        raise SystemExit(f"ckpt_path= is required (train.py writes logs/train/runs/<run>/checkpoints/)\n{USAGE}")
    if not Path(options["ckpt_path"]).is_file():
        raise SystemExit(f"ckpt_path={options['ckpt_path']}: no such file")
    return options


def sample(options: dict) -> list[str]:
    """``num_samples`` texts generated from the checkpoint with the given options."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: sleeping OpenMP threads on a busy small CPU
    import torch

    from models.lit import GPTLitModule

    device = options["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    module = GPTLitModule.load_from_checkpoint(options["ckpt_path"], map_location=device)
    settings = {k: options[k] for k in ("prompt", "tokens", "temperature", "top_k", "seed") if options[k] is not None}
    module.sample_cfg.update(settings)
    first_seed = int(module.sample_cfg["seed"])
    texts = []
    for i in range(int(options["num_samples"])):
        module.sample_cfg["seed"] = first_seed + i
        texts.append(module.generate_text())
    return texts


def main(argv: list[str] | None = None) -> None:
    texts = sample(parse(sys.argv[1:] if argv is None else argv))
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(text)


if __name__ == "__main__":
    main()
