"""MLflow tracking for training, done by rank 0 only.

The run of a DAG run is found by its ``dag_run`` tag, so a retried or restarted train step keeps
logging into the same run instead of opening a second one. Without ``MLFLOW_TRACKING_URI`` the
tracker only logs locally (plain ``python -m tasks.train`` on a laptop).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.config import TrainSettings
from tasks.lib.step import log

if TYPE_CHECKING:  # torch's: the steps that only read runs (report, deploy) start without it
    from tasks.lib.model import GPTConfig
    from tasks.lib.parallel import Dist


def find_dag_run(experiment: str, dag_run_tag: str) -> str | None:
    """The id of the MLflow run tagged ``dag_run=<tag>`` in ``experiment`` (made current)."""
    import mlflow

    mlflow.set_experiment(experiment)
    found = mlflow.search_runs(filter_string=f"tags.dag_run = '{dag_run_tag}'", output_format="list")
    return str(found[0].info.run_id) if found else None


# whole-run figures of the train step's result, logged once when training ends (shares of the loop time;
# per checkpoint: the loop's stall and the time until the checkpoint was complete)
RUN_FIGURES = ("final_loss", "tokens_per_s", "mfu", "eval_share", "checkpoint_share", "checkpoint_stall_s",
               "checkpoint_save_s")


class Tracker:
    def __init__(self, is_main: bool, params: TrainSettings, dag_run_tag: str) -> None:
        self.enabled = is_main and bool(os.environ.get("MLFLOW_TRACKING_URI"))
        self.params, self.dag_run_tag = params, dag_run_tag
        self.run_id: str | None = None
        if is_main and not self.enabled:
            log.info("MLFLOW_TRACKING_URI is not set: metrics go to the log only")

    def start(self, config: GPTConfig, env: Dist, resumed_from: str | None, dataset: str,
              initialized_from: str | None = None) -> None:
        if not self.enabled:
            return
        import mlflow

        existing = find_dag_run(self.params.experiment, self.dag_run_tag) if self.dag_run_tag else None
        mlflow.set_experiment(self.params.experiment)
        tags = {"dag_run": self.dag_run_tag, "step": "train"} if self.dag_run_tag else {"step": "train"}
        run = mlflow.start_run(run_id=existing, run_name=None if existing else f"train {self.dag_run_tag}".strip(), tags=tags)
        self.run_id = run.info.run_id
        if existing is None:
            # tuples as the lists params.yaml writes: betas logs "[0.9, 0.95]", comparable across runs
            flat = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.params).items()
                    if k != "presets"}
            mlflow.log_params({**flat, **{f"model.{k}": v for k, v in config.to_dict().items()},
                               "world_size": env.world, "device": str(env.device), "dataset": dataset,
                               "model.num_params": config.num_params()})
        if resumed_from:
            mlflow.set_tag("resumed_from", resumed_from)
        mlflow.set_tag("initialized_from", initialized_from or "scratch")
        log.info("MLflow run %s (%s)", self.run_id, "resumed" if existing else "new")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            import mlflow

            mlflow.log_metrics(metrics, step=step)

    def log_model_files(self, folder: Path) -> None:
        if not self.enabled:
            return
        import mlflow

        for name in ("config.json", "model.safetensors"):
            mlflow.log_artifact(str(folder / name), artifact_path="model")
        with tempfile.TemporaryDirectory(prefix="loss-curve-") as tmp:
            mlflow.log_artifact(str(self._loss_plot(Path(tmp) / "loss_curve.png")))

    def _loss_plot(self, path: Path) -> Path:
        """The whole run's loss curve (also steps logged before a restart), from the server."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from mlflow import MlflowClient

        client = MlflowClient()
        assert self.run_id is not None
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in ("loss", "val_loss"):
            history = sorted((m.step, m.value) for m in client.get_metric_history(self.run_id, name))
            if history:
                ax.plot(*zip(*history, strict=True), label=name, marker="o" if name == "val_loss" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("cross entropy")
        ax.set_title("training loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def finish(self, result: dict[str, Any]) -> None:
        if not self.enabled:
            return
        import mlflow

        mlflow.log_metrics({k: float(result[k]) for k in RUN_FIGURES if result.get(k) is not None})
        if result.get("peak_source"):
            mlflow.set_tag("mfu.peak", f"{result['peak_flops'] / 1e9:.1f} GFLOP/s, {result['peak_source']}")
        if result.get("malloc"):
            mlflow.set_tag("malloc", result["malloc"])  # tcmalloc on CPUs (tasks.lib.torchrun), else glibc
        if result.get("val_loss") is not None:
            mlflow.log_metric("final_val_loss", float(result["val_loss"]))
        mlflow.end_run()
