"""The cluster launch scripts (deploy/ssh/launch.sh, deploy/slurm/mfgserve.sbatch) run for real.

No cluster here, so the two programs they drive are replaced by tiny shims placed first on
PATH, and every "host" is a network namespace (tests/netns.py; 127.0.0.x addresses on this
host where namespaces are refused):

* ``ssh HOST CMD``: runs CMD with ``bash -c`` in HOST's namespace, with a fresh environment
  and its stdin fed from the shim's own stdin -- so, as with a real ssh connection, the
  remote side sees end-of-file when the client exits or is killed;
* ``srun --nodelist=NODE ... CMD``: runs CMD in NODE's namespace with SLURM's per-task
  variables, forwards SIGTERM/SIGINT to it, exits with its code; ``scontrol show hostnames``
  splits a comma-separated node list.

Everything else is real: server-node, torchrun, trainer-client, TCP between namespaces. Checked:
a tiny job trains end to end (exit 0, JSON summary); SIGINT to the launcher, SIGTERM to the
batch script (scancel) and a killed server-node each stop every process of the job (exit
130 / 143 / 1); the scripts parse (bash -n, shellcheck where installed); the commands in
docs/deploy.md use only options the CLIs have.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from netns import netns_hosts
from procs import REPO, clean_env, communicate_all, tail

LAUNCH = REPO / "deploy" / "ssh" / "launch.sh"
SBATCH = REPO / "deploy" / "slurm" / "mfgserve.sbatch"
SCRIPTS = [LAUNCH, REPO / "deploy" / "ssh" / "lib.sh", REPO / "deploy" / "ssh" / "guard.sh",
           SBATCH]
DOC = REPO / "docs" / "deploy.md"
TRAIN_ARGS = ["--batch-size", "256", "--fanouts", "5,5", "--no-progress", "--num-threads", "1",
              "--hidden", "32"]
STOP_TIMEOUT_S = 30  # the scripts' deadline for stopping everything
JOB_TIMEOUT_S = 240.0  # generous: the machine running the tests may be loaded

SSH_SHIM = '''
"""ssh for tests: run the remote command in the host's namespace (see the test module)."""
import json, os, subprocess, sys, threading
VALUE_OPTS = set("bcDEeFIiJLlmOoPpQRSWw")
args, i = sys.argv[1:], 0
while i < len(args) and args[i].startswith("-"):
    i += 2 if len(args[i]) == 2 and args[i][1] in VALUE_OPTS else 1
host, command = args[i], " ".join(args[i + 1:])
hosts = json.load(open(os.environ["SHIM_HOSTS"]))
if host not in hosts:
    sys.exit(f"ssh: Could not resolve hostname {host}")
argv = ["bash", "-c", command]
if hosts[host]:
    argv = ["ip", "netns", "exec", hosts[host], *argv]
env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"}
proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, cwd=env["HOME"])

def relay():
    while data := os.read(0, 65536):
        proc.stdin.write(data)
        proc.stdin.flush()
    proc.stdin.close()

threading.Thread(target=relay, daemon=True).start()
code = proc.wait()
sys.exit(code if code >= 0 else 255)
'''

SRUN_SHIM = '''
"""srun for tests: one task on --nodelist's node, in its namespace (see the test module)."""
import json, os, signal, subprocess, sys
sys.path.insert(0, os.environ["SHIM_REPO"])
from common.lifetime import die_with_parent
args, i, node = sys.argv[1:], 0, None
while args[i].startswith("-"):
    opt = args[i]
    if opt in ("-w", "--nodelist"):
        node, i = args[i + 1], i + 1
    elif opt.startswith("--nodelist="):
        node = opt.split("=", 1)[1]
    elif opt in ("-N", "-n", "--nodes", "--ntasks", "--het-group"):
        i += 1
    i += 1
hosts = json.load(open(os.environ["SHIM_HOSTS"]))
assert node in hosts, f"srun shim: unknown or missing --nodelist {node}"
argv = args[i:]
if hosts[node]:
    argv = ["ip", "netns", "exec", hosts[node], *argv]
env = dict(os.environ, SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0",
           SLURMD_NODENAME=node, SLURM_STEP_NUM_TASKS="1")
proc = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, _f: proc.send_signal(s))
code = proc.wait()
sys.exit(code if code >= 0 else 128 - code)
'''

SCONTROL_SHIM = '''#!/bin/bash
# scontrol for tests: only "scontrol show hostnames a,b,c"
[[ $1 == show && $2 == hostnames ]] || { echo "scontrol shim: $*: unsupported" >&2; exit 1; }
tr , '\\n' <<<"$3"
'''


# --------------------------------------------------------------------------- hosts and shims


@dataclass
class Hosts:
    """Fake hosts: name -> (namespace or "" for this host's own, address)."""
    names: list[str]
    namespaces: list[str]
    addrs: list[str]
    iface: str  # the interface gloo must use between hosts

    def ports(self, n: int) -> list[int]:
        """``n`` ports free on every host, below the ephemeral range: a fixed server port in
        that range can be taken by a TCP self-connect (a client connecting to the port before
        the server binds it), so real deployments use ports like 15550 and so do the tests."""
        if all(self.namespaces):
            return list(range(15550, 15550 + n))  # fresh namespaces: every port is free
        for start in range(20000 + os.getpid() % 5000, 32000, 7):
            socks = []
            try:
                for port in range(start, start + n):  # free on every address
                    socks.append(socket.socket())
                    socks[-1].bind(("0.0.0.0", port))
                return list(range(start, start + n))
            except OSError:
                continue
            finally:
                for s in socks:
                    s.close()
        raise AssertionError("no free ports below 32000")

    def leftovers(self) -> dict[str, list[int]]:
        """Processes still running in the hosts' namespaces (none must survive a job)."""
        out = {}
        for ns in filter(None, self.namespaces):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True, timeout=20).stdout.split()
            if pids:
                out[ns] = pids
        return out


@contextmanager
def fake_hosts(n: int, names: list[str] | None = None) -> Iterator[Hosts]:
    """``n`` hosts as network namespaces, or 127.0.0.(2+i) on this host where refused."""
    try:
        with netns_hosts(n, prefix="mfgd") as lab:
            yield Hosts(names or [h.ip for h in lab.hosts], [h.name for h in lab.hosts],
                        [h.ip for h in lab.hosts], "eth0")
            return
    except pytest.skip.Exception:
        pass  # namespaces refused: every host runs here, on its own loopback address
    addrs = [f"127.0.0.{2 + i}" for i in range(n)]
    yield Hosts(names or addrs, [""] * n, addrs, "lo")


def shim_env(tmp_path: Path, hosts: Hosts) -> dict[str, str]:
    """The environment that puts the ssh/srun/scontrol shims first on PATH."""
    bin_dir = tmp_path / "shim-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("ssh", f"#!{sys.executable}\n{SSH_SHIM}"),
                       ("srun", f"#!{sys.executable}\n{SRUN_SHIM}"),
                       ("scontrol", SCONTROL_SHIM)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    hosts_json = tmp_path / "shim-hosts.json"
    hosts_json.write_text(json.dumps(dict(zip(hosts.names, hosts.namespaces))))
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SHIM_HOSTS=str(hosts_json),
                     SHIM_REPO=str(REPO))


# --------------------------------------------------------------------------- running a job


def _terminal_signals() -> None:
    """In the launcher's child, before exec: SIGINT and SIGQUIT at their defaults, as from a
    terminal. A test process started in the background by a non-interactive shell inherits
    them ignored, and bash can neither trap nor reset a signal ignored on entry, so the
    Ctrl-C test would only measure how the suite was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class Launch:
    """A launcher process (launch.sh or the sbatch script) in its own session, its stdout and
    stderr in files, and every process it started (sampled while it runs)."""

    def __init__(self, argv: list[str], env: dict[str, str], tmp_path: Path, job_dir: Path):
        self.job_dir = job_dir
        self.out, self.err = tmp_path / "launch.out", tmp_path / "launch.err"
        with open(self.out, "w") as fo, open(self.err, "w") as fe:
            self.proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                         env=env, cwd=tmp_path, start_new_session=True,
                                         preexec_fn=_terminal_signals)
        self.seen: dict[int, float] = {}  # pid -> create time of every descendant seen

    def sample(self) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in procs:
            try:
                self.seen.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass
        return procs

    def wait_training(self, timeout: float = JOB_TIMEOUT_S) -> None:
        """Until the trainers finished an epoch (the run's metrics.jsonl has a line)."""
        metrics = self.job_dir / "run" / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while not (metrics.is_file() and metrics.read_text().strip()):
            self.sample()
            assert self.proc.poll() is None, f"launcher exited with {self.proc.returncode}:\n" \
                                             f"{tail(self.err, 60)}"
            assert time.monotonic() < deadline, f"no epoch within {timeout}s:\n{self.logs()}"
            time.sleep(0.2)
        self.sample()

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        """The launcher's exit code, sampling its processes until it exits."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
                raise AssertionError(f"launcher still running after {timeout}s:\n"
                                     f"{self.logs()}")
            self.sample()
            time.sleep(0.2)
        return self.proc.returncode

    def survivors(self) -> list[str]:
        """Processes it started that still run (zombies count as ended)."""
        left = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:200]}")
            except psutil.NoSuchProcess:
                pass
        return left

    def logs(self) -> str:
        steps = sorted((self.job_dir / "logs").glob("*.err"))
        return f"--- launcher:\n{tail(self.err, 40)}\n" + "".join(
            f"--- {p.name}:\n{tail(p, 15)}\n" for p in steps)

    def kill_leftovers(self) -> None:
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def check_summary(launch: Launch, code: int, trainers: int) -> dict:
    assert code == 0, f"launcher exited with {code}:\n{launch.logs()}"
    lines = launch.out.read_text().strip().splitlines()
    assert lines, f"launcher printed no summary:\n{launch.logs()}"
    summary = json.loads(lines[-1])
    assert summary["num_trainers"] == trainers and summary["num_parts"] == 2, summary
    assert summary["epochs"] == 2 and summary["seeds_per_s"] > 0, summary
    assert Path(summary["run_dir"]).resolve() == (launch.job_dir / "run").resolve(), summary
    return summary


def check_stopped(launch: Launch, hosts: Hosts, code: int, expect: int) -> None:
    """The launcher exited with ``expect`` and nothing it started runs any more."""
    assert code == expect, f"launcher exited with {code}, expected {expect}:\n{launch.logs()}"
    assert launch.seen, "no process of the job was ever seen"
    assert not launch.survivors(), f"left running: {launch.survivors()}\n{launch.logs()}"
    assert not hosts.leftovers(), f"processes left in the hosts: {hosts.leftovers()}"


def write_hosts(path: Path, hosts: Hosts, roles: list[str]) -> Path:
    path.write_text("# role  ssh-target  address\n" + "".join(
        f"{role} {name} {addr}  # fake host {i}\n"
        for i, (role, name, addr) in enumerate(zip(roles, hosts.names, hosts.addrs))))
    return path


def ssh_launch(tmp_path: Path, hosts: Hosts, roles: list[str], parts: Path,
               epochs: int) -> Launch:
    port_base, _, master_port = hosts.ports(3)  # parts 0 and 1, then the DDP master
    job_dir = tmp_path / "job"
    argv = ["bash", str(LAUNCH), "--hosts", str(write_hosts(tmp_path / "hosts.txt", hosts, roles)),
            "--parts", str(parts), "--job-dir", str(job_dir), "--port-base", str(port_base),
            "--master-port", str(master_port), "--stop-timeout-s", str(STOP_TIMEOUT_S),
            "--env", f"GLOO_SOCKET_IFNAME={hosts.iface}", "--", *TRAIN_ARGS,
            "--epochs", str(epochs)]
    return Launch(argv, shim_env(tmp_path, hosts), tmp_path, job_dir)


def slurm_launch(tmp_path: Path, hosts: Hosts, parts: Path, epochs: int) -> Launch:
    job_dir = tmp_path / "job"
    env = shim_env(tmp_path, hosts)
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=",".join(hosts.names),
               SLURM_JOB_NUM_NODES=str(len(hosts.names)), SLURM_SUBMIT_DIR=str(tmp_path),
               MFGSERVE_REPO=str(REPO), MFGSERVE_PARTS=str(parts),
               MFGSERVE_JOB_DIR=str(job_dir), MFGSERVE_SERVER_NODES="1",
               MFGSERVE_MASTER_PORT=str(hosts.ports(1)[0]),
               MFGSERVE_STOP_TIMEOUT_S=str(STOP_TIMEOUT_S),
               MFGSERVE_TRAIN_ARGS=" ".join([*TRAIN_ARGS, "--epochs", str(epochs)]),
               GLOO_SOCKET_IFNAME=hosts.iface)
    return Launch(["bash", str(SBATCH)], env, tmp_path, job_dir)


@contextmanager
def running(launch: Launch) -> Iterator[Launch]:
    try:
        yield launch
    finally:
        launch.kill_leftovers()


# --------------------------------------------------------------------------- ssh launcher


@pytest.mark.timeout(400)
def test_ssh_launcher_trains_across_hosts(synth_parts2, tmp_path):
    with fake_hosts(4, ["srv-a", "srv-b", "gpu-a", "gpu-b"]) as hosts:
        roles = ["server", "server", "trainer", "trainer"]
        with running(ssh_launch(tmp_path, hosts, roles, synth_parts2, epochs=2)) as launch:
            code = launch.wait()
            check_summary(launch, code, trainers=2)
            check_stopped(launch, hosts, code, 0)
            cluster = (launch.job_dir / "cluster.yaml").read_text()
            assert hosts.addrs[0] in cluster and hosts.addrs[1] in cluster, cluster


@pytest.mark.timeout(400)
def test_ssh_launcher_ctrl_c_stops_every_process(synth_parts2, tmp_path):
    with fake_hosts(2, ["srv", "gpu"]) as hosts:
        with running(ssh_launch(tmp_path, hosts, ["server", "trainer"], synth_parts2,
                                epochs=10_000)) as launch:
            launch.wait_training()
            names = " ".join(" ".join(p.cmdline()) for p in launch.sample())
            assert "server-node" in names and "trainer-client" in names, names
            os.kill(launch.proc.pid, signal.SIGINT)
            code = launch.wait(timeout=STOP_TIMEOUT_S * 3)
            check_stopped(launch, hosts, code, 130)
            assert "got SIGINT" in launch.err.read_text()


@pytest.mark.timeout(400)
def test_ssh_launcher_failed_server_node_stops_the_job(synth_parts2, tmp_path):
    with fake_hosts(3, ["srv-a", "srv-b", "gpu"]) as hosts:
        with running(ssh_launch(tmp_path, hosts, ["server", "server", "trainer"],
                                synth_parts2, epochs=10_000)) as launch:
            launch.wait_training()
            victim = [p for p in launch.sample()  # python .venv/bin/server-node ... --host B
                      if p.cmdline()[1:2] and p.cmdline()[1].endswith("/server-node")
                      and hosts.addrs[1] in p.cmdline()]
            assert len(victim) == 1, [p.cmdline() for p in launch.sample()]
            victim[0].kill()  # the host's server-node dies; its servers die with it
            code = launch.wait(timeout=STOP_TIMEOUT_S * 3)
            check_stopped(launch, hosts, code, 1)
            assert "server-srv-b exited" in launch.err.read_text(), launch.logs()


# --------------------------------------------------------------------------- SLURM script


@pytest.mark.timeout(400)
def test_sbatch_script_trains_with_srun(synth_parts2, tmp_path):
    with fake_hosts(3) as hosts:
        with running(slurm_launch(tmp_path, hosts, synth_parts2, epochs=2)) as launch:
            code = launch.wait()
            check_summary(launch, code, trainers=2)
            check_stopped(launch, hosts, code, 0)
            cluster = (launch.job_dir / "cluster.yaml").read_text()
            assert f"tcp://{hosts.addrs[0]}:" in cluster, cluster  # written by --cluster-out


@pytest.mark.timeout(400)
def test_sbatch_script_stops_every_step_on_scancel(synth_parts2, tmp_path):
    with fake_hosts(2) as hosts:
        with running(slurm_launch(tmp_path, hosts, synth_parts2, epochs=10_000)) as launch:
            launch.wait_training()
            os.kill(launch.proc.pid, signal.SIGTERM)  # what scancel sends the batch script
            code = launch.wait(timeout=STOP_TIMEOUT_S * 3)
            check_stopped(launch, hosts, code, 143)


# --------------------------------------------------------------------------- static checks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True,
                              text=True, timeout=30, cwd=REPO)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_launcher_rejects_bad_input(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("server a\nbroker b\n")
    for args, needle in ((["--parts", "x"], "--hosts and --parts are required"),
                         (["--hosts", str(hosts), "--parts", "x"], "unknown role 'broker'"),
                         (["--bogus"], "unknown option '--bogus'")):
        proc = subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)


CLI_OF = ("server-node", "trainer-client", "worker-mode", "torchrun", "partition-ogbn")
UNCHECKED = ("sbatch", "srun", "ssh", "kill")  # their options end the previous command's


def _documented_options() -> dict[str, set[str]]:
    """{command: --options it is given} in docs/deploy.md's code blocks and the scripts."""
    text = "\n".join(code for lang, code in re.findall(r"```(\w*)\n(.*?)```", DOC.read_text(),
                                                       re.S) if lang in ("bash", "sh", ""))
    text += "".join(p.read_text() for p in (LAUNCH, SBATCH))
    text = text.replace("\\\n", " ")
    # launch.sh passes what follows "--" to trainer-client, the batch script MFGSERVE_TRAIN_ARGS
    text = text.replace(" -- ", " trainer-client ").replace("_TRAIN_ARGS=\"", " trainer-client ")
    found: dict[str, set[str]] = {c: set() for c in CLI_OF}
    for line in text.splitlines():
        # split a line at each command name; options up to the next command belong to it
        parts = re.split(r"(?:^|[\s/\"])(" + "|".join((*CLI_OF, *UNCHECKED))
                         + r")[\")]?(?=\s)", line)
        for cmd, rest in zip(parts[1::2], parts[2::2]):
            if cmd in UNCHECKED:
                continue
            found[cmd] |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))
    return found


@pytest.mark.timeout(120)
def test_documented_commands_use_real_options():
    found = _documented_options()
    assert found["server-node"] and found["trainer-client"] and found["torchrun"], found
    venv_bin = Path(sys.executable).parent
    cmds = [c for c in CLI_OF if found[c]]
    helps = communicate_all([subprocess.Popen([str(venv_bin / c), "--help"], text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              stdin=subprocess.DEVNULL, env=clean_env())
                             for c in cmds], timeout=100)
    for cmd, (out, err) in zip(cmds, helps):
        assert "usage:" in out, f"{cmd} --help: {err[-2000:]}"
        missing = {o for o in found[cmd] if not re.search(re.escape(o) + r"(?![\w-])", out)}
        assert not missing, f"{cmd}: options not in its --help: {sorted(missing)}"
