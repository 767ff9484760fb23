"""The README is the front door: the pitch, the two commands, a short tour and links, within 250 lines
(docs/style: depth belongs in docs/), and every page of docs/ is reachable from it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def test_the_readme_stays_a_front_door():
    n = len(README.splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, more than {MAX_LINES}: move depth into a docs/ page and link it"


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", README))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_the_estimator_row_lists_every_estimator_option():
    # the `estimator` row of the config-group table: its names before the first ";" are the options; the truth is
    # conf/estimator/, the list `klbench --help` prints (issue 51: frpo, k3_in_reward, kl_before, kl_fused missing)
    row = next(line for line in README.splitlines() if line.startswith("| `estimator` |"))
    listed = re.findall(r"`(\w+)`", row.split(" | ")[1].split("; ")[0])
    options = {p.stem for p in (ROOT / "conf" / "estimator").glob("*.yaml")}
    assert len(listed) == len(set(listed)), f"the README's estimator row names some option twice: {listed}"
    assert set(listed) == options, (f"README's estimator row lacks {sorted(options - set(listed))} and names "
                                    f"{sorted(set(listed) - options)}, which conf/estimator/ does not hold")
