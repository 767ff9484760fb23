"""Every `klbench` command in the README and docs/ composes and passes the checks a run makes first.

A command in the docs that no longer composes (a renamed option, a removed group, a typo) is a broken
promise to whoever copies it. Each command is parsed from the fenced shell blocks, composed as the
`klbench` entry point would (its sweep's `hydra.*` overrides included), and validated by the schema, the
check that stops a run before anything is built. Placeholders such as `<run>` become a plain word;
comma lists (`seed=0,1,2`, swept under -m) take their first value, as the first trial would; a shell
variable (`seed=$seed` in a loop) becomes 0; `hydra/launcher=slurm_<site>`, the user's copy of
conf/hydra/launcher/slurm_site_example.yaml, is composed as that example.
Running the commands is not attempted here: many take minutes to hours (their docs pages give times).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from klbench.config.compose import compose
from klbench.config.schema import validate

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")


def shell_lines(text: str):
    """Lines of the fenced bash/sh blocks, continuation lines joined, comments dropped."""
    lang, buf = None, ""
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if fence:
            lang = None if lang is not None else fence.group(1) or "text"
            continue
        if lang not in ("bash", "sh"):
            continue
        buf += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            yield buf
            buf = ""


def klbench_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv after `klbench`, the variables the page exported before it) for each `klbench` command."""
    out = []
    for page in PAGES:
        env: dict[str, str] = {}
        for line in shell_lines(page.read_text()):
            commands = [[]]
            for word in shlex.split(re.sub(r"<[^<>]*>", "placeholder", line), comments=True):
                if word in ("&&", ";", "&", "|"):
                    commands.append([])
                else:
                    commands[-1].append(word)
            for words in commands:
                if words[:1] == ["export"]:
                    env.update(w.split("=", 1) for w in words[1:] if "=" in w)
                    continue
                prefix = {}
                while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                    prefix.update([words.pop(0).split("=", 1)])
                if words[:1] == ["klbench"]:
                    out.append((f"{page.name}: {' '.join(words)[:90]}", words[1:], {**env, **prefix}))
    return out


COMMANDS = klbench_commands()


def overrides_of(argv: list[str]) -> tuple[list[str], bool]:
    """The command's overrides as one composition takes them, and whether it is a multirun."""
    multirun = "-m" in argv or "--multirun" in argv
    over = []
    for arg in argv:
        if arg in ("-m", "--multirun") or arg.startswith("--"):
            continue
        key, _, value = arg.partition("=")
        value = re.sub(r"\$\{?\w+\}?", "0", value)
        if key == "hydra/launcher" and value == "slurm_placeholder":
            value = "slurm_site_example"
        if "," in value and not value.startswith(("[", "{", "'", '"')) and "(" not in value:
            value = value.split(",")[0]  # a sweep over a comma list: its first trial
        over.append(f"{key}={value}" if _ else arg)
    return over, multirun


def test_the_docs_hold_the_commands_we_expect():
    """The parser finds the commands (a parser that found none would make every check below vacuous)."""
    where = " | ".join(w for w, _, _ in COMMANDS)
    assert len(COMMANDS) >= 40, where
    assert any(a == ["experiment=tabular", "estimator=token"] for _, a, _ in COMMANDS)  # the README's examples
    assert any("sweep=kl_placement" in a and "-m" in a for _, a, _ in COMMANDS)  # a quick try of a sweep
    assert any("KLBENCH_MLFLOW_URI" in env for _, _, env in COMMANDS)  # scale-out.md's store=server


@pytest.mark.parametrize("argv,env", [(a, e) for _, a, e in COMMANDS], ids=[w for w, _, _ in COMMANDS])
def test_docs_command_composes_and_validates(argv, env, tmp_path, monkeypatch):
    for key, value in env.items():
        if key != "KLBENCH_OUTPUTS":  # the test's own scratch folder instead
            monkeypatch.setenv(key, value)
    over, multirun = overrides_of(argv)
    if "--help" in argv or "--cfg" in argv:
        over = [o for o in over if not o.startswith("--")]
    GlobalHydra.instance().clear()
    try:
        cfg = compose(over, outputs=tmp_path / "outputs", hydra=True)
    finally:
        GlobalHydra.instance().clear()
    sweep = cfg.hydra.runtime.choices.get("sweep") if "runtime" in cfg.hydra else None
    assert not (sweep or "sweep=" in " ".join(argv)) or multirun, "a sweep command in the docs lacks -m"
    validate(cfg)


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run runs the README's test command as written: what CI passes is what a reader runs."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("Run the tests"):]
    command = next(line for line in shell_lines(after) if "pytest" in line).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()[-1], f"README: {command}\n.ci/run: {ci.splitlines()[-1]}"
