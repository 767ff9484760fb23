"""klbench.config.schema: every shipped config validates; every bad value is stopped with the field named, before
anything heavy is imported."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from klbench.config.schema import ConfigError, EmbeddedSpec, validate
from test_config import GROUPS, ROOT, compose_cfg

SWEEPS = sorted(p.stem for p in (ROOT / "sweeps" / "sweep").glob("*.yaml"))


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def jsonl_overrides(tmp_path) -> list[str]:
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}"} for i in range(8)] + [" "])  # a blank line is fine
    val = jsonl(tmp_path / "val.jsonl", [{"prompt": "v", "other": 1}])
    return ["dataset=jsonl", f"dataset.train_path={train}", f"dataset.val_path={val}"]


def raises_naming(cfg, field: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(field + " "), str(e.value)
    return str(e.value)


# ---- what ships validates ----

def companions(group: str, option: str, tmp_path) -> list[str]:
    """What an option needs beside it: a value for its ??? keys, or the options it only works with."""
    return {("task", "distill"): ["experiment=distill"],
            ("model", "tabular"): ["reward=tabular"],
            ("model", "hf"): ["model.name_or_path=gpt2"],
            ("reward", "tabular"): ["model=tabular"],
            ("reward", "answer"): ["dataset=arith"],
            ("reward", "hf_classifier"): ["reward.name_or_path=lvwerra/distilbert-imdb"],
            ("dataset", "jsonl"): jsonl_overrides(tmp_path)[1:],
            ("store", "server"): ["store.mlflow=http://127.0.0.1:5000",
                                  "store.optuna=postgresql+psycopg://klbench@127.0.0.1/klbench"]}.get((group, option), [])


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_validates(tmp_path, group, option):
    validate(compose_cfg(tmp_path, [f"{group}={option}", *companions(group, option, tmp_path)]))


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_validates(tmp_path, sweep):
    validate(compose_cfg(tmp_path, [f"sweep={sweep}", "experiment=tabular"]))


@pytest.mark.parametrize("override", [
    "hardware.devices=-1", "hardware.devices=auto", "hardware.devices=[0,1]", "hardware.devices=2",
    *[f"hardware.precision={p}" for p in ("64", "32", "16", "bf16", "32-true", "16-mixed", "bf16-mixed", "bf16-true",
                                          "64-true", "16-true", "transformer-engine")],
    "estimator.beta=0", "estimator.beta=1", "estimator.beta=10000", "task.max_new_tokens=127", "task.lr=1", "task.grad_clip=null", "task.reward_coef=0",
    "ckpt_path=last", "++ckpt_allow_changes=[task.max_steps,estimator]", "++ckpt_allow_changes=[*]",
    "reward=hf_classifier", "model=hf"])
def test_good_values_pass(tmp_path, override):
    more = {"reward=hf_classifier": ["reward.name_or_path=clf", "reward.label=1"],
            "model=hf": ["model.name_or_path=gpt2", "model.dtype=bfloat16"]}.get(override, [])
    validate(compose_cfg(tmp_path, [override, *more]))


@pytest.mark.parametrize("overrides", [["sweep=rl_beta", "logger=csv"], ["experiment=distill_estimators", "logger=none"]])
def test_mlflow_keys_that_experiments_set_do_not_stop_other_loggers(tmp_path, overrides):
    validate(compose_cfg(tmp_path, overrides))


def test_ckpt_allow_changes_may_be_missing(tmp_path):
    cfg = compose_cfg(tmp_path)
    with open_dict(cfg):
        cfg.pop("ckpt_allow_changes", None)
    validate(cfg)


# ---- bad values, each named ----

BAD = [
    (["task.lr=0"], "task.lr"), (["task.lr=-1e-3"], "task.lr"), (["task.lr=nan"], "task.lr"),
    (["task.prompts_per_step=0"], "task.prompts_per_step"),
    (["task.max_new_tokens=0"], "task.max_new_tokens"), (["task.max_new_tokens=-4"], "task.max_new_tokens"),
    (["task.val_every=0"], "task.val_every"), (["task.log_every=0"], "task.log_every"),
    (["task.max_steps=0"], "task.max_steps"), (["task.val_prompts=0"], "task.val_prompts"),
    (["task.n_samples=0"], "task.n_samples"), (["task.val_samples=0"], "task.val_samples"),
    (["task.n_samples=4.0"], "task.n_samples"), (["task.reward_coef=nan"], "task.reward_coef"),
    (["estimator.beta=nan"], "estimator.beta"), (["estimator.beta=inf"], "estimator.beta"),
    (["estimator.beta=-1"], "estimator.beta"), (["estimator.beta=abc"], "estimator.beta"),
    (["estimator.beta=1e308"], "estimator.beta"), (["estimator.beta=10001"], "estimator.beta"),
    (["kl_ctl=adaptive", "kl_ctl.init_beta=1e5"], "kl_ctl.init_beta"),
    # the embedded LMs' context: 128 positions for prompt and response (model.spec.n_positions)
    (["task.max_new_tokens=100000"], "task.max_new_tokens=100000"),
    (["task.max_new_tokens=128"], "task.max_new_tokens=128"),
    (["model.spec.n_positions=16", "task.max_new_tokens=16"], "task.max_new_tokens=16"),
    (["experiment=distill", "task.max_new_tokens=500"], "task.max_new_tokens=500"),
    (["task=probe", "task.max_new_tokens=500"], "task.max_new_tokens=500"),
    (["estimator.beta=true"], "estimator.beta"), (["estimator=loo", "estimator.beta=abc"], "estimator.beta"),
    (["estimator=naive_cv", "estimator.lam=nan"], "estimator.lam"),
    (["estimator=naive_cv", "estimator.level=tok"], "estimator.level"),
    (["estimator=naive_cv", "estimator.clamp=0"], "estimator.clamp"),
    (["+estimator.lam=0.5"], "estimator.lam"), (["estimator.name=nope"], "estimator.name='nope'"),
    (["hardware.precision=garbage"], "hardware.precision"), (["hardware.precision=32.0"], "hardware.precision"),
    (["hardware.devices=0"], "hardware.devices"), (["hardware.devices=-2"], "hardware.devices"),
    (["hardware.devices=[]"], "hardware.devices"), (["hardware.num_nodes=0"], "hardware.num_nodes"),
    (["hardware.accelerator=gpus"], "hardware.accelerator"),
    (["seed=abc"], "seed"), (["seed=-1"], "seed"), (["+sede=1"], "sede"),
    (["++ckpt_allow_changes=task.max_steps"], "ckpt_allow_changes"),
    (["model.preset=huge"], "model.preset"), (["model.spec.n_layer=0"], "model.spec.n_layer"),
    (["+model.spec.layers=2"], "model.spec.layers"), (["model.dtype=float64"], "model.dtype"),
    (["model=hf"], "model.name_or_path"),  # ??? in conf/model/hf.yaml
    (["experiment=tabular", "model.K=1"], "model.K"), (["experiment=tabular", "model.eos=4"], "model.eos"),
    (["reward=hf_classifier", "reward.name_or_path=clf", "reward.score=logits"], "reward.score"),
    (["dataset=hf", "dataset.prompt_words=0"], "dataset.prompt_words"),
    (["logger.experiment=null"], "logger.experiment"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_names_the_field(tmp_path, overrides, field):
    raises_naming(compose_cfg(tmp_path, overrides), field)


def test_messages_say_what_is_valid(tmp_path):
    assert raises_naming(compose_cfg(tmp_path, ["estimator.beta=nan"]), "estimator.beta") == \
        "estimator.beta must be a finite number >= 0 and <= 10000 (a larger one leaves the reward no weight; " \
        "task.reward_coef=0 trains on the KL alone), got nan"
    assert raises_naming(compose_cfg(tmp_path, ["kl_ctl=adaptive", "estimator.beta=0.1", "kl_ctl.init_beta=1e5"]),
                         "kl_ctl.init_beta") == "kl_ctl.init_beta must be <= 10000, like estimator.beta, got 100000.0"
    assert raises_naming(compose_cfg(tmp_path, ["task.max_new_tokens=100000"]), "task.max_new_tokens=100000") == \
        "task.max_new_tokens=100000 does not fit the context of the embedded model (preset reference): its " \
        "model.spec.n_positions=128 positions hold the prompt and the response together, so " \
        "task.max_new_tokens must be < 128"
    assert raises_naming(compose_cfg(tmp_path, ["+estimator.lam=0.5"]), "estimator.lam") == \
        "estimator.lam does not apply to estimator 'rb' (its options: beta)"
    assert "'token' or 'sequence'" in raises_naming(compose_cfg(tmp_path, ["estimator=naive_cv", "estimator.level=x"]),
                                                    "estimator.level")
    assert "bf16-mixed" in raises_naming(compose_cfg(tmp_path, ["hardware.precision=garbage"]), "hardware.precision")
    unknown = raises_naming(compose_cfg(tmp_path, ["estimator.name=nope"]), "estimator.name='nope'")
    assert unknown.startswith("estimator.name='nope' is unknown; valid: ")
    # the names the conf/estimator options compose to (trl_grpo and verl_low_var_kl are both "library")
    names = {compose_cfg(tmp_path, [f"estimator={o}"]).estimator.name for o in GROUPS["estimator"]}
    assert set(unknown.split("valid: ")[1].split(", ")) == names


# ---- rules across groups (moved here from train.check_config) ----

DISTILL = ["experiment=distill_tabular"]


@pytest.mark.parametrize("overrides,match", [
    (["task=distill", "model=tabular", "reward=none", "estimator.beta=1.0"], "task=distill needs a teacher"),
    (DISTILL + ["estimator.beta=0.5"], "estimator.beta must be 1"),
    (DISTILL + ["task.reward_coef=1.0"], "needs a reward, but reward=none"),
    (["experiment=tabular", "model@teacher=tabular"], "only applies to task=distill"),
    (DISTILL + ["model@teacher=embedded"], "must both be tabular or both be language models"),
    (DISTILL + ["teacher.T=5"], "student and teacher vocabularies differ"),
    (["estimator=loo", "task.n_samples=1"], "estimator loo needs task.n_samples >= 2"),
    (["task.n_samples=1"], "the RLOO reward baseline needs task.n_samples >= 2"),
    (["model=tabular"], "model=tabular needs reward=tabular or reward=none"),
    (["reward=tabular"], "reward=tabular needs model=tabular"),
    (["task=pretrain", "model=tabular"], "task=pretrain builds the embedded LMs"),
    (["estimator=library", "estimator.setting=trl.distill.beta1"],
     r"^estimator.setting=trl.distill.beta1 is an on-policy distillation loss: it belongs to task=distill, not "
     r"task=rl \("),
    (DISTILL + ["estimator=library", "estimator.beta=1", "estimator.setting=verl.kl_penalty.k3"],
     r"^estimator.setting=verl.kl_penalty.k3 is an RL KL penalty: it belongs to task=rl, not task=distill \("),
])
def test_bad_combination(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(tmp_path, overrides))


def test_a_library_setting_of_its_own_task_validates(tmp_path):
    validate(compose_cfg(tmp_path, DISTILL + ["estimator=library", "estimator.beta=1",
                                              "estimator.setting=verl.distill.k3.pg"]))
    validate(compose_cfg(tmp_path, ["estimator=library", "estimator.setting=skyrl_train.k3"]))


def test_rloo_needs_no_group_without_a_reward_term(tmp_path):
    validate(compose_cfg(tmp_path, ["task.n_samples=1", "task.reward_coef=0"]))


def test_pretrain_checks_only_the_model(tmp_path):
    validate(compose_cfg(tmp_path, ["task=pretrain", "estimator.beta=abc", "hardware.devices=0", "reward=tabular"]))
    raises_naming(compose_cfg(tmp_path, ["task=pretrain", "model.spec.steps=0"]), "model.spec.steps")


# ---- jsonl datasets: read by the one reader klbench.data.prompts uses too ----

def test_jsonl_bad_line_gives_path_and_line(tmp_path):
    over = jsonl_overrides(tmp_path)
    bad = jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": "c"'] + [{"prompt": "d"}] * 8)
    msg = raises_naming(compose_cfg(tmp_path, over + [f"dataset.train_path={bad}"]), "dataset.train_path:")
    assert f"{bad}:3" in msg


@pytest.mark.parametrize("rows,match", [
    ([{"text": "a"}], r"val\.jsonl:1 has no field 'prompt'"),
    ([["a"]], r"val\.jsonl:1 is not a JSON object"),
    ([" ", {"prompt": 3}], r"val\.jsonl:2 field 'prompt' is not a string"),
    ([" "], "holds no prompts"),
])
def test_jsonl_bad_file(tmp_path, rows, match):
    over = jsonl_overrides(tmp_path)
    jsonl(tmp_path / "val.jsonl", rows)
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(tmp_path, over))


def test_jsonl_missing_file_and_too_few_prompts(tmp_path):
    over = jsonl_overrides(tmp_path)
    raises_naming(compose_cfg(tmp_path, over + [f"dataset.val_path={tmp_path}/nope.jsonl"]), "dataset.val_path:")
    msg = raises_naming(compose_cfg(tmp_path, over + ["task.prompts_per_step=9"]), "dataset.train_path:")
    assert "task.prompts_per_step=9" in msg
    validate(compose_cfg(tmp_path, over + ["task.prompts_per_step=9", "experiment=tabular"]))  # tabular: prompts unused


def test_data_reads_jsonl_with_the_same_reader(tmp_path):
    from klbench.data.prompts import load_prompts
    cfg = compose_cfg(tmp_path, jsonl_overrides(tmp_path))
    train, val = load_prompts(cfg.dataset)
    assert train == [f"p{i}" for i in range(8)] and val == ["v"]
    jsonl(tmp_path / "val.jsonl", [{"prompt": "a"}, "{"])
    with pytest.raises(ValueError, match=r"val\.jsonl:2"):
        load_prompts(cfg.dataset)


# ---- the schema and the torch estimators agree on what an option accepts ----

@pytest.mark.parametrize("key,values", [
    ("lam", [1.0, -2, 0, math.nan, math.inf, "x", True]),
    ("level", ["token", "sequence", "tok", 1]),
    ("clamp", [None, 0.5, 3, 0, -1, "x", True]),
])
def test_estimator_option_checks_match_the_registry(tmp_path, key, values):
    """The schema accepts exactly what the estimators accept, except bools, which only the schema refuses."""
    from klbench.estimators import gradient_estimator
    cfg = compose_cfg(tmp_path, ["estimator=naive_cv"])
    for value in values:
        with open_dict(cfg):
            cfg.estimator[key] = value
        try:
            validate(cfg)
            schema_ok = True
        except ConfigError:
            schema_ok = False
        try:
            gradient_estimator("naive_cv", **{key: value})
            registry_ok = True
        except ValueError:
            registry_ok = False
        assert schema_ok == (registry_ok and not isinstance(value, bool)), (key, value)


def test_embedded_spec_mirrors_the_models_spec():
    from klbench.models.embedded.spec import CORPUS_SPECS
    # every corpus's keys but `corpus` itself, which the preset fixes
    keys = {k for spec in CORPUS_SPECS.values() for k in spec} - {"corpus"}
    assert set(EmbeddedSpec.model_fields) == keys


def test_validate_imports_nothing_heavy(tmp_path):
    code = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(ROOT / "tests")!r})
from test_config import compose_cfg
import klbench.config.schema
klbench.config.schema.validate(compose_cfg(Path({str(tmp_path)!r}), ["experiment=tabular"]))
klbench.config.schema.validate(compose_cfg(Path({str(tmp_path)!r}), ["estimator=naive_cv"]))
heavy = [m for m in ("torch", "lightning", "mlflow", "transformers", "klbench.estimators.base") if m in sys.modules]
assert not heavy, heavy
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---- each option declared once: a pydantic field, read by the schema, the torch code and Hydra ----

def declared_options() -> dict[str, tuple[str, dict]]:
    """option name -> (the one file that declares it, its default)."""
    from klbench.estimators.options import GRADIENT_OPTIONS, VALUE_OPTIONS
    from klbench.probe.config import ProbeOptions
    out = {k: ("klbench/estimators/options.py", f.default)
           for m in (*GRADIENT_OPTIONS.values(), *VALUE_OPTIONS.values()) for k, f in m.model_fields.items()}
    out.update({k: ("klbench/probe/config.py", f.default) for k, f in ProbeOptions.model_fields.items()})
    return out


# names that other classes use for something else: a run's seed, a reward table's, a curve's; the prompt
# texts of a Rollout
# names that are also fields of classes that are not options: a trial's seed, a probe's prompts, an audit
# result's setting (klbench.libraries.audit.Cell: which setting a row audited); and an option two estimators
# declare with different defaults: form (in_reward: sequence, vopd: reward_to_go)
HOMONYMS = {"seed", "prompts", "setting", "form"}


def class_fields(root: Path) -> dict[str, set[str]]:
    """field name -> the files whose classes declare it (`name: type` in a class body: pydantic, dataclass)."""
    import ast
    out: dict[str, set[str]] = {}
    for path in (root / "klbench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                        out.setdefault(st.target.id, set()).add(str(path.relative_to(root)))
    return out


def option_lists(root: Path, names: set[str]) -> list[str]:
    """Literal tuples/lists/sets of 2+ option names, and dicts of 2+ options with constant values (a copy of
    the keys, like OPTION_KEYS, or of the defaults, like `defaults = {"lam": 1.0, ...}`): 'file:line'."""
    import ast
    out = []
    for path in (root / "klbench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                keys = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            elif isinstance(node, ast.Dict) and all(isinstance(v, ast.Constant) for v in node.values):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            else:
                continue
            found = {k for k in keys if isinstance(k, str) and k in names}
            if len(found) >= 2:
                out.append(f"{path.relative_to(root)}:{node.lineno} {sorted(found)}")
    return out


def test_each_option_is_declared_in_one_file():
    """The probe's options used to be written in five places (ProbeConfig, the schema's dataclass, OPTION_KEYS,
    conf/task/probe.yaml, rl.yaml), the estimators' in two (their `defaults`, the schema)."""
    fields = class_fields(ROOT)
    for name, (owner, _) in declared_options().items():
        where = fields.get(name, set())
        assert owner in where and (name in HOMONYMS or where == {owner}), (name, sorted(where))
    distinct = set(declared_options()) - HOMONYMS
    listed = [hit for hit in option_lists(ROOT, distinct) if not hit.startswith(("klbench/estimators/options.py",
                                                                                 "klbench/probe/config.py"))]
    assert not listed, listed


def test_yaml_holds_only_values_that_differ_from_the_declared_defaults():
    """conf/ takes the defaults from the models (klbench.config.resolvers.register); a yaml value equal to
    the default would be a second declaration of it."""
    options = {k: v for k, v in declared_options().items() if k not in HOMONYMS}
    repeated = []

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in options and not isinstance(v, (dict, list)) and v == options[k][1] and \
                        not (isinstance(v, str) and "${" in v):
                    repeated.append(f"{where}: {k}: {v!r}")
                walk(v, where)
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        walk(OmegaConf.to_container(OmegaConf.load(path), resolve=False), str(path.relative_to(ROOT)))
    assert not repeated, repeated


@pytest.mark.parametrize("overrides,node,model,key,value", [
    (["task=probe"], "task", "ProbeOptions", "samples", 16), ([], "task.probe", "ProbeOptions", "replicates", 8),
    (["estimator=naive_cv"], "estimator", "ControlVariateOptions", "clamp", 0.5),
    (["estimator=in_reward"], "estimator", "InRewardOptions", "form", "reward_to_go"),
    (["estimator=in_loss"], "estimator", "InLossOptions", "max_weight", 2.0),
])
def test_every_declared_option_is_a_key_of_the_composed_config(tmp_path, overrides, node, model, key, value):
    """Hydra gets the defaults from the models: --cfg job prints them, and `task.samples=16` needs no `+`."""
    import klbench.estimators.options
    import klbench.probe.config
    cls = getattr(klbench.probe.config, model, None) or getattr(klbench.estimators.options, model)
    got = OmegaConf.to_container(OmegaConf.select(compose_cfg(tmp_path, overrides), node), resolve=True)
    defaults = cls().model_dump()
    assert set(defaults) <= set(got)
    if node != "task.probe":  # rl.yaml sets a smaller probe
        assert {k: got[k] for k in defaults} == defaults
    changed = compose_cfg(tmp_path, [*overrides, f"{node}.{key}={value}"])
    assert OmegaConf.select(changed, f"{node}.{key}") == value
    validate(changed)


def test_the_off_policy_rule_is_each_gradient_estimators():
    """The schema refuses pi_old samples (task.inner_steps > 1, kl_target=model) by the torch-free rule of
    klbench.estimators.options; each estimator class says the same with its off_policy flag."""
    import klbench.libraries.estimator  # noqa: F401  registers "library", as the RL task does
    from klbench.estimators import GRADIENT_ESTIMATORS, gradient_estimator
    from klbench.estimators.options import corrects_off_policy
    for name, cls in GRADIENT_ESTIMATORS.items():
        if name == "in_loss":
            for ratio in ("none", "token", "sequence"):
                assert corrects_off_policy(name, ratio) == gradient_estimator(name, ratio=ratio).supports_off_policy()
        else:
            assert corrects_off_policy(name) == cls.off_policy, name
