"""Every config default is declared once: in the option's pydantic model (klbench/config/schema.py and the options
models it extends), which Hydra composes from (klbench.config.resolvers.register). A group option's yaml holds only
what pydantic cannot: interpolations (`${...}`), `???` (a value the user gives) and a preset's deviations; the code
reads the validated config's keys, never `.get(key, default)`.

Each check is a function of the folders it reads, so that it can be pointed at an older checkout (the issue-46
report says how it failed there)."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType

import pytest
from omegaconf import OmegaConf
from pydantic import BaseModel

import klbench.config.schema as schema

ROOT = Path(__file__).resolve().parent.parent


def _node(path: Path) -> dict:
    """The yaml as written (OmegaConf's loader: `1e-6` is a float), interpolations unresolved."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def _parents(data: dict) -> list[str]:
    """The entries of a yaml's defaults list (`/task_rl_defaults@_here_`, `in_reward`, `_self_`)."""
    return [d for d in data.get("defaults", []) if isinstance(d, str) and d != "_self_"]


def option_model(conf: Path, group: str, stem: str, schema_mod: ModuleType = schema) -> type[BaseModel]:
    """The pydantic model of conf/<group>/<stem>.yaml: by its tag, the defaults node it pulls in, or the option
    it extends (`- in_reward`)."""
    options, disc = schema_mod.GROUPS[group]
    if disc is None:
        return options
    tags = schema_mod._tags(options, disc)
    data = _node(conf / group / f"{stem}.yaml")
    if data.get(disc) in tags:
        return tags[data[disc]]
    for parent in _parents(data):
        m = re.fullmatch(rf"/{group}_(\w+)_defaults@_here_", parent)
        if m:
            return tags[m.group(1)]
    for parent in _parents(data):
        if (conf / group / f"{parent}.yaml").exists():
            return option_model(conf, group, parent, schema_mod)
    raise AssertionError(f"conf/{group}/{stem}.yaml: no option model found (no {disc}, no defaults node)")


def _declared(model: type[BaseModel], key: str):
    """(has a default, the default as a yaml value) of model.key."""
    f = model.model_fields[key]
    if f.is_required():
        return False, None
    value = f.get_default(call_default_factory=True)
    return True, value.model_dump() if isinstance(value, BaseModel) else value


def _block(model: type[BaseModel], key: str):
    f = model.model_fields[key]
    import typing
    return next((a for a in (f.annotation, *typing.get_args(f.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _yaml_only(value) -> bool:
    """What pydantic cannot hold: an interpolation, or ??? (a value only the user knows)."""
    return value == "???" or (isinstance(value, str) and "${" in value)


def repeated_defaults(conf: Path, schema_mod: ModuleType = schema) -> list[str]:
    """'<file>: <key> ...' for every yaml value that repeats the model's default, and every literal value of a
    field without a default (the default then lives in the yaml alone)."""
    out = []

    def walk(model, data: dict, where: str, prefix: str) -> None:
        for key, value in data.items():
            if key == "defaults" or key not in model.model_fields:
                continue
            has, default = _declared(model, key)
            block = _block(model, key)
            if isinstance(value, dict) and block is not None and (not has or default is not None):
                if has and isinstance(default, dict):
                    same = [k for k, v in value.items() if not isinstance(v, dict) and default.get(k, object()) == v]
                    out.extend(f"{where}: {prefix}{key}.{k} = {value[k]!r} repeats the model's default" for k in same)
                walk(block, {k: v for k, v in value.items() if not has or k not in default}, where, f"{prefix}{key}.")
            elif has and value == default and isinstance(value, bool) == isinstance(default, bool):
                out.append(f"{where}: {prefix}{key} = {value!r} repeats the model's default")
            elif not has and not _yaml_only(value) and key not in ("name", "kind", "source"):
                out.append(f"{where}: {prefix}{key} = {value!r} is a default declared in yaml only "
                           f"({model.__name__}.{key} has none)")

    for group in GROUPS:
        for path in sorted((conf / group).glob("*.yaml")):
            model = option_model(conf, group, path.stem, schema_mod)
            walk(model, _node(path), f"conf/{group}/{path.name}", "")
    return out


def shared_values(conf: Path) -> list[str]:
    """'<group>.<key>' for every key that each option of its group sets (those with defaults of their own, not the
    presets that extend one) to the same literal value: a default of the group, written once per option."""
    out = []
    for group in GROUPS:
        options = [_node(p) for p in sorted((conf / group).glob("*.yaml"))]
        own = [o for o in options if not any((conf / group / f"{p}.yaml").exists() for p in _parents(o))]
        if len(own) < 2:
            continue
        for key in set.intersection(*(set(o) for o in own)) - {"defaults"}:
            values = [o[key] for o in own]
            if not isinstance(values[0], dict) and all(v == values[0] for v in values) and not _yaml_only(values[0]):
                out.append(f"{group}.{key} = {values[0]!r} in each of conf/{group}/*.yaml")
    return out


def config_keys(schema_mod: ModuleType = schema) -> set[str]:
    """Every key of a group option (and its blocks: task.probe, model.lora, model.spec)."""
    keys, todo = set(), [m for options, _ in schema_mod.GROUPS.values()
                         for m in (getattr(options, "__args__", None) or (options,))]
    while todo:
        model = todo.pop()
        for key in model.model_fields:
            keys.add(key)
            if (block := _block(model, key)) is not None:
                todo.append(block)
    return keys


# the names a config node goes by in klbench/ (cfg, cfg.task, self.cfg, task, ds, m, ...): `.get` on another
# object (a checkpoint's state, a model folder's generation_config, kwargs) is not a config default
CONFIG_NODES = re.compile(r"(^|\.)(cfg|config|task|estimator|kl_ctl|model|teacher|dataset|ds|reward|hardware|logger|"
                          r"store|spec|lora|probe|t|e|m|r)$")


def get_with_default(src: Path, keys: set[str]) -> list[str]:
    """'<file>:<line> <receiver>.get("<key>", ...)' for every config key read with a default in code."""
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
                continue
            receiver = ast.unparse(node.func.value)
            if node.args[0].value in keys and CONFIG_NODES.search(receiver):
                out.append(f"{path.relative_to(src.parent)}:{node.lineno} {ast.unparse(node)}")
    return out


GROUPS = [g for g in schema.GROUPS if g != "teacher"]  # model@teacher composes from conf/model


def test_no_yaml_value_repeats_or_replaces_a_declared_default():
    assert not repeated_defaults(ROOT / "conf"), "\n".join(repeated_defaults(ROOT / "conf"))


def test_no_group_writes_one_value_in_every_option():
    assert not shared_values(ROOT / "conf")


def test_code_reads_no_config_key_with_a_default():
    hits = get_with_default(ROOT / "klbench", config_keys())
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_every_declared_key(tmp_path, group):
    """The declared defaults reach the composed config: each option's keys are exactly its model's fields (the
    accepted-and-unused ones, exclude=True, aside), so code may read cfg.<group>.<key> directly."""
    from test_config import compose_cfg
    from test_schema import companions
    for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
        cfg = compose_cfg(tmp_path, [f"{group}={path.stem}", *companions(group, path.stem, tmp_path)])
        node = OmegaConf.to_container(cfg[group], resolve=False)
        model = option_model(ROOT / "conf", group, path.stem)
        assert set(node) == {k for k, f in model.model_fields.items() if not f.exclude}, (group, path.stem)


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check fires on a yaml or a line that declares a default twice."""
    conf = tmp_path / "conf"
    for group in GROUPS:
        (conf / group).mkdir(parents=True)
        for path in (ROOT / "conf" / group).glob("*.yaml"):
            (conf / group / path.name).write_text(path.read_text())
    (conf / "task" / "rl.yaml").write_text((conf / "task" / "rl.yaml").read_text() + "lr: 3.0e-4\n")
    assert repeated_defaults(conf) == ["conf/task/rl.yaml: lr = 0.0003 repeats the model's default"]
    for path in (conf / "logger").glob("*.yaml"):
        path.write_text(path.read_text() + "run_name: a\n")
    assert shared_values(conf) == ["logger.run_name = 'a' in each of conf/logger/*.yaml"]
    src = tmp_path / "klbench"
    src.mkdir()
    (src / "x.py").write_text("a = cfg.task.get('loss_agg', 'seq_sum')\nb = state.get('beta', 1.0)\n")
    assert get_with_default(src, config_keys()) == ["klbench/x.py:1 cfg.task.get('loss_agg', 'seq_sum')"]
