"""The probe: bias and variance of every estimator on a policy/reference pair (task=probe)."""
