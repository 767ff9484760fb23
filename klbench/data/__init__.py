"""Prompt data, the `dataset` group: the prompts of a run and their reference answers (`prompts.py`), the one reader
of jsonl files (`jsonl.py`, torch-free: the config schema reads it too), chat templates (`chat.py`)."""
