"""Child processes owned by a launcher: started so they die with it, watched, torn down.

* Children run in their own session (a terminal's Ctrl-C reaches only the launcher, which
  then shuts them down in order) and get ``PR_SET_PDEATHSIG=SIGKILL``: if the launcher itself
  is killed, the kernel kills them too.
* :meth:`ProcessGroup.teardown` escalates: the caller's polite request (e.g. a SHUTDOWN
  message), then SIGTERM, then SIGKILL, all under one deadline, and records how far it went.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from threading import Thread

from common.lifetime import die_with_parent

_EOL = re.compile(rb"\r\n?|\n")


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free right now (bound with port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_text(code: int) -> str:
    """``code 2``, or ``code -6 (signal SIGABRT)`` for a child killed by a signal."""
    if code >= 0:
        return f"code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    return f"code {code} (signal {name})"


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=20))
    pump: Thread | None = None  # forwards the child's stderr; ends at EOF

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_text(self) -> str:
        code = self.proc.poll()
        return "still running" if code is None else exit_text(code)

    def last_lines(self) -> str:
        """The child's last stderr lines; once it has exited, after up to 1 s for the pump to
        forward what it wrote last (its error message, usually)."""
        if self.pump is not None and self.proc.poll() is not None:
            self.pump.join(timeout=1.0)
        return "\n".join(self.tail)


class ProcessGroup:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.escalation = "none"

    def spawn(self, name: str, argv: list[str], *, stdout=None,
              env: dict[str, str] | None = None) -> Child:
        """Start a child (with ``env`` as its whole environment when given, else ours); its
        stderr is echoed to ours and the last lines kept for errors."""
        proc = subprocess.Popen(argv, stdout=stdout if stdout is not None else sys.stderr,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=die_with_parent)
        child = Child(name, proc)

        def pump() -> None:
            # Forward the child's stderr line by line with a prefix, keeping "\r" updates
            # (tqdm progress bars) as in-place updates; keep the last full lines for errors.
            assert proc.stderr is not None
            fd, buf = proc.stderr.fileno(), b""
            while chunk := os.read(fd, 65536):
                buf += chunk
                while (m := _EOL.search(buf)) is not None:
                    text = buf[: m.start()].decode(errors="replace")
                    term = buf[m.start(): m.end()].decode()
                    buf = buf[m.end():]
                    if term == "\n" and text.strip():
                        child.tail.append(text)
                    # a log line already carrying this role (common/logs.py) keeps one prefix
                    tagged = not text or f"[{name}]" in text
                    sys.stderr.write(f"{text}{term}" if tagged else f"[{name}] {text}{term}")
                sys.stderr.flush()
            if buf:
                text = buf.decode(errors="replace")
                child.tail.append(text)
                print(f"[{name}] {text}", file=sys.stderr, flush=True)
            proc.stderr.close()

        child.pump = Thread(target=pump, daemon=True, name=f"stderr-{name}")
        child.pump.start()
        self.children.append(child)
        return child

    def failed(self) -> Child | None:
        """The first child that exited with a non-zero code, if any."""
        for c in self.children:
            code = c.proc.poll()
            if code is not None and code != 0:
                return c
        return None

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is None]

    def wait_all(self, children: list[Child], deadline: float) -> bool:
        for c in children:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                c.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def teardown(self, timeout_s: float, polite=None) -> None:
        """Stop every child within ``timeout_s``: ``polite()`` first, then SIGTERM, SIGKILL."""
        deadline = time.monotonic() + timeout_s
        if polite is not None and self.alive():
            try:
                polite()
            except Exception:
                pass
            if self.wait_all(self.alive(), time.monotonic() + timeout_s / 2):
                self.escalation = "polite"
        if self.alive():
            self.escalation = "sigterm"
            for c in self.alive():
                c.proc.send_signal(signal.SIGTERM)
            self.wait_all(self.alive(), deadline)
        if self.alive():
            self.escalation = "sigkill"
            for c in self.alive():
                c.proc.kill()
            self.wait_all(self.alive(), time.monotonic() + 5)
        for c in self.children:
            c.proc.poll()


