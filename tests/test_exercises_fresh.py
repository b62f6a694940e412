"""exercises/ must be exactly what solutions/ generate: regenerate in memory and compare."""

import pathlib

import pytest

from dpcourse.grading import make_exercises

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_every_solution_has_an_exercise():
    assert SOLUTIONS, "solutions/ holds no notebook"
    missing = [s.name for s in SOLUTIONS if not (ROOT / "exercises" / s.name).exists()]
    assert not missing, f"no exercise for {missing}: run python -m dpcourse.grading.make_exercises"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_is_up_to_date(solution):
    exercise = ROOT / "exercises" / solution.name
    assert exercise.read_text() == make_exercises.render(str(solution)), (
        f"exercises/{solution.name} is stale: run python -m dpcourse.grading.make_exercises")


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_stubs_every_region_and_has_no_outputs(solution):
    import nbformat

    sol = nbformat.read(solution, as_version=4)
    ex = nbformat.read(ROOT / "exercises" / solution.name, as_version=4)
    regions = sum(c.source.count(make_exercises.BEGIN) for c in sol.cells if c.cell_type == "code")
    stubs = [line.strip() for c in ex.cells if c.cell_type == "code" for line in c.source.splitlines()
             if "raise NotImplementedError(\"Exercise" in line]
    assert regions >= 1 and len(stubs) == regions
    assert stubs[0].startswith(f'raise NotImplementedError("Exercise {solution.name[:2]}.1: write ')
    assert all(not c.get("outputs") for c in ex.cells if c.cell_type == "code")
    kept = [c for c in sol.cells if make_exercises.SOLUTION_TAG not in c.metadata.get("tags", [])]
    assert [(c.cell_type, c.source.splitlines()[:1]) for c in ex.cells if c.cell_type == "markdown"] \
        == [(c.cell_type, c.source.splitlines()[:1]) for c in kept if c.cell_type == "markdown"]
    assert [c.cell_type for c in ex.cells] == [c.cell_type for c in kept]


def test_discussions_that_name_the_answer_stay_in_the_solutions():
    import nbformat

    tagged = {}
    for solution in SOLUTIONS:
        cells = nbformat.read(solution, as_version=4).cells
        tagged[solution.name] = [c.source for c in cells
                                 if make_exercises.SOLUTION_TAG in c.metadata.get("tags", [])]
        exercise = nbformat.read(ROOT / "exercises" / solution.name, as_version=4)
        assert not set(tagged[solution.name]) & {c.source for c in exercise.cells}
    # e.g. exercise 07's closing note says how many all-reduces the fix costs
    assert all(tagged[n] for n in ("01_why_data_parallel.ipynb", "07_gradient_accumulation.ipynb",
                                   "08_real_training_run.ipynb")), tagged
