"""What a TRL / Hugging Face user reads from klbench (issue 51): the start-up line naming a model's unapplied
generation options, the warnings that leak from peft, and the progress lines of a log file."""
from __future__ import annotations

from transformers import GenerationConfig

from klbench.models.embedded.build import build_gpt2
from klbench.models.hf import unapplied_generation_options


def test_the_embedded_default_names_no_unapplied_generation_option():
    # build_gpt2 is what the embedded default is built by: its generation_config sets output_attentions=False and
    # output_hidden_states=False, which change nothing in what it samples (they were named in every first run)
    model = build_gpt2(64, n_embd=8, n_layer=1, n_head=2, n_positions=16, seed=0)
    assert model.generation_config.to_diff_dict().get("output_attentions") is False  # the case the line named
    assert unapplied_generation_options(model) == {}


def test_only_options_that_change_what_is_sampled_are_named():
    model = build_gpt2(64, n_embd=8, n_layer=1, n_head=2, n_positions=16, seed=0)
    model.generation_config = GenerationConfig(
        repetition_penalty=1.2, no_repeat_ngram_size=3, max_new_tokens=40,  # these change the sample: named
        output_scores=True, return_dict_in_generate=True, output_logits=True, cache_implementation="static",
        do_sample=True, output_attentions=True, num_return_sequences=2)  # these change what generate() returns or how fast
    assert unapplied_generation_options(model) == {"max_new_tokens": 40, "no_repeat_ngram_size": 3,
                                                   "repetition_penalty": 1.2}
