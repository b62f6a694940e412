"""Start a throw-away JupyterLab server and find a headless Chromium, for tests/test_browser.py."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# Headless on a machine without GPU or sandbox support; the background-networking
# flags stop Chromium's own update/sync traffic, which otherwise competes for sockets.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def find_chromium() -> str | None:
    """Return the path of a Chromium binary, or None."""
    for path in (os.environ.get("DPCOURSE_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if path and os.path.exists(path):
            return path
    return shutil.which("chromium")


def free_port() -> int:
    """Return a loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(root: str, timeout: float = 60.0):
    """Run JupyterLab on loopback with a random port and token; yield its base URL and token.

    Config, data and runtime directories point into ``root`` so the server reads no
    user settings or kernels and leaves nothing behind; its kernels run this Python.
    """
    port, token = free_port(), secrets.token_hex(16)
    home = os.path.join(root, "_jupyter")
    env = dict(os.environ, JUPYTER_CONFIG_DIR=os.path.join(home, "config"),
               JUPYTER_RUNTIME_DIR=os.path.join(home, "runtime"),
               JUPYTER_DATA_DIR=os.path.join(home, "data"), JUPYTER_PREFER_ENV_PATH="1",
               IPYTHONDIR=os.path.join(home, "ipython"), JUPYTER_PLATFORM_DIRS="1",
               MPLBACKEND="module://matplotlib_inline.backend_inline")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--ServerApp.open_browser=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers run as root
    # Lab settings: start the notebook's kernel without asking, and fetch no news.
    for name, value in (("notebook-extension/tracker", {"autoStartDefaultKernel": True}),
                        ("apputils-extension/notification", {"fetchNews": "false"})):
        path = os.path.join(home, "config", "lab", "user-settings", "@jupyterlab",
                            name + ".jupyterlab-settings")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(value, f)
    log = open(os.path.join(root, "jupyter.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({proc.returncode}); see {log.name}")
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not answer within {timeout} s; see {log.name}")
                time.sleep(0.3)
        yield url, token
    finally:
        # The server and the kernels it started share its session: stop them all.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def wait_for_connected_kernel(url: str, token: str, timeout: float = 90.0) -> None:
    """Wait until the server has a kernel that is idle with a browser connected to it.

    The notebook's toolbar says "idle" before its kernel has even started; code
    run before the websocket is connected can be lost, so ask the server instead.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            reply = urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=5)
            kernels = json.load(reply)
            if any(k.get("connections", 0) >= 1 and k.get("execution_state") == "idle"
                   for k in kernels):
                return
        time.sleep(0.3)
    raise RuntimeError(f"no kernel became idle with a connected browser within {timeout} s")
