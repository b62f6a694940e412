"""Load a notebook's code cells as a module, so that tests can call its definitions."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types


def notebook_module(notebook: pathlib.Path, path: pathlib.Path) -> types.ModuleType:
    """Write ``notebook``'s code cells (without ``check(`` calls) to ``path`` and import it.

    The module is registered in ``sys.modules`` under ``path.stem``, because
    ``check()`` reads the definitions' source from their file; the caller removes it.

    Args:
        notebook: the ``.ipynb`` file.
        path: the ``.py`` file to write (its stem is the module's name).
    """
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    path.write_text("\n\n".join(c.source for c in nb.cells
                                if c.cell_type == "code" and "check(" not in c.source))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[path.stem]
        raise
    return module
