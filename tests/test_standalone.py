"""A clone of this repository stands alone: no tracked file points outside it, links and recipe data resolve inside it.

The development setup keeps large shared files in a sibling folder (`../shared`); users never have it. Everything
the product reads by default ships in `data/` (provenance and licences in data/README.md), and the design notes in
`docs/`. Recorded training configs (recipes/artifacts/*/hispec_train.json) keep the paths they were trained with.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = b"../shared"
# tests/ may name the string (this file does); recorded training configs keep the paths they were run with.
EXEMPT = ("tests/*", "recipes/artifacts/*/hispec_train.json")
# Recipe fields that name files to read (train/heads.py and train/self_prompts.py arguments).
DATA_KEYS = ("train_file", "eval_file", "plain_text_file", "self_prompt_cues")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git checkout (no .git or no git): cannot list tracked files")
    res = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"git ls-files failed: {res.stderr.decode(errors='replace').strip()}")
    return [p for p in res.stdout.decode().split("\0") if p]


def test_no_tracked_file_outside_tests_points_at_the_dev_setups_shared_folder():
    offenders = []
    for rel in _tracked_files():
        if any(fnmatch.fnmatch(rel, pat) for pat in EXEMPT):
            continue
        path = REPO / rel
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if FORBIDDEN in data:
            lines = [i + 1 for i, line in enumerate(data.split(b"\n")) if FORBIDDEN in line]
            offenders.append(f"{rel}:{','.join(map(str, lines))}")
    assert not offenders, (f"{FORBIDDEN.decode()} is part of the development setup, not of the product; point these "
                           f"at data/ (or docs/) instead: {offenders}")


def _markdown_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()]


def test_markdown_docs_exist():
    names = {f.relative_to(REPO).as_posix() for f in _markdown_files()}
    assert {"README.md", "data/README.md", "docs/design.md"} <= names


@pytest.mark.parametrize("doc", [f.relative_to(REPO).as_posix() for f in _markdown_files()])
def test_every_relative_link_resolves_inside_the_repository(doc):
    path = REPO / doc
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s)://, mailto:, in-page anchors
        rel = target.split("#", 1)[0]
        resolved = (path.parent / rel).resolve()
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{doc}: links that do not resolve inside the repository: {broken}"


def _recipe_data_paths():
    out = []
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        cfg = yaml.safe_load(recipe.read_text()) or {}
        for key in DATA_KEYS:
            values = cfg.get(key) or []
            for value in [values] if isinstance(values, str) else values:
                out.append((recipe.name, key, str(value)))
    return out


def test_recipes_read_training_data_that_ships_in_the_repository():
    paths = _recipe_data_paths()
    assert paths, "no recipe names a data file: the check below would be vacuous"
    missing = []
    for recipe, key, value in paths:
        resolved = (REPO / value).resolve()  # recipes are run from the repository root
        if value.startswith(("/", "~")) or not resolved.is_relative_to(REPO) or not resolved.is_file():
            missing.append(f"{recipe}: {key} {value}")
    assert not missing, f"recipe data not found inside the repository: {missing}"


def test_every_shipped_data_file_is_described_in_the_data_readme():
    readme = (REPO / "data" / "README.md").read_text(encoding="utf-8")
    files = [p for p in (REPO / "data").rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    undocumented = [p.relative_to(REPO / "data").as_posix() for p in files
                    if p.relative_to(REPO / "data").as_posix() not in readme]
    assert not undocumented, f"data/README.md must give source, revision and licence of: {undocumented}"


def test_the_demo_finds_its_prompts_in_the_repository(monkeypatch):
    from conftest import load_tool

    monkeypatch.delenv("HISPEC_DATA_DIR", raising=False)
    demo = load_tool("demo")
    assert demo.default_prompts() == REPO / "data" / "eval" / "spec_bench_question.jsonl"
    assert demo.default_prompts().is_file()
