"""klbench's import graph has no circles.

The graph is read from the source with `ast`, so nothing is imported. An edge A -> B means A imports B,
or a name from B. Importing klbench.x.y also runs klbench/x/__init__.py, so A -> klbench.x.y brings
A -> klbench.x too, unless A lives inside klbench.x (its own package is set up before it).

Two graphs are checked, and neither may have a circle:
- at import time (imports outside function bodies): a circle here runs one module's body while the
  other is half set up, and the error depends on which is imported first.
- every import, those inside functions too: a function-level import is how a run imports only what it
  needs (transformers, Lightning, MLflow) when it needs it, but it must follow the same direction as the
  rest (cli -> train -> tasks -> policies -> estimators). The circle that models.py, tasks/pretrain.py
  and policies.py made went mostly through such imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "klbench"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(tree: ast.AST, in_function: bool = False):
    """(imported node, inside a function body?) for every import statement under `tree`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        yield from _imports(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                    ast.Lambda)))


def _targets(node, module: str, is_package: bool, names) -> set[str]:
    """The klbench modules an import statement names (a `from x import y` names x.y when y is a module)."""
    if isinstance(node, ast.Import):
        found = {alias.name for alias in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        found = {f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names}
    targets = set()
    for name in found:
        while name and name not in names:  # `import klbench.x.y.z` where z is a name, not a module
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)
    return targets


def import_graph(include_functions: bool) -> dict[str, set[str]]:
    names = module_names()
    graph = {}
    for module, path in names.items():
        edges = set()
        for node, in_function in _imports(ast.parse(path.read_text(), str(path))):
            if in_function and not include_functions:
                continue
            for target in _targets(node, module, path.name == "__init__.py", names):
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the target and the packages set up on the way to it
                    step = ".".join(parts[:i])
                    if step != module and not module.startswith(step + "."):
                        edges.add(step)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each back edge of a depth-first search: empty iff the graph has no circle."""
    found, state, stack = [], {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def test_the_graph_reader_sees_imports_and_circles():
    graph = import_graph(include_functions=True)
    static = import_graph(include_functions=False)
    assert "klbench.config.resolvers" in static["klbench.cli"]  # a module-level `from klbench.x.y import z`
    assert "klbench.config" in static["klbench.cli"]  # ... which sets up klbench/config/__init__.py first
    assert "klbench.models.embedded" in graph["klbench.config.resolvers"]  # ... and klbench/models/embedded/ too
    assert "klbench.models.embedded.pretrain" in graph["klbench.models.embedded.cache"]  # a function-level import
    assert "klbench.models.embedded.pretrain" not in import_graph(include_functions=False)["klbench.models.embedded.cache"]
    assert "klbench.models.embedded" not in graph["klbench.models.embedded.cache"]  # its own package is not an edge
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_circle_at_import_time():
    found = circles(import_graph(include_functions=False))
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_circle_with_function_level_imports():
    found = circles(import_graph(include_functions=True))
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_embedded_circle_is_gone():
    """models.py only loads Hugging Face models; klbench.models.embedded builds the embedded one and needs
    nothing from the code that uses it."""
    graph = import_graph(include_functions=True)
    users = {"klbench.models.policies", "klbench.tasks.train", "klbench.tasks", "klbench.cli"}
    embedded = {m for m in graph if m.startswith("klbench.models.embedded")}
    assert not graph["klbench.models.hf"] & (users | embedded), graph["klbench.models.hf"]
    for module in embedded:
        assert not graph[module] & (users | {"klbench.models.hf"}), (module, graph[module])


def test_the_tabular_model_is_known_in_one_place():
    """The tasks, the probe, the sweeps and the trainer ask a policy for its prompt and its truth
    (klbench.models.interface.Policy), never for its type: only tabular_policy.py, its builder policies.py and
    tabular.py touch the tabular model, rewards/reward.py hands it to the tabular reward, and exact/mismatch.py perturbs its tables (the sampler's side
    of a training-inference mismatch is the exact model's own)."""
    allowed = {"klbench.models.policies", "klbench.models.tabular_policy", "klbench.exact.tabular", "klbench.rewards.reward",
               "klbench.exact.mismatch"}
    leaks = []
    for module, path in module_names().items():
        if module in allowed or module.startswith("klbench.exact.tabular."):  # the package: its own modules
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "table":  # policy.table, reward.table
                leaks.append(f"{module}:{node.lineno} .table")
            names = [node.id] if isinstance(node, ast.Name) else [a.name for a in getattr(node, "names", [])
                                                                  if isinstance(node, ast.ImportFrom)]
            leaks += [f"{module}:{node.lineno} {n}" for n in names if n in ("TabularPolicy", "TabularModel")]
    assert not leaks, leaks


# The layers of the README's code-layout table, as a rule: what each folder of klbench/ may import from
# the others (function-level imports included). Lower layers never reach up: the math imports nothing of
# the record, the tasks or the config; the record never imports the tasks; only the edges (config, sweep,
# cli) see everything they wire. `klbench.config.errors` is the one shared name of a bad config value.
LAYERS = {
    "estimators": set(),
    "exact": {"estimators"},
    "record": set(),
    "console": {"record"},
    "models": {"estimators", "exact", "console"},
    "data": {"models"},  # prompts: the embedded corpus and sums live with the embedded LMs
    "rewards": {"exact", "models", "data"},  # reward=answer reads the dataset's reference answers
    "probe": {"estimators", "exact", "models", "console"},
    "analysis": {"exact", "record", "console"},
    "tasks": {"estimators", "exact", "models", "data", "rewards", "probe", "record", "console", "config", "libraries"},
    "config": {"estimators", "probe", "models", "data", "rewards", "record"},  # the edge: options are declared below it
    "libraries": {"estimators", "exact", "record", "analysis", "console"},
    "integrations": {"estimators"},  # klbench inside TRL / verl; nothing of klbench imports it
    "sweep": {"estimators", "exact", "models", "rewards", "record", "console", "analysis", "config", "tasks"},
    "cli": {"estimators", "exact", "record", "console", "models", "data", "rewards", "probe", "analysis", "tasks",
            "config", "sweep"},
}
SHARED = {"klbench.config.errors", "klbench.config"}  # klbench.config: a docstring, set up on the way


def test_every_module_lives_in_a_layer():
    """No module outside the layers: each is in a folder of LAYERS (or is the entry point)."""
    outside = sorted(m for m in module_names() if m != "klbench" and m.split(".")[1] not in LAYERS)
    assert not outside, f"modules outside every layer of the README's code layout: {outside}"


def test_layers_import_only_downwards():
    graph = import_graph(include_functions=True)
    wrong = []
    for module, targets in graph.items():
        if module == "klbench":
            continue
        layer = module.split(".")[1]
        for target in targets:
            if target == "klbench" or target in SHARED or not target.startswith("klbench."):
                continue
            other = target.split(".")[1]
            if other != layer and other not in LAYERS.get(layer, set()):
                wrong.append(f"{module} -> {target} ({layer} may import {sorted(LAYERS.get(layer, ()))})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))
