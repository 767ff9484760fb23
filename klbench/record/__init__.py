"""The record: MLflow runs and their status, the store, checkpoints and resuming, run folders."""
