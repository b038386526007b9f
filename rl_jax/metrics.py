"""Run metrics: a JSONL log, a summary JSON and PNG plots, written by process 0 only."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray, jax.Array)):
        value = np.asarray(value).item() if np.ndim(value) == 0 else np.asarray(value).tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends one JSON object per line to ``workdir/metrics.jsonl`` (and keeps them in memory)."""

    def __init__(self, workdir: str | os.PathLike, filename: str = "metrics.jsonl"):
        self.enabled = jax.process_index() == 0
        self.path = Path(workdir) / filename
        self.records: list[dict[str, Any]] = []
        self._start = time.time()
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():  # a resumed run keeps its history
                with self.path.open() as f:
                    self.records = [json.loads(line) for line in f if line.strip()]

    def write(self, step: int, **values: Any) -> dict[str, Any]:
        record = {"step": int(step), "time": time.time(),
                  **{k: _plain(v) for k, v in values.items()}}
        self.records.append(record)
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of every record holding ``key``."""
        rows = [(r["step"], r[key]) for r in self.records
                if isinstance(r.get(key), (int, float))]
        if not rows:
            return np.zeros(0), np.zeros(0)
        steps, values = zip(*rows)
        return np.asarray(steps), np.asarray(values, dtype=float)


def write_json(path: str | os.PathLike, data: dict[str, Any]):
    if jax.process_index() != 0:
        return
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({k: _plain(v) for k, v in data.items()}, indent=2))
    os.replace(tmp, path)


def plot_curves(path: str | os.PathLike, panels: list[tuple[str, list[tuple[str, np.ndarray,
                np.ndarray]]]], *, title: str = "", xlabel: str = "step"):
    """One PNG with a panel per ``(ylabel, [(label, x, y), ...])``."""
    if jax.process_index() != 0:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for label, x, y in lines:
            if len(x):
                ax.plot(x, y, label=label, marker="." if len(x) < 30 else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if any(label for label, *_ in lines):
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
