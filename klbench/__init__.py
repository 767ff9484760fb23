"""klbench: which KL estimator and which KL-gradient estimator does what it claims."""

__version__ = "0.1.0"
