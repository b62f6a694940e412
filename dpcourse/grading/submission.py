"""The learner's definitions, taken from notebook cells, and what graded code may not do.

The grader runs only ``import``, ``def``, ``class`` and assignments of plain values (no
call), each cell compiled under its own name (tracebacks say ``<cell 3>``, line 12); no
top-level call ever runs in the grader's processes. :func:`policy_findings` lists what
graded code uses to reach past the exercise (the grader, the reference package, Python's
internals, torch DDP).
"""

from __future__ import annotations

import ast
import linecache

DENIED_MODULES = (
    "os", "sys", "subprocess", "gc", "inspect", "importlib", "ctypes", "builtins", "pickle",
    "marshal", "shutil", "pathlib", "io", "socket", "multiprocessing", "threading", "signal",
    "types", "code", "codeop", "runpy", "cloudpickle", "dill", "psutil", "pty", "fcntl", "mmap",
    "tempfile", "glob", "linecache", "dis", "sysconfig", "site", "atexit", "weakref",
    "faulthandler", "resource", "asyncio", "concurrent", "torch.nn.parallel", "torch._C",
    "torch.multiprocessing", "dpcourse")
DENIED_CALLS = ("exec", "eval", "compile", "__import__", "open", "globals", "vars", "locals",
                "breakpoint", "input")
DENIED_ATTRS = ("__wrapped__", "__code__", "__globals__", "__closure__", "__dict__",
                "__subclasses__", "__bases__", "__mro__", "__builtins__", "__func__", "__self__",
                "__getattribute__", "__reduce__", "__reduce_ex__", "f_back", "f_globals",
                "f_locals", "f_code", "gi_frame", "tb_frame", "cr_frame", "__loader__", "__spec__")
DENIED_NAMES = ("__builtins__", "__loader__", "__spec__", "__import__")
ALWAYS_DROPPED = {("dpcourse.grading", "check")}  # the notebook's self-check is not graded code


def _transform(source: str) -> str:
    """Turn IPython syntax (``%magic``, ``!cmd``) into Python; plain Python passes unchanged."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001 - no IPython, or a cell it cannot read: ast.parse says why
        return source


def keep(stmt: ast.stmt) -> bool:
    """True for the statements graded code consists of (definitions, imports, plain values)."""
    if isinstance(stmt, ast.ImportFrom) and stmt.level == 0:
        return not all((stmt.module, a.name) in ALWAYS_DROPPED for a in stmt.names)
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
        return not any(isinstance(n, ast.Call) for n in ast.walk(stmt.value))
    return isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import,
                             ast.ImportFrom))


def extract(sources: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[str]]:
    """Keep the definitions of each ``(label, source)`` cell, at their original line numbers.

    Returns ``(cells, problems)``: the kept source per cell, and cells that could not be parsed.
    """
    cells, problems = [], []
    for label, source in sources:
        source = _transform(source)
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            problems.append(f"{label} has a syntax error (line {exc.lineno}): {exc.msg}")
            continue
        lines = source.splitlines()
        out = [""] * len(lines)
        for stmt in tree.body:
            if not keep(stmt):
                continue
            segment = ast.get_source_segment(source, stmt) or ast.unparse(stmt)
            start = stmt.lineno - 1
            if getattr(stmt, "decorator_list", None):
                start = stmt.decorator_list[0].lineno - 1
                segment = "\n".join(lines[start:stmt.end_lineno])
            seg_lines = segment.splitlines()
            if any(out[start + i] for i in range(len(seg_lines))):
                out.append(ast.unparse(stmt))  # shares a line with another kept statement
                continue
            out[start:start + len(seg_lines)] = seg_lines
        if any(line.strip() for line in out):
            cells.append((label, "\n".join(out) + "\n"))
    return cells, problems


def defined_names(cells: list[tuple[str, str]]) -> set[str]:
    """Names bound at the top level of the kept cells."""
    names = set()
    for _, source in cells:
        for stmt in ast.parse(source).body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(stmt, ast.Assign):
                names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names.add(stmt.target.id)
    return names


def stub_message(cells: list[tuple[str, str]], name: str) -> str | None:
    """The message of ``raise NotImplementedError(...)`` when that is all ``name`` (its last
    definition, as in the kernel) or one of its methods does."""
    found = None
    for _, source in cells:
        for stmt in ast.parse(source).body:
            if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) and stmt.name == name:
                found = stmt
    if found is None:
        return None
    funcs = [found] if isinstance(found, ast.FunctionDef) else [
        s for s in found.body if isinstance(s, ast.FunctionDef)]
    for fn in funcs:
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and
                                           isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None:
            exc = body[0].exc
            call = exc if isinstance(exc, ast.Call) else None
            target = call.func if call else exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                if call and call.args and isinstance(call.args[0], ast.Constant):
                    return str(call.args[0].value)
                return f"{name} is not written yet"
    return None


def _module_denied(module: str, names: list[str], allowed: dict) -> str | None:
    if module in allowed and all(n in allowed[module] for n in names):
        return None
    for denied in DENIED_MODULES:
        if module == denied or module.startswith(denied + "."):
            return module
    if module.startswith("torch.distributed."):
        return module
    return None


def _bound(stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t)
            if isinstance(n, ast.Name)}


def _executed_nodes(stmt, reachable: bool):
    """The nodes of ``stmt`` that run: all of it if reachable, else all but function bodies."""
    if reachable:
        yield from ast.walk(stmt)
        return
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and child in node.body:
                continue
            todo.append(child)


def policy_findings(cells: list[tuple[str, str]], roots=(), allowed_imports: dict | None = None,
                    forbid_torch_ddp: bool = True) -> list[str]:
    """Return what the kept ``cells`` use that graded code may not use, with cell and line.

    Scanned: every statement that runs when the cells are loaded, and the bodies of
    functions reachable by name from ``roots`` (the graded definitions); an import counts
    only when reachable code uses its name. ``allowed_imports``: ``{module: {names}}`` an
    exercise permits; ``forbid_torch_ddp``: refuse any mention of ``DistributedDataParallel``.
    """
    allowed = allowed_imports or {}
    stmts = [(label, stmt) for label, source in cells for stmt in ast.parse(source).body]
    binders: dict[str, list[int]] = {}
    for i, (_, stmt) in enumerate(stmts):
        for name in _bound(stmt):
            binders.setdefault(name, []).append(i)
    reachable, todo = set(), [n for n in roots if n]
    while todo:
        for i in binders.get(todo.pop(), []):
            if i not in reachable:
                reachable.add(i)
                todo += [n.id for n in ast.walk(stmts[i][1]) if isinstance(n, ast.Name)]
    found = []
    for i, (label, stmt) in enumerate(stmts):
        is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
        if is_import and i not in reachable:
            continue

        def add(node, what, label=label):
            found.append(f"{label}, line {node.lineno}: {what}")

        roots_here = {n for j in reachable | {i} for n in _bound(stmts[j][1])
                      if isinstance(stmts[j][1], (ast.Import, ast.ImportFrom))}
        for node in _executed_nodes(stmt, i in reachable):
            _check_node(node, add, roots_here, allowed, forbid_torch_ddp)
    return sorted(set(found), key=found.index)


def _check_node(node, add, roots: set, allowed: dict, forbid_torch_ddp: bool) -> None:
    if forbid_torch_ddp and isinstance(node, (ast.Attribute, ast.Name, ast.alias)) and \
            "DistributedDataParallel" in (getattr(node, n, None) for n in ("attr", "id", "name")):
        add(node, "uses torch's DistributedDataParallel")
    if isinstance(node, ast.Import):
        for a in node.names:
            if m := _module_denied(a.name, [], allowed):
                add(node, f"imports {m}")
    elif isinstance(node, ast.ImportFrom):
        module = ("." * node.level) + (node.module or "")
        if node.level or _module_denied(module, [a.name for a in node.names], allowed):
            add(node, f"imports from {module}")
        for a in node.names:  # a private name imported is a private attribute read
            if a.name.startswith("_") and not a.name.startswith("__"):
                add(node, f"imports the private {module}.{a.name}")
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        fn = node.func.id
        if fn in DENIED_CALLS:
            add(node, f"calls {fn}()")
        elif fn in ("getattr", "setattr", "delattr", "hasattr") and (
                len(node.args) < 2 or not isinstance(node.args[1], ast.Constant)
                or str(node.args[1].value).startswith("_")):
            # "_x" as "__x": a name spelled as a string reaches what `.x` would be refused
            add(node, f"calls {fn}() with a computed, private or special attribute name")
    elif isinstance(node, ast.Attribute):
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if node.attr in DENIED_ATTRS:
            add(node, f"uses .{node.attr}")
        elif node.attr.startswith("_") and not node.attr.startswith("__") and \
                isinstance(root, ast.Name) and root.id in roots:
            add(node, f"uses the private {root.id}...{node.attr}")
    elif isinstance(node, ast.Name) and node.id in DENIED_NAMES:
        add(node, f"uses {node.id}")


def load(cells: list[tuple[str, str]], names: dict, builtins_table: dict) -> dict:
    """Execute the kept ``cells`` in a fresh namespace with ``builtins_table`` (whose imports
    give the grader's ``torch.distributed``); return ``{role: object or None}`` for ``names``."""

    namespace = {"__name__": "__graded__", "__builtins__": builtins_table}
    for label, source in cells:
        # inspect.getsource must find a definition's text (exercise 12's @kernel keeps it).
        linecache.cache[label] = (len(source), None, source.splitlines(True), label)
        exec(compile(source, label, "exec"), namespace)  # noqa: S102 - the graded definitions
    return {role: namespace.get(name) for role, name in names.items()}


def from_notebook(nb, before: int | None = None) -> list[tuple[str, str]]:
    """Return ``(label, source)`` for each code cell of an ``nbformat`` notebook (before cell
    index ``before``, if given)."""
    return [(f"<cell {i}>", cell.source) for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and (before is None or i < before)]
