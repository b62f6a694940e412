"""The hardware matrix lists every lesson, solution and the demo, and joins machines into one table."""

from __future__ import annotations

import pathlib

import hardware_matrix as hm

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_lesson_solution_and_the_demo_is_an_item():
    names = [name for name, _ in hm.items()]
    for folder in ("lessons", "solutions"):
        for nb in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            assert f"{folder}/{nb.name}" in names
    assert "tests -m gpu" in names and "dpcourse launch -m dpcourse.demo" in names


def test_files_of_one_machine_join_and_machines_become_columns():
    one = {"label": "1 x GPU"}
    two = {"label": "2 x GPU"}
    files = [
        {"machine": one, "rows": [{"item": "lessons/00", "result": "pass", "wall_s": 3.0}]},
        {"machine": one, "rows": [{"item": "solutions/01", "result": "fail", "wall_s": 4.4}]},
        {"machine": two, "rows": [{"item": "lessons/00", "result": "fail", "wall_s": 2.0}]},
        {"machine": two, "rows": [{"item": "lessons/00", "result": "pass", "wall_s": 2.0}]},  # rerun
    ]
    table = hm.combined(files).splitlines()
    assert table[0] == "| item | 1 x GPU | 2 x GPU |"
    assert table[2] == "| lessons/00 | pass (3 s) | pass (2 s) |"
    assert table[3] == "| solutions/01 | fail (4 s) | not run |"
    assert len(table) == 4
