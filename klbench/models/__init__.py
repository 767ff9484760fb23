"""Policies, Hugging Face and embedded models: rollouts and their scoring (prompt data: klbench.data; rewards: klbench.rewards)."""
from klbench.models import lazy_scipy

# the dtypes a model loads in (model.dtype), by torch's name: klbench.models.hf maps them to torch's dtypes,
# klbench.config.schema checks them before torch is imported
DTYPES = ("float32", "bfloat16", "float16")
# the attention implementations a run may name (model.attn_implementation; null: the model's default, SDPA where
# transformers supports it): transformers' own names; the flash ones need their package and a GPU
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")

# before any klbench module imports transformers: its object-detection losses import scipy.optimize for nothing
lazy_scipy.install()
