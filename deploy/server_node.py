"""``server-node``: start and supervise the sampler servers of one host (server-client mode).

Two ways to say which servers:

* ``--cluster FILE --host HOST``: the servers that FILE lists on HOST (tcp endpoints whose host
  part is HOST), e.g. on each server host of a multi-host deployment sharing one cluster file;
* ``--cluster-out FILE --host HOST``: every part of ``--parts`` (``--replicas`` each) on this
  host, on ports picked by binding port 0; the cluster file for trainers is written to FILE.

It waits until every server answers a ping, prints one JSON line (``{"event": "ready", ...}``)
on stdout, and keeps them running between training jobs. Any server exiting stops the others
and exits 1 naming it; SIGINT/SIGTERM shut them all down within ``--shutdown-timeout-s`` (then
kill). Children die with the launcher (PDEATHSIG).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from common.cli import Interrupted, raise_on_signals, run_main
from common.cluster import ClusterSpec
from common.config import ServerNodeConfig, add_config_args, load_config
from common.errors import ConfigError
from common.jsonout import dumps_strict
from common.rundirs import make_run_dir, remove_stale_run_dirs
from common.sockets import new_token_file
from deploy.processes import ProcessGroup, free_tcp_port
from deploy.server_group import LaunchError, server_argv, shutdown_servers, wait_ready
from partition.layout import PartitionSetMeta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="server-node", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with server-node and server options "
                   "(command-line options override it)")
    add_config_args(p, ServerNodeConfig)
    return p


def _host_of(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


def plan(node: ServerNodeConfig, num_parts: int) -> tuple[Path, list[tuple[int, str]]]:
    """(cluster file, this node's (part, endpoint) list)."""
    if node.cluster:
        cluster_file = Path(node.cluster)
        mine = [(p, ep) for p, ep in ClusterSpec.load(cluster_file).all_endpoints()
                if ep.startswith("tcp://") and _host_of(ep) == node.host]
        if not mine:
            raise ConfigError(f"cluster file {cluster_file} lists no tcp endpoint on host "
                              f"{node.host}; fix --host or the cluster file")
        return cluster_file, mine
    cluster = ClusterSpec({p: [f"tcp://{node.host}:{free_tcp_port(node.host)}"
                               for _ in range(node.replicas)] for p in range(num_parts)})
    cluster_file = Path(node.cluster_out)
    cluster.write(cluster_file)
    return cluster_file, cluster.all_endpoints()


def run(node: ServerNodeConfig) -> int:
    cfg = node.server
    meta = PartitionSetMeta.load(cfg.parts)
    cluster_file, mine = plan(node, meta.num_parts)
    group = ProcessGroup()
    servers = [(f"server p{p} {ep}", ep) for p, ep in mine]
    for stale in remove_stale_run_dirs():
        print(f"server-node: removed {stale}, left by a process that was killed",
              file=sys.stderr)
    secret_dir = str(make_run_dir("node-"))  # 0700: the shutdown token, ready files
    token_file = os.path.join(secret_dir, "shutdown.token")
    token = new_token_file(token_file)
    try:
        ready = {name: Path(secret_dir) / f"ready-{i}" for i, (name, _) in enumerate(servers)}
        for (p, ep), (name, _) in zip(mine, servers):
            group.spawn(name, server_argv(cfg, cfg.parts, p, ep, cluster_file, token_file,
                                          str(ready[name])))
        wait_ready(group, servers, node.startup_timeout_s, ready)
        print(dumps_strict({"event": "ready", "cluster": str(cluster_file),
                            "servers": [ep for _, ep in mine]}), flush=True)
        while True:
            for c in group.children:
                if c.proc.poll() is not None:
                    raise LaunchError(f"{c.name} (pid {c.pid}) exited with code "
                                      f"{c.proc.returncode}; stopping this node's servers. Its "
                                      f"last output:\n{c.last_lines()}")
            time.sleep(0.2)
    finally:
        group.teardown(node.shutdown_timeout_s,
                       polite=lambda: shutdown_servers(servers, token))
        shutil.rmtree(secret_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``server-node``: 0 once stopped by SIGINT/SIGTERM, 1 when a server
    died, 2 for bad input (errors mapped by :func:`common.cli.run_main`)."""
    return run_main("server-node", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    raise_on_signals()
    node = load_config(ServerNodeConfig, args.config, args)
    try:
        return run(node)
    except Interrupted as e:  # the way a node is meant to stop
        print(f"server-node: {e}: servers stopped", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
