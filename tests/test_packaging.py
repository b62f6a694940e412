"""The set-up a newcomer relies on stays consistent: README commands, Makefile, CI, conda env."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

# tomllib is Python >= 3.11; on 3.10, tomli (the same parser; mypy depends on it) reads pyproject.
tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[1]


# Imported only by the NVLink kernels, on GPU machines, where torch's CUDA build brings it.
GPU_ONLY_IMPORTS = {"triton"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(spec: str) -> tuple[str, str]:
    """Split ``"Name >= 1.0"`` into ``("name", ">=1.0")``: normalized name, specifier."""
    name, rest = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(.*)", spec).groups()
    return _normalized(name), re.sub(r"\s+", "", rest)


def _environment_pip_requirements() -> list[str]:
    env = (ROOT / "environment.yml").read_text()
    pip_block = env.split("- pip:", 1)[1]
    return [line.split("#")[0] for line in re.findall(r"^\s+- (.+)$", pip_block, flags=re.M)]


def test_environment_yml_lists_exactly_pyprojects_dependencies():
    project = _project()
    wanted = sorted(_requirement(s) for s in
                    project["dependencies"] + project["optional-dependencies"]["dev"])
    listed = sorted(_requirement(s) for s in _environment_pip_requirements())
    assert listed == wanted, (f"only in pyproject: {sorted(set(wanted) - set(listed))}; "
                              f"only in environment.yml: {sorted(set(listed) - set(wanted))}")


def test_environment_yml_asks_for_the_python_pyproject_requires():
    env = (ROOT / "environment.yml").read_text()
    python = re.search(r"^\s+- python(\S*)\s*$", env, flags=re.M)
    assert python and python.group(1) == _project()["requires-python"]


def test_requirement_parsing_keeps_the_version():
    assert _requirement("jupyter_client >= 8.0") == ("jupyter-client", ">=8.0")
    assert _requirement("torch>=2.11") != _requirement("torch>=2.3")


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in dpcourse/ (also inside functions) -> files."""
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    for path in (ROOT / "dpcourse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top != "dpcourse":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _module_providers() -> dict[str, set[str]]:
    """``{top-level module: distributions that install it}``, from each distribution's files.

    ``importlib.metadata.packages_distributions()`` reads only ``top_level.txt`` on Python 3.10,
    which many wheels (numpy, cloudpickle, nbformat, ...) do not ship; the installed files
    (``RECORD``) name every module a distribution brings, on every version.
    """
    providers: dict[str, set[str]] = {}
    for dist in importlib.metadata.distributions():
        for f in dist.files or ():
            top = f.parts[0] if f.parts else ""
            name = top[:-3] if top.endswith(".py") else top
            if name.isidentifier():
                providers.setdefault(name, set()).add(dist.metadata["Name"])
    for module, dists in importlib.metadata.packages_distributions().items():
        providers.setdefault(module, set()).update(dists)
    return providers


def test_every_module_the_package_imports_is_a_main_dependency():
    """`pip install dpcourse` alone must run every command, `dpcourse grade` included."""
    declared = {_requirement(s)[0] for s in _project()["dependencies"]}
    providers = _module_providers()
    imports = _third_party_imports()
    assert {"torch", "psutil", "nbformat", "nbclient", "nbconvert"} <= set(imports)
    missing = {}
    for module, files in sorted(imports.items()):
        if module in GPU_ONLY_IMPORTS:
            continue
        dists = {_normalized(d) for d in providers.get(module, [])}
        assert dists, f"{module} (imported in {sorted(files)}) is not installed here"
        if not dists & declared:
            missing[module] = (sorted(dists), sorted(files))
    assert not missing, f"imported but not in [project] dependencies: {missing}"


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
