"""The embedded default: a tiny GPT-2 pretrained offline on generated movie reviews, cached per user.

    spec.py      what a model is: presets (reference, teacher, student), spec checks, the cache key
    corpus.py    the generated reviews and the RL prompts
    build.py     the byte-level BPE tokenizer and a fresh GPT-2 (transformers)
    pretrain.py  next-token pretraining with a Lightning Trainer
    cache.py     one folder per spec under cache_dir(), built once per machine under a lock

Importing the package imports neither torch nor transformers: build.py and pretrain.py are
imported from their modules, by the code that trains.
"""
from klbench.models.embedded.cache import cache_dir, embedded_lm_dir, ensure_embedded_lm, ensure_embedded_tokenizer
from klbench.models.embedded.corpus import embedded_prompts, generate_reviews
from klbench.models.embedded.spec import (DEFAULT_REFERENCE_SPEC, DEFAULT_STUDENT_SPEC, DEFAULT_TEACHER_SPEC,
                                   DEFAULT_TOKENIZER_SPEC, EMBEDDED_CODE_VERSION, PRESETS, complete_spec, preset_spec,
                                   tokenizer_spec)

__all__ = ["cache_dir", "embedded_lm_dir", "ensure_embedded_lm", "ensure_embedded_tokenizer", "embedded_prompts",
           "generate_reviews", "DEFAULT_REFERENCE_SPEC", "DEFAULT_STUDENT_SPEC", "DEFAULT_TEACHER_SPEC",
           "DEFAULT_TOKENIZER_SPEC", "EMBEDDED_CODE_VERSION", "PRESETS", "complete_spec", "preset_spec",
           "tokenizer_spec"]
