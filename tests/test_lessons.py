"""What every committed lesson must hold, checked on the notebooks' files (nothing is executed).

* every lesson (any ``lessons/NN_*.ipynb``) asserts something in a code cell, and its
  committed outputs carry no error;
* no committed output of a lesson, solution or exercise shows where or on what it ran:
  absolute paths, process ids, this machine's host name, kernel release or CPU model;
* the README's claim table lists the twelve claims, each with a lesson and a cell tag, and
  every tag it names (in a lesson that carries claim tags) is on a cell that asserts.
"""

from __future__ import annotations

import ast
import pathlib
import platform
import re
import socket

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
NOTEBOOKS = sorted(p for folder in ("lessons", "solutions", "exercises")
                   for p in (ROOT / folder).glob("[0-9][0-9]_*.ipynb"))
NUM_CLAIMS = 30


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _read(path: pathlib.Path):
    return nbformat.read(path, as_version=4)


def _has_assert(source: str) -> bool:
    """Whether a code cell holds an ``assert`` statement (IPython magics and shell lines ignored)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())
    try:
        return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(code)))
    except SyntaxError:
        return re.search(r"^\s*assert\b", code, re.M) is not None


def _output_text(output) -> str:
    """The text of one cell output, in every textual form it was saved in."""
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    if output.get("output_type") == "error":
        return "\n".join([output.get("ename", ""), output.get("evalue", ""),
                          *output.get("traceback", [])])
    data = output.get("data", {})
    return "\n".join("".join(v) for k, v in data.items()
                     if isinstance(v, (str, list)) and (k.startswith("text/") or k.endswith("json")))


# A path is absolute when it starts a word: not after a letter, digit, "/", "." or ":"
# (so "https://host/home/x" and "lessons/tmp/x" are not paths to this machine).
_ABSOLUTE_PATH = re.compile(
    r"(?<![\w/.:~-])(/work|/home|/root|/tmp|/private|/var/folders|/Users|/opt|/usr)/|site-packages")
# A process id shown as a field ("pid=1234", "'pid': 1234", "process id 1234") or as a table
# column (a header line of bare words that includes "pid"); code such as
# `pid = tl.program_id(0)` is neither.
_PID_FIELD = re.compile(r"\b(pids?|process ids?)\b['\"]?\s*[:=]?\s*(?:(?:is|was|are)\s+)?\d{2,}", re.I)
_BARE_WORD = re.compile(r"^[\w./%-]+$")


class _PidPattern:
    """Find a process id in text (same ``search`` interface as a compiled pattern)."""

    def search(self, text: str):
        m = _PID_FIELD.search(text)
        if m:
            return m
        for header in re.finditer(r"^.*\bpid\b.*$", text, re.M | re.I):
            tokens = header[0].split()
            if any(t.lower() == "pid" for t in tokens) and all(_BARE_WORD.match(t) for t in tokens):
                return header
        return None


_PID = _PidPattern()
_PLATFORM_STRING = re.compile(r"\b(Linux|Darwin|macOS|Windows)-\d+\.\d+")
_CPU_NAME = re.compile(r"Intel\(R\)|\bXeon\b|\bAMD (EPYC|Ryzen|Opteron)\b|\bApple M\d\b")
_GENERIC_NAMES = {"localhost", "cpu", "gpu", "cuda", "main", "node"}


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _machine_words() -> dict[str, re.Pattern]:
    """This machine's identifying strings, as whole-word patterns."""
    words = {"host name": socket.gethostname(), "node name": platform.node(),
             "kernel release": platform.release(), "CPU model": _cpu_model()}
    return {what: re.compile(rf"(?<![\w.]){re.escape(w)}(?!\w)")
            for what, w in words.items() if w and w.lower() not in _GENERIC_NAMES}


def leaks(text: str) -> list[str]:
    """Name what ``text`` reveals about the machine that produced it (empty: nothing)."""
    found = []
    for what, pattern in [("absolute path", _ABSOLUTE_PATH), ("process id", _PID),
                          ("platform string", _PLATFORM_STRING), ("CPU model", _CPU_NAME),
                          *_machine_words().items()]:
        m = pattern.search(text)
        if m:
            context = text[max(0, m.start() - 40):m.end() + 40].replace("\n", "\\n")
            found.append(f"{what}: ...{context}...")
    return found


def test_leak_patterns_catch_leaks_and_spare_urls():
    """The leak check itself: it catches this machine's strings, and not URLs or relative paths."""
    assert leaks(f"+ {ROOT}/.venv/bin/python -m torch.distributed.run /tmp/tmpab12/x.py")
    assert leaks("rank  pid\n   0  11168")
    assert leaks("{'rank': 0, 'pid': 11168}") and leaks("this notebook's process id is 11103")
    assert not leaks("    pid = tl.program_id(0)\n    step = tl.num_programs(0)")
    assert leaks("platform  Linux-6.1.0-x86_64-with-glibc2.36")
    assert leaks('File ".venv/lib/python3.11/site-packages/torch/x.py"')
    assert leaks(f"running on {socket.gethostname()} today") or socket.gethostname().lower() in _GENERIC_NAMES
    assert leaks(f"kernel {platform.release()}") or not platform.release()
    assert not leaks("see https://pytorch.org/docs/stable/distributed.html and http://example.com/home/a")
    assert not leaks("lessons/01_why_data_parallel.ipynb, ../exercises/04_ring_all_reduce.ipynb, a/tmp/b")
    assert not leaks("rank 0 of 2 on cuda:0 (NVIDIA H200), speedup 0.93")


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lesson_asserts_its_claims(path):
    """A lesson proves what it says: at least one code cell asserts."""
    cells = [c for c in _read(path).cells if c.cell_type == "code"]
    assert any(_has_assert(c.source) for c in cells), (
        f"{path.name} has no assert in any code cell: assert its key claims in the cells that show them.")


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lesson_outputs_have_no_errors(path):
    """Committed lesson outputs come from a clean run."""
    errors = [f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
              for i, c in enumerate(_read(path).cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name} was committed with error outputs: {errors}; re-run it cleanly."


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_outputs_do_not_leak_the_machine(path):
    """Committed outputs show no paths, pids, host, kernel or CPU names of the machine that ran them."""
    found = [f"cell {i}: {leak}" for i, c in enumerate(_read(path).cells) if c.cell_type == "code"
             for o in c.get("outputs", []) for leak in leaks(_output_text(o))]
    assert not found, (f"{path.relative_to(ROOT)} shows this machine in its outputs "
                       "(print relative names, drop pids and platform details):\n" + "\n".join(found))


def claim_table() -> list[dict]:
    """Rows of the README's claim table: ``claim`` number, ``lesson`` (e.g. "01"), ``tag``."""
    text = (ROOT / "README.md").read_text()
    rows = []
    for line in text.splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|.*\|\s*\[?(\d\d)\b[^|]*\|\s*`?(claim-\d+)`?\s*\|\s*$", line)
        if m:
            rows.append(dict(claim=int(m[1]), lesson=m[2], tag=m[3]))
    return rows


def _claim_tags(path) -> dict[str, list]:
    """Claim tags of a notebook -> the cells that carry them."""
    tags = {}
    for cell in _read(path).cells:
        for tag in cell.metadata.get("tags", []):
            if tag.startswith("claim-"):
                tags.setdefault(tag, []).append(cell)
    return tags


def test_readme_claim_table_lists_every_claim_once():
    rows = claim_table()
    assert sorted(r["claim"] for r in rows) == list(range(1, NUM_CLAIMS + 1)), (
        f"README's claim table must list claims 1..{NUM_CLAIMS} once each, found {rows}")
    assert all(r["tag"] == f"claim-{r['claim']}" for r in rows), rows
    lessons = {p.name[:2] for p in LESSONS}
    assert all(r["lesson"] in lessons for r in rows), f"claim table names a lesson that does not exist: {rows}"


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_claim_tags_match_the_readme(path):
    """In a lesson that tags claims, every claim the README places there is tagged on an asserting cell."""
    tags = _claim_tags(path)
    if not tags:
        pytest.skip(f"{path.name} tags no claim cells")
    listed = {r["tag"] for r in claim_table() if path.name.startswith(r["lesson"] + "_")}
    missing = sorted(listed - set(tags))
    assert not missing, f"README places {missing} in {path.name}, which has no cell tagged so."
    unlisted = sorted(set(tags) - listed)
    assert not unlisted, f"{path.name} tags {unlisted}; the README's claim table must place them here."
    silent = sorted(t for t, cells in tags.items()
                    if not any(c.cell_type == "code" and _has_assert(c.source) for c in cells))
    assert not silent, f"{path.name}: cells tagged {silent} must assert the claim in code."
