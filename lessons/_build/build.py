"""Build the lesson notebooks from their plain-text sources (and optionally run them).

Each ``lessons/_build/NN_topic.txt`` holds the cells of ``lessons/NN_topic.ipynb``,
separated by lines ``#%% md`` (markdown) or ``#%% code``. Keeping the source as
text makes review and diffs readable; the committed notebooks carry the outputs
of a clean run.

A marker line may carry options after the kind:

* ``answer``: the cell starts collapsed (``metadata.jupyter.source_hidden``), for the
  answer to a question the learner should predict first: ``#%% md answer``.
* ``tags=a,b``: cell tags, e.g. ``#%% code tags=claim-1`` for the cell that asserts a
  claim listed in the README's claim table.

Usage::

    python lessons/_build/build.py                 # write every notebook (no outputs)
    python lessons/_build/build.py --execute 03    # write and run the lessons matching "03"
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
LESSONS = HERE.parent
MARKER = "#%%"


def parse_marker(line: str) -> tuple[str, dict]:
    """Read a marker line: return the cell kind and the cell's metadata."""
    kind, *options = line[len(MARKER):].split()
    if kind not in ("md", "code"):
        raise ValueError(f"unknown cell kind {kind!r} in {line!r}: use '#%% md' or '#%% code'.")
    metadata = {}
    for option in options:
        if option == "answer":
            metadata["jupyter"] = {"source_hidden": True}
        elif option.startswith("tags=") and option[len("tags="):]:
            metadata["tags"] = option[len("tags="):].split(",")
        else:
            raise ValueError(f"unknown option {option!r} in {line!r}: use 'answer' or 'tags=a,b'.")
    return kind, metadata


def parse(text: str) -> list:
    """Split a lesson source into notebook cells."""
    cells, kind, metadata, lines = [], None, {}, []

    def flush():
        body = "\n".join(lines).strip("\n")
        if kind and body:
            make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
            cells.append(make(body, metadata=metadata))

    for line in text.splitlines():
        if line.startswith(MARKER):
            flush()
            (kind, metadata), lines = parse_marker(line), []
        else:
            lines.append(line)
    flush()
    return cells


def build(src: pathlib.Path) -> pathlib.Path:
    """Write the notebook for one source file; return its path."""
    nb = nbformat.v4.new_notebook()
    nb.cells = parse(src.read_text())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    out = LESSONS / (src.stem + ".ipynb")
    nbformat.write(nb, out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="build only sources whose name contains one of these")
    parser.add_argument("--execute", action="store_true", help="run each notebook in place after writing it")
    args = parser.parse_args(argv)
    for src in sorted(HERE.glob("[0-9][0-9]_*.txt")):
        if args.only and not any(o in src.name for o in args.only):
            continue
        out = build(src)
        if args.execute:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook",
                            "--execute", "--inplace", "--ExecutePreprocessor.timeout=300", str(out)],
                           check=True, cwd=LESSONS)
            print(f"{out.name}: executed in {time.perf_counter() - t0:.1f} s")
        else:
            print(f"{out.name}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
