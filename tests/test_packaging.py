"""The set-up a newcomer relies on stays consistent: README commands, Makefile, CI, conda env."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def _names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", s.strip(), maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_environment_yml_has_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"] + project["optional-dependencies"]["dev"])
    env = (ROOT / "environment.yml").read_text()
    pip_block = env.split("- pip:", 1)[1]
    listed = _names(re.findall(r"^\s+- (\S+)\s*$", pip_block, flags=re.M))
    assert listed == wanted, f"only in pyproject: {wanted - listed}; only in environment.yml: {listed - wanted}"


def test_readme_opens_with_the_two_make_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make course", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^course:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\s*$", ci, flags=re.M), "CI must run the README's test command"


def test_console_script_points_at_the_cli():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["dpcourse"] == "dpcourse.cli:main"
    from dpcourse.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"doctor", "launch", "demo"} <= set(sub.choices)
