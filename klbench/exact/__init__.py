"""The exact ground truth: the tabular model, its exact KLs and gradients, the audit, worked losses."""
