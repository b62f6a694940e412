"""Keep the course package's files as they were when grading started.

Notebook code can write to disk. Before each notebook's checks run, every file
of the installed ``dpcourse`` package is compared with the copy taken at the
start of the run; a changed, added or removed file is put back (compiled
caches are simply removed, Python rebuilds them) and reported, so an edited
grader never grades this notebook or any later one.
"""

from __future__ import annotations

import contextlib
import os

import dpcourse

ROOT = os.path.dirname(os.path.abspath(dpcourse.__file__))


def _walk(root: str) -> dict[str, bytes]:
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError), open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


class PackageSnapshot:
    """The bytes of every file under the package, taken now."""

    def __init__(self, root: str = ROOT):
        self.root = root
        self.files = _walk(root)

    def restore(self) -> list[str]:
        """Put back what changed since the snapshot; return the source files that had changed."""
        now, changed = _walk(self.root), []
        for rel in sorted(set(now) | set(self.files)):
            was, path = self.files.get(rel), os.path.join(self.root, rel)
            if now.get(rel) == was:
                continue
            if "__pycache__" not in rel:
                changed.append(rel)
            elif rel not in now:
                continue
            if was is None or "__pycache__" in rel:
                # A cache may be forged to match its source's size and time: drop any
                # written since (Python compiles the source again on the next import).
                with contextlib.suppress(OSError):
                    os.remove(path)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with contextlib.suppress(OSError):  # a file the notebook made read-only
                os.chmod(path, 0o644)
            with open(path, "wb") as f:
                f.write(was)
        return changed
