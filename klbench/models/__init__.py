"""Policies, Hugging Face and embedded models, rewards and prompt data."""
