"""Real child processes for tests: started with a deadline, stopped, exit codes checked.

A failing child fails the test with its last stderr lines (the model: PyG's
``testing/distributed.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.sockets import new_token_file  # noqa: E402

DDP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 right now (held open together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's DDP variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DDP_ENV}
    env.update(extra)
    return env


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no output>"


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process, each waited for up to ``timeout``; any still
    running afterwards (a failure or a deadline) is killed and reaped."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return outs


def run_cli(module: str, args: list[str], timeout: float, cwd: Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` to completion under a timeout."""
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or REPO, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} exited with {proc.returncode}; stderr tail:\n"
                             f"{proc.stderr[-4000:]}")
    return proc


class ServerProcess:
    _terminated = False  # terminate() sent its SIGTERM (class default: subclasses too)

    def __init__(self, parts: Path, part_id: int, endpoint: str, cluster: Path | None,
                 workdir: Path, extra: list[str], prefix: list[str] | None = None):
        self.endpoint = endpoint
        self.ready = workdir / f"ready-{part_id}-{id(self)}"
        self.log = workdir / f"server-{part_id}-{id(self)}.log"
        token_file = workdir / f"token-{part_id}-{id(self)}"
        self.token = new_token_file(token_file)  # Shutdown(token=server.token) stops it
        argv = [*(prefix or []), sys.executable, "-m", "sampler_server.main", "--parts", str(parts),
                "--part-id", str(part_id), "--bind", endpoint, "--ready-file", str(self.ready),
                "--shutdown-token-file", str(token_file), *extra]
        if cluster is not None:
            argv += ["--cluster", str(cluster)]
        self.checked = False  # set once stop_and_check ran (the fixture skips it then)
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} during "
                                     f"startup:\n{tail(self.log)}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"server not ready within {timeout}s:\n{tail(self.log)}")
            time.sleep(0.05)
        self.endpoint = self.ready.read_text().strip() or self.endpoint

    def terminate(self) -> None:
        """SIGTERM, once: a second one could land while the server is already exiting, after
        Python has put the default handlers back, and kill it (exit -15) mid-teardown."""
        if not self._terminated and self.proc.poll() is None:
            self._terminated = True
            self.proc.terminate()

    def stop_and_check(self, timeout: float = 20.0, expect_code: int | None = 0) -> int:
        """SIGTERM (no-op if already gone), wait, and assert the exit code (None: any)."""
        self.checked = True
        self.terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"server did not stop within {timeout}s of SIGTERM:\n"
                                 f"{tail(self.log)}") from None
        finally:
            self._log_file.close()
        if expect_code is not None and code != expect_code:
            raise AssertionError(f"server exited with {code}:\n{tail(self.log)}")
        return code


def stop_all(servers: list[ServerProcess]) -> None:
    """Stop every server not stopped and checked yet, then raise the first failure (so one
    bad exit does not leave the others running)."""
    errors = []
    for s in servers:
        if s.checked:
            continue
        try:
            s.stop_and_check()
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]
