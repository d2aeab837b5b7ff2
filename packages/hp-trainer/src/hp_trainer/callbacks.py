"""Callbacks: ``LoggingCallback`` (console lines, a progress bar, TensorBoard events, a JSONL
log and a loss-curve PNG, all on rank 0)."""

from __future__ import annotations

import json
from pathlib import Path

from ._trainer import Callback

__all__ = ["Callback", "LoggingCallback"]


class LoggingCallback(Callback):
    """Loss, gradient norm, LR, tokens/s, MFU and memory every ``log_freq`` steps; a tqdm bar;
    TensorBoard events under ``<dump>/tb`` (when ``tensorboard``); ``<dump>/metrics.jsonl``;
    ``<dump>/loss.png`` at the end (when ``plot``)."""

    def __init__(self, *, log_freq: int = 10, tensorboard: bool = True, plot: bool = True):
        self.log_freq, self.tensorboard, self.plot = log_freq, tensorboard, plot
        self.bar = self.writer = self.jsonl = None
        self.paths: dict[str, Path] = {}

    def on_train_begin(self, trainer) -> None:
        if trainer.rank != 0:
            return
        from tqdm.auto import tqdm

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
        steps = trainer.config.training.steps
        self.bar = tqdm(total=steps, initial=trainer.step, desc="train", unit="step")

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if trainer.rank != 0:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                if v is not None:
                    self.writer.add_scalar(k, v, step)
        if step % self.log_freq == 0 or step == 1:
            mfu = "-" if metrics["mfu"] is None else f"{100 * metrics['mfu']:.1f}%"
            self.bar.write(
                f"step {step:5d}  loss {metrics['loss']:.4f}  "
                f"grad_norm {metrics['grad_norm']:.3f}  "
                f"lr {metrics['lr']:.2e}  tokens/s {metrics['tokens_per_s']:.0f}  mfu {mfu}  "
                f"memory {metrics['memory_gib']:.2f} GiB"
            )

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
