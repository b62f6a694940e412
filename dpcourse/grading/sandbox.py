"""The operating-system sandbox every process that runs graded code starts in (bubblewrap).

``dpcourse grade`` runs the notebook's kernel and every rank under ``bwrap``
(https://github.com/containers/bubblewrap), each in fresh namespaces of its own:

* a PID namespace and a new session: the grader and the other graded processes are
  not visible, so they cannot be signalled, ptraced or read through ``/proc``; no
  capabilities, and no further user namespaces. What graded code sees there is its
  own processes and bwrap's pid 1 (the same user, no capabilities, an empty
  environment), which it may ptrace where the kernel's ptrace rules allow: that gives
  nothing, as pid 1 holds ``/dev/null``, the output the graded process holds too, and
  the eventfd through which it reports the exit status, whose writing ends the sandbox
  as exiting does;
* a network namespace with only its own loopback: no Internet, no DNS, no port of
  the machine. The grader's channel is a file descriptor the process inherits (a
  rank's socket pair) or a Unix socket in its scratch folder (the kernel's ZeroMQ
  ``ipc`` transport), neither of which needs a network;
* a mount namespace that shows the operating system's ``/usr`` and the Python
  installation read-only, a copy of the course package without the grader's own
  modules (:func:`package_copy`) read-only, a private ``/tmp`` and ``/dev/shm``, and
  one writable folder, its scratch. The checkout (``solutions/``, the grader's
  package), the grader's files and the other submissions are not there at all.

Each rank gets its own scratch, so ranks share nothing on disk.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from dpcourse.launch.env import package_root

# Modules of the grader that graded code never needs: the answers (and every check's
# ``*_verdicts.py``), the judging of whole notebooks, and the reports. Left out of the
# copy the sandbox sees.
GRADER_ONLY = ("grading/oracles.py", "grading/autograde.py", "grading/gradebook.py",
               "grading/executor.py", "grading/make_exercises.py",
               "grading/sandbox.py")
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group",
        "/etc/nsswitch.conf", "/etc/localtime", "/etc/alternatives")
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM")
_ENV = "/usr/bin/env"  # coreutils: starts bwrap with an empty environment (see command)


class SandboxUnavailable(RuntimeError):
    """This machine cannot start the sandbox; the message says why."""


def package_copy(dest: str) -> str:
    """Copy the course package's sources, less :data:`GRADER_ONLY`, under ``dest``; return it."""
    src = os.path.join(package_root(), "dpcourse")
    for folder, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        rel = os.path.relpath(folder, src)
        os.makedirs(os.path.join(dest, "dpcourse", rel), exist_ok=True)
        for name in names:
            key = os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/")
            if name.endswith((".pyc", ".pyo", "_verdicts.py")) or key in GRADER_ONLY:
                continue
            shutil.copy2(os.path.join(folder, name), os.path.join(dest, "dpcourse", rel, name))
    return dest


def _installed() -> bool:
    return os.path.basename(package_root()) in ("site-packages", "dist-packages")


def _python_paths() -> list[str]:
    """The interpreter's prefixes and site-packages, none of them the checkout: never the current
    directory or other ``sys.path`` entries, which may be the instructor's own folders."""
    pkg = os.path.join(package_root(), "dpcourse")
    installed = _installed()
    found = []
    site = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    for p in [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
              *site]:
        if not p or not os.path.isdir(p):
            continue
        p = os.path.realpath(p)
        # A path above the package of a checkout (on PYTHONPATH, say) would show solutions/;
        # an installed package is hidden under its site-packages instead (see command).
        above = (pkg + os.sep).startswith(p.rstrip(os.sep) + os.sep)
        if (above and not installed) or p.startswith("/usr/"):
            continue
        if not any(p == q or p.startswith(q + os.sep) for q in found):
            found = [q for q in found if not q.startswith(p + os.sep)] + [p]
    return found


def _knows(bwrap: str, option: str) -> bool:
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in text.stdout + text.stderr


def unavailable() -> str | None:
    """Why the sandbox cannot run on this machine, or ``None`` when it can."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox (bubblewrap) needs Linux; this is {sys.platform}"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ("bubblewrap (bwrap) is not installed: install it (Debian/Ubuntu: apt-get install "
                "bubblewrap)")
    probe = Sandbox(bwrap, "/nonexistent", _knows(bwrap, "--disable-userns")).command(
        ["/bin/true"], "/")
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not start ({exc})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"bubblewrap cannot create its namespaces here ({last}): user namespaces may be "
                "disabled (sysctl kernel.unprivileged_userns_clone, or a container without them)")
    return None


@dataclass
class Sandbox:
    """How to start one graded process under ``bwrap``, importing ``package``'s copy of
    ``dpcourse`` (:func:`package_copy`); ``disable_userns``: forbid further user namespaces
    inside (bubblewrap 0.8 and later; without it the binds are still read-only inside)."""

    bwrap: str
    package: str
    disable_userns: bool = True

    def command(self, argv: list[str], scratch: str, env: dict | None = None,
                shared: tuple[str, ...] = ()) -> list[str]:
        """Return ``argv`` wrapped to run in a fresh sandbox whose only writable folder is ``scratch``.

        ``scratch`` keeps its own path inside (so Unix sockets and files in it have one
        name on both sides) and is the working directory. ``env`` is the whole environment
        inside (plus ``HOME``, ``TMPDIR`` and ``PYTHONPATH``, set here). ``shared``: further
        writable folders, at their own paths (one the grader gives several ranks on purpose).
        """
        # bwrap stays in the sandbox as its pid 1 (it reaps, and reports the exit status
        # through an eventfd), and there /proc/1/environ shows the environment bwrap
        # started with: start it with none, or the grader's (its secrets, the kernel
        # launcher's JPY_PARENT_PID) is readable inside. --clearenv clears only the
        # command's own.
        cmd = [_ENV, "-i", self.bwrap, "--unshare-all", "--die-with-parent", "--new-session",
               "--unshare-user", "--cap-drop", "ALL",
               *(["--disable-userns"] if self.disable_userns else []), "--clearenv",
               "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev",
               "--tmpfs", "/dev/shm", "--tmpfs", "/tmp"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                cmd += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                cmd += ["--ro-bind", top, top]
        for path in _ETC:
            cmd += ["--ro-bind-try", path, path]
        gpus = sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri/renderD*"))
        for path in gpus:  # CUDA's device files; NCCL reads the topology under /sys
            cmd += ["--dev-bind", path, path]
        if gpus:
            cmd += ["--ro-bind-try", "/sys", "/sys"]
        for path in _python_paths():
            cmd += ["--ro-bind", path, path]
        if _installed():  # graded code imports the copy below, never the grader's own files
            cmd += ["--tmpfs", os.path.join(package_root(), "dpcourse")]
        if os.path.isdir(self.package):
            cmd += ["--ro-bind", self.package, self.package]
        for path in shared:
            cmd += ["--bind", path, path]
        cmd += ["--bind", scratch, scratch, "--chdir", scratch]
        inside = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
        inside.update(env or {})
        inside.update(HOME=scratch, TMPDIR="/tmp", PYTHONPATH=self.package,
                      PYTHONNOUSERSITE="1")
        for key, value in sorted(inside.items()):
            cmd += ["--setenv", key, value]
        return cmd + ["--", *argv]


@contextlib.contextmanager
def prepared():
    """Yield a :class:`Sandbox` with its own copy of the package, removed at the end
    (:class:`SandboxUnavailable` says why bubblewrap cannot run here)."""
    why = unavailable()
    if why is not None:
        raise SandboxUnavailable(why)
    folder = tempfile.mkdtemp(prefix="dpcourse-sandbox-")
    try:
        package_copy(folder)
        bwrap = shutil.which("bwrap")
        yield Sandbox(bwrap, folder, _knows(bwrap, "--disable-userns"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
