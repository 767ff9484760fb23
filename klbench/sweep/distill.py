"""DistillReport, the Hydra callback of `klbench -m experiment=distill_estimators`: when the multirun
ends, the on-policy distillation report over that sweep folder's trials (klbench-distill-report
recomputes it later from MLflow)."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from klbench.analysis.distill_curves import BASELINE, METRIC

log = logging.getLogger(__name__)


class DistillReport(Callback):
    """At the end of a multirun: the report over this sweep folder's trial runs, in <sweep dir>/report
    and as a `distill-report` MLflow run in the trials' experiment (their parent, unless they had one)."""

    def __init__(self, steps: Sequence[int] | None = None, log_y: bool | None = None) -> None:
        self.steps = list(steps) if steps else None
        self.log_y = log_y

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.logger.get("kind") != "mlflow":
            log.warning("distill report: needs logger=mlflow (got %s); no report", config.logger.get("kind"))
            return
        try:
            self._report(config, sweep_dir)
        except Exception:  # Hydra would only warn; say plainly that the runs are fine and how to retry
            log.exception("distill report failed; the trial runs are intact: retry with "
                          "klbench-distill-report --sweep-dir %s", sweep_dir)

    def _report(self, config, sweep_dir: Path) -> None:
        from mlflow import MlflowClient

        from klbench.analysis.mlflow_io import collect_curves, log_report, run_ids_in_sweep
        from klbench.record.store import ensure_experiment
        lg = config.logger
        client = MlflowClient(lg.tracking_uri)
        curves, skipped = collect_curves(client, run_ids_in_sweep(sweep_dir))
        for why, ids in skipped.items():
            log.warning("distill report: %d run(s) left out (%s): %s", len(ids), why, ids)
        if not curves:
            log.error("distill report: no finished trial with a %s history in %s", METRIC, sweep_dir)
            return
        exp_id = ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root)
        title = f"{config.model.kind} distillation, {len(curves)} runs ({sweep_dir.name})"
        run_id, report = log_report(client, exp_id, curves, sweep_dir / "report", f"sweep_dir={sweep_dir}",
                                    title=title, steps=self.steps, log_y=self.log_y)
        print(f"\nOn-policy distillation, {METRIC} (mean ± std over seeds, ratio to {BASELINE}):\n"
              f"{report['md'].read_text()}\nreport in {sweep_dir / 'report'}, MLflow run {run_id}")
