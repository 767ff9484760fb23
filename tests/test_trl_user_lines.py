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
        # these change what generate() returns or how fast
        do_sample=True, output_attentions=True, num_return_sequences=2)
    assert unapplied_generation_options(model) == {"max_new_tokens": 40, "no_repeat_ngram_size": 3,
                                                   "repetition_penalty": 1.2}


# ---- item 6: warnings that leak into every LoRA run and export ----

def test_add_lora_silences_peft_s_deprecation_call_and_only_it(recwarn):
    import warnings

    from klbench.models.lora import add_lora
    warnings.simplefilter("always")  # what a user's -W default or a fresh interpreter would show
    base = build_gpt2(64, n_embd=8, n_layer=1, n_head=2, n_positions=16, seed=0)
    add_lora(base, r=2, alpha=4, dropout=0.0, target_modules=None)
    said = [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)]
    assert not [m for m in said if "is_gradient_checkpointing" in m], said
    base.is_gradient_checkpointing  # the same deprecation reached outside klbench's call into peft still shows
    assert any("is_gradient_checkpointing" in str(w.message) for w in recwarn), "the filter is not scoped"


def test_a_lora_export_repeats_neither_the_run_s_notice_nor_peft_s_warning(tmp_path, tiny_arch, capsys, recwarn):
    import json
    import shutil
    import warnings

    from test_config import compose_cfg

    from klbench.tasks.export import main as export_main
    from klbench.tasks.train import run_task
    folder = tmp_path / "llama"  # a folder whose generation_config samples otherwise than task.*, as many do
    shutil.copytree(tiny_arch("llama")[0], folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.9, "top_p": 0.95}))
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={folder}", "model.lora.r=4", "task.max_steps=1",
                                 "task.prompts_per_step=2", "task.n_samples=2", "task.val_prompts=2",
                                 "task.max_new_tokens=4", "task.val_every=1", "logger=none"])
    warnings.simplefilter("always")  # every warning reached, as a fresh process shows it once
    run_task(cfg)
    notice = "this run samples with klbench's task.* options"
    assert notice in capsys.readouterr().out  # the run says it, once, at its start
    recwarn.clear()
    export_main([str(tmp_path / "run"), "--adapter"])
    out = capsys.readouterr()
    assert "klbench-export: wrote" in out.out
    assert notice not in out.out + out.err, out.out  # the export runs nothing: its own line says what it wrote
    said = [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)]
    assert not [m for m in said if "is_gradient_checkpointing" in m], said
