"""The sweep machinery behind `klbench -m sweep=...`: one MLflow parent run per Optuna study with every
trial as its child, the Pareto frontier logged on the parent when the sweep ends, and restarts that
resume the study instead of duplicating it.

- callback.py: SweepTracking, the Hydra callback the sweep configs enable; it only calls into:
- study.py: the Optuna study, through the sweeper plugin's private API (resume, orphans, budget);
- parent.py: the MLflow parent run, the frontier at the sweep's end and what the sweep prints;
- trial.py: a trial's own checkpoint and MLflow run, and recording its failure;
- signals.py: submitit's requeue signal, kept out of database writes;
- exact.py: the exact frontier of a tabular sweep;
- distill.py: DistillReport, the callback of `experiment=distill_estimators`.

Nothing is imported here: each callback's `_target_` names its own module, which loads only what it uses.
"""
