"""Exercise 16 (clipping sharded gradients): the solution scores full marks, the stub nothing,
and each planted mistake fails the criterion that names it, with its hint.
"""

import pathlib
import textwrap

import nbformat
import pytest

from dpcourse.grading.checks import get_spec
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract, from_notebook

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = "16_torch_tools.ipynb"

PLANTED = textwrap.dedent('''
    import math
    import torch
    import torch.distributed as dist


    def _scale(shards, total, max_norm):
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            s.mul_(factor)
        return total


    def local_norm_only(shards, max_norm, norm_type=2.0, group=None):
        """Clips by this rank's own norm: no communication."""
        return _scale(shards, torch.cat(shards).norm(), max_norm)


    def sum_of_norms(shards, max_norm, norm_type=2.0, group=None):
        """Adds the ranks' norms instead of their squares."""
        local = torch.cat(shards).norm().reshape(1)
        dist.all_reduce(local, group=group)
        return _scale(shards, local[0], max_norm)


    def gathers_every_shard(shards, max_norm, norm_type=2.0, group=None):
        """Right numbers, but the whole gradient crosses the wire."""
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = torch.cat(shards)
        every = torch.zeros(n * mine.numel())
        every[rank * mine.numel():(rank + 1) * mine.numel()] = mine
        dist.all_reduce(every, group=group)
        if float(norm_type) == math.inf:
            return _scale(shards, every.abs().max(), max_norm)
        return _scale(shards, every.norm(), max_norm)


    def inf_by_sum(shards, max_norm, norm_type=2.0, group=None):
        """The infinity norm's partial maxima added up."""
        if float(norm_type) == math.inf:
            local = torch.cat(shards).abs().max().reshape(1)
            dist.all_reduce(local, group=group)
            return _scale(shards, local[0], max_norm)
        local = torch.cat(shards).pow(2).sum().reshape(1)
        dist.all_reduce(local, group=group)
        return _scale(shards, local[0].sqrt(), max_norm)


    def never_capped(shards, max_norm, norm_type=2.0, group=None):
        """Scales by max_norm / norm even when that is above 1."""
        if float(norm_type) == math.inf:
            local = torch.cat(shards).abs().max().reshape(1)
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            total = local[0]
        else:
            local = torch.cat(shards).pow(2).sum().reshape(1)
            dist.all_reduce(local, group=group)
            total = local[0].sqrt()
        for s in shards:
            s.mul_(max_norm / (total + 1e-6))
        return total
''')


def _planted(name, world_sizes=(2,)):
    spec = get_spec("clip_sharded")
    spec.world_sizes = world_sizes
    cells, _ = extract([("<planted>", PLANTED)])
    return run_check(spec, cells, {"main": name})


def _notebook(folder):
    nb = nbformat.read(ROOT / folder / NOTEBOOK, as_version=4)
    cells, _ = extract(from_notebook(nb))
    spec = get_spec("clip_sharded")
    return run_check(spec, cells, spec.roles)


def test_solution_passes_every_criterion_on_2_and_3_ranks():
    result = _notebook("solutions")
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}
    assert result.score == 1.0


def test_unmodified_exercise_scores_zero():
    result = _notebook("exercises")
    assert result.score == 0
    assert any("not implemented yet: Exercise 16." in n for n in result.notes)


def test_own_norm_is_named_and_the_hint_says_squares_add():
    result = _planted("local_norm_only")
    crit = result.criterion("total_norm")
    assert not crit.passed and "this rank's own shards' norm" in crit.detail
    assert "squares" in crit.hint
    assert "clips_shards" in result.failed()


def test_adding_norms_fails_the_total_norm():
    result = _planted("sum_of_norms")
    assert "total_norm" in result.failed() and "their squares do" in result.criterion("total_norm").hint


def test_moving_the_whole_gradient_passes_the_numbers_and_fails_one_scalar():
    result = _planted("gathers_every_shard")
    assert result.failed() == ["one_scalar"], result.failed()
    assert "all_reduce of" in result.criterion("one_scalar").detail


def test_summing_partial_maxima_fails_only_the_infinity_norm():
    result = _planted("inf_by_sum")
    assert result.failed() == ["inf_norm"], result.failed()
    assert "MAX" in result.criterion("inf_norm").hint


def test_an_uncapped_factor_fails_below_max_norm():
    result = _planted("never_capped")
    assert result.failed() == ["no_clip_below"], result.failed()
    assert "capped at 1" in result.criterion("no_clip_below").hint


@pytest.mark.parametrize("path", ["lessons/16_torch_tools.ipynb"])
def test_lesson_links_the_exercise(path):
    text = (ROOT / path).read_text()
    assert "exercises/16_torch_tools.ipynb" in text and (ROOT / "exercises" / NOTEBOOK).exists()
