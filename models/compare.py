"""Compare the jobs of a sweep: a table (CSV and Markdown) and a plot of the val-loss curves.

    python -m models.compare SWEEP_DIR

Reads each job folder's ``summary.json`` (written by ``train.py``) and, where that is missing or the job
did not finish, the CSV logger's ``metrics.csv``; failed and unfinished jobs get a row with their status.
Writes ``comparison.csv``, ``comparison.md`` and ``val_loss.png`` into SWEEP_DIR. ``SweepCompare`` runs this
at the end of every ``python train.py -m ...`` (configs/hydra/default.yaml).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)

COLUMNS = [
    "job",
    "status",
    "overrides",
    "steps",
    "train_loss",
    "val_loss",
    "best_val_loss",
    "perplexity",
    "tokens_per_s",
    "mfu",
    "peak_mem_gb",
    "wall_time_s",
]


def _float(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _read_overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    try:
        from omegaconf import OmegaConf

        return [str(o) for o in OmegaConf.load(path)]
    except Exception:  # a half-written file from a killed job
        return []


def _read_metrics_csv(job: Path) -> dict[str, Any]:
    """Partial results from the CSV logger: the val-loss curve, the last train/val loss and the last step."""
    out: dict[str, Any] = {"val_history": []}
    for path in sorted(job.glob("csv/**/metrics.csv")):
        try:
            with path.open(newline="") as f:
                for row in csv.DictReader(f):
                    step = _float(row.get("step"))
                    if step is not None:
                        out["steps"] = max(int(step), out.get("steps", 0))
                    if (v := _float(row.get("val/loss"))) is not None and step is not None:
                        out["val_history"].append((int(step), v))
                        out["val_loss"] = v
                    if (t := _float(row.get("train/loss"))) is not None:
                        out["train_loss"] = t
                    if (p := _float(row.get("perf/tokens_per_s"))) is not None:
                        out["tokens_per_s"] = p
        except (OSError, csv.Error):
            continue
    return out


def read_job(job: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"job": job.name, "overrides": _read_overrides(job)}
    summary: dict[str, Any] = {}
    path = job / "summary.json"
    if path.exists():
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            summary = {}
    partial = _read_metrics_csv(job)
    status = summary.get("status")
    if status in (None, "running"):  # the process died before it could say how it ended
        status = "unfinished"
    row["status"] = status
    if summary.get("overrides"):
        row["overrides"] = summary["overrides"]
    for key in COLUMNS[3:]:
        row[key] = summary.get(key, partial.get(key))
    if row["best_val_loss"] is None and partial["val_history"]:
        row["best_val_loss"] = min(v for _, v in partial["val_history"])
    if row["perplexity"] is None and _float(row["val_loss"]) is not None:
        row["perplexity"] = math.exp(row["val_loss"])
    row["val_history"] = [tuple(x) for x in (summary.get("val_history") or partial["val_history"])]
    if summary.get("error"):
        row["error"] = summary["error"]
    return row


def find_jobs(sweep_dir: Path) -> list[Path]:
    jobs = [
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and ((p / ".hydra").is_dir() or (p / "summary.json").exists())
    ]
    return sorted(jobs, key=lambda p: (0, int(p.name)) if p.name.isdigit() else (1, p.name))


def _varying(rows: list[dict]) -> list[list[str]]:
    """Each job's overrides minus those that all jobs share (the label of its curve)."""
    sets = [set(r["overrides"]) for r in rows]
    common = set.intersection(*sets) if sets else set()
    return [[o for o in r["overrides"] if o not in common] for r in rows]


def _cell(x: Any, key: str) -> str:
    if x is None:
        return "-" if key != "overrides" else ""
    if key == "overrides":
        return " ".join(x)
    if isinstance(x, float):
        if key == "mfu":
            return f"{x:.1%}"
        if key == "tokens_per_s":
            return f"{x:,.0f}"
        if key == "wall_time_s":
            return f"{x:.1f}"
        return f"{x:.4f}"
    return str(x)


def write_outputs(sweep_dir: Path, rows: list[dict]) -> dict[str, Path]:
    paths = {
        "csv": sweep_dir / "comparison.csv",
        "md": sweep_dir / "comparison.md",
        "png": sweep_dir / "val_loss.png",
    }
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + ["error"])
        for r in rows:
            w.writerow(
                [
                    (" ".join(r["overrides"]) if k == "overrides" else ("" if r.get(k) is None else r[k]))
                    for k in COLUMNS
                ]
                + [r.get("error", "")]
            )
    common = [o for o in rows[0]["overrides"] if all(o in r["overrides"] for r in rows)] if rows else []
    md = [f"# Sweep comparison: {sweep_dir}", ""]
    if common and len(rows) > 1:
        md += [f"Overrides of every job: `{' '.join(common)}`; the table shows the others.", ""]
    md += ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r, own in zip(rows, _varying(rows) if len(rows) > 1 else [r["overrides"] for r in rows], strict=True):
        cells = [_cell(own if k == "overrides" else r.get(k), k).replace("|", "\\|") for k in COLUMNS]
        md.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["status"] != "completed"]
    if failed:
        md += ["", "Not completed:"]
        md += [
            f"- job {r['job']}: {r['status']}" + (f" ({r['error']})" if r.get("error") else "")
            for r in failed
        ]
    paths["md"].write_text("\n".join(md) + "\n")
    if not _plot(paths["png"], rows):
        paths.pop("png")
    return paths


def make_figure(rows: list[dict]):
    """A matplotlib figure of each job's val-loss curve (jobs without val points get a legend entry only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r, label in zip(rows, _varying(rows), strict=True):
        name = f"{r['job']}: {' '.join(label) or 'baseline'}"
        if r["status"] != "completed":
            name += f" [{r['status']}]"
        pts = sorted(r["val_history"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        else:
            ax.plot([], [], label=name + " (no val points)")
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("Validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot(path: Path, rows: list[dict]) -> bool:
    try:
        import matplotlib.pyplot as plt

        fig = make_figure(rows)
    except ImportError:
        log.warning("matplotlib is not installed: no val-loss plot")
        return False
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def compare(sweep_dir: str | Path) -> tuple[list[dict], dict[str, Path]]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no such sweep folder: {sweep_dir}")
    rows = [read_job(j) for j in find_jobs(sweep_dir)]
    return rows, write_outputs(sweep_dir, rows)


class SweepCompare(Callback):
    """Hydra callback: writes the comparison at the end of a multirun, and fails the sweep (after writing
    it) when a job did not complete."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows, paths = compare(sweep_dir)
        print(paths["md"].read_text(), flush=True)
        print("comparison written to: " + ", ".join(str(p) for p in paths.values()), flush=True)
        bad = [r["job"] for r in rows if r["status"] != "completed"]
        if bad:
            raise RuntimeError(
                f"{len(bad)} of {len(rows)} sweep jobs did not complete (jobs {', '.join(bad)}); "
                f"see {paths['md']}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", help="a multirun folder (holds one numbered folder per job)")
    args = ap.parse_args(argv)
    rows, paths = compare(args.sweep_dir)
    if not rows:
        print(f"no jobs found in {args.sweep_dir}", file=sys.stderr)
        return 1
    print(paths["md"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
