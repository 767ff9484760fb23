"""Rewards, the `reward` group: a rollout in, one float per response out (`reward.py`: build_reward, VADER, a
Hugging Face classifier), and the verifiable answer reward (`answer.py`, torch-free: the config schema reads it)."""
