"""Callbacks: ``LoggingCallback`` (console lines, a progress bar, TensorBoard events, a JSONL
log and a loss-curve PNG) and ``MoeMonitorCallback`` (expert load per MoE layer: console,
TensorBoard, and a heat map PNG), all on rank 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._trainer import Callback
from .errors import ConfigError, check_instance

__all__ = ["Callback", "LoggingCallback", "MoeMonitorCallback"]


def _check_args(fn: str, log_freq, tensorboard, plot) -> None:
    check_instance(log_freq, int, "log_freq", fn, "give the steps between log lines")
    if log_freq < 1:
        raise ConfigError(f"{fn}: log_freq={log_freq}: must be at least 1")
    check_instance(tensorboard, bool, "tensorboard", fn, "give True or False")
    check_instance(plot, bool, "plot", fn, "give True or False")


class LoggingCallback(Callback):
    """Loss, gradient norm, LR, tokens/s, MFU and memory every ``log_freq`` steps; a tqdm bar
    when stderr is a terminal (in a log file, only the plain lines, as torchtitan writes);
    TensorBoard events under ``<dump>/tb`` (when ``tensorboard``); ``<dump>/metrics.jsonl``;
    ``<dump>/loss.png`` at the end (when ``plot``)."""

    def __init__(self, *, log_freq: int = 10, tensorboard: bool = True, plot: bool = True):
        _check_args(type(self).__name__, log_freq, tensorboard, plot)
        self.log_freq, self.tensorboard, self.plot = log_freq, tensorboard, plot
        self.bar = self.writer = self.jsonl = None
        self.paths: dict[str, Path] = {}

    def on_train_begin(self, trainer) -> None:
        if trainer.rank != 0:
            return
        dump = Path(trainer.config.job.dump_folder)
        dump.mkdir(parents=True, exist_ok=True)
        self.paths["metrics"] = dump / "metrics.jsonl"
        self.jsonl = open(self.paths["metrics"], "a" if trainer.step else "w")  # resumed: append
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.paths["tensorboard"] = dump / "tb"
                self.writer = SummaryWriter(str(self.paths["tensorboard"]))
            except ImportError:  # pragma: no cover - tensorboard is a dependency
                self.writer = None
        if sys.stderr.isatty():  # a log file would fill with the bar's carriage returns
            from tqdm.auto import tqdm

            steps = trainer.config.training.steps
            self.bar = tqdm(total=steps, initial=trainer.step, desc="train", unit="step")

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if trainer.rank != 0:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, step)
        if step % self.log_freq == 0 or step == 1:
            mfu = "-" if metrics["mfu"] is None else f"{100 * metrics['mfu']:.1f}%"
            mtp = f"mtp_loss {metrics['mtp_loss']:.4f}  " if "mtp_loss" in metrics else ""
            line = (
                f"step {step:5d}  loss {metrics['loss']:.4f}  {mtp}"
                f"grad_norm {metrics['grad_norm']:.3f}  "
                f"lr {metrics['lr']:.2e}  tokens/s {metrics['tokens_per_s']:.0f}  mfu {mfu}  "
                f"memory {metrics['memory_gib']:.2f} GiB"
            )
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def on_checkpoint(self, trainer, step: int, path: Path) -> None:
        if trainer.rank == 0:
            self.paths["checkpoint"] = path

    def on_train_end(self, trainer) -> None:
        if trainer.rank != 0:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.plot and trainer.losses:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(range(1, len(trainer.losses) + 1), trainer.losses, lw=1)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.set_title(trainer.config.job.name)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            self.paths["plot"] = Path(trainer.config.job.dump_folder) / "loss.png"
            fig.savefig(self.paths["plot"], dpi=100)
            plt.close(fig)


class MoeMonitorCallback(Callback):
    """Expert load of every MoE layer, from the ``moe`` entry of the step's metrics (the
    trainer reads it before the expert bias moves): every ``log_freq`` steps a console line
    per layer (load imbalance max/mean, balance loss, expert-bias range, dropped tokens);
    TensorBoard scalars ``moe/<layer>/...`` every step (when ``tensorboard``); and at the end
    ``<dump>/expert_load.png``, a heat map of each layer's share of routed tokens per expert
    over the run (when ``plot``). The per-expert counts are in ``metrics.jsonl`` too (the
    ``LoggingCallback`` writes every metric)."""

    def __init__(self, *, log_freq: int = 10, tensorboard: bool = True, plot: bool = True):
        _check_args(type(self).__name__, log_freq, tensorboard, plot)
        self.log_freq, self.tensorboard, self.plot = log_freq, tensorboard, plot
        self.writer = None
        self.load: dict[str, list[float]] = {}  # layer -> routed copies per expert, summed
        self.paths: dict[str, Path] = {}

    def on_train_begin(self, trainer) -> None:
        if trainer.rank != 0 or not self.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(trainer.config.job.dump_folder) / "tb" / "moe"))
        except ImportError:  # pragma: no cover - tensorboard is a dependency
            self.writer = None

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        stats = metrics.get("moe")
        if trainer.rank != 0 or not stats:
            return
        lines = []
        for st in stats:
            name = st["layer"]
            acc = self.load.setdefault(name, [0.0] * len(st["tokens"]))
            for i, c in enumerate(st["tokens"]):
                acc[i] += c
            if self.writer is not None:
                for key in ("imbalance", "aux_loss", "dropped", "bias_min", "bias_max"):
                    if st[key] is not None:
                        self.writer.add_scalar(f"moe/{name}/{key}", st[key], step)
            bias = (
                "-" if st["bias_min"] is None else f"[{st['bias_min']:+.3f}, {st['bias_max']:+.3f}]"
            )
            lines.append(
                f"  {name:>12}  imbalance {st['imbalance']:.2f}  aux {st['aux_loss']:.4f}  "
                f"bias {bias}  dropped {st['dropped']}"
            )
        if step % self.log_freq == 0 or step == 1:
            print(f"step {step:5d}  moe\n" + "\n".join(lines), flush=True)

    def on_train_end(self, trainer) -> None:
        if trainer.rank != 0:
            return
        if self.writer is not None:
            self.writer.close()
        if self.plot and self.load:
            self.paths["expert_load"] = self.heat_map(
                Path(trainer.config.job.dump_folder) / "expert_load.png", trainer.config.job.name
            )

    def heat_map(self, path: Path, title: str) -> Path:
        """Write the layer x expert share of routed tokens as a PNG; returns ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        layers = list(self.load)
        width = max(len(v) for v in self.load.values())
        grid = [[0.0] * width for _ in layers]
        for r, name in enumerate(layers):
            total = sum(self.load[name]) or 1.0
            for c, v in enumerate(self.load[name]):
                grid[r][c] = v / total
        fig, ax = plt.subplots(figsize=(min(12, 2 + 0.25 * width), 1 + 0.35 * len(layers)))
        im = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xlabel("expert")
        ax.set_title(f"{title}: share of routed tokens per expert")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
