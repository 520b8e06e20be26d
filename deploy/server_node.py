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
import tempfile
import time
from pathlib import Path

from common.cluster import ClusterSpec
from common.config import ServerConfig, add_config_args, load_config
from common.errors import MfgServeError
from common.jsonout import dumps_strict
from common.sockets import new_token_file
from deploy.processes import ProcessGroup, free_tcp_port
from deploy.server_group import (
    Interrupted,
    LaunchError,
    raise_on_signals,
    server_argv,
    shutdown_servers,
    wait_ready,
)
from partition.layout import PartitionFormatError, PartitionSetMeta

SKIP = ("part_id", "bind", "cluster", "ready_file", "shutdown_token_file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="server-node", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with server options (command-line options "
                   "override it)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--cluster", help="cluster file listing every server; this node starts "
                   "those on --host")
    g.add_argument("--cluster-out", help="write a cluster file for all parts of --parts on "
                   "--host, with free ports, then start those servers")
    p.add_argument("--host", default="127.0.0.1", help="this host's address as written in "
                   "the cluster file (default: 127.0.0.1)")
    p.add_argument("--replicas", type=int, default=1, help="with --cluster-out: servers per "
                   "part (default: 1)")
    p.add_argument("--startup-timeout-s", type=float, default=120.0, help="seconds to wait "
                   "for every server to answer a ping (default: 120)")
    p.add_argument("--shutdown-timeout-s", type=float, default=10.0, help="seconds to wait "
                   "for servers to exit before killing them (default: 10)")
    add_config_args(p, ServerConfig, skip=SKIP)
    return p


def _host_of(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


def plan(args: argparse.Namespace, num_parts: int) -> tuple[ClusterSpec, Path, list[tuple[int, str]]]:
    """(cluster, cluster file, this node's (part, endpoint) list)."""
    if args.cluster:
        cluster_file = Path(args.cluster)
        cluster = ClusterSpec.load(cluster_file)
        mine = [(p, ep) for p, ep in cluster.all_endpoints()
                if ep.startswith("tcp://") and _host_of(ep) == args.host]
        if not mine:
            raise MfgServeError(f"cluster file {cluster_file} lists no tcp endpoint on host "
                                f"{args.host}; fix --host or the cluster file")
        return cluster, cluster_file, mine
    if args.replicas < 1:
        raise MfgServeError("--replicas must be >= 1")
    cluster = ClusterSpec({p: [f"tcp://{args.host}:{free_tcp_port(args.host)}"
                               for _ in range(args.replicas)] for p in range(num_parts)})
    cluster_file = Path(args.cluster_out)
    cluster.write(cluster_file)
    return cluster, cluster_file, cluster.all_endpoints()


def run(args: argparse.Namespace, cfg: ServerConfig) -> int:
    meta = PartitionSetMeta.load(cfg.parts)
    cluster, cluster_file, mine = plan(args, meta.num_parts)
    group = ProcessGroup()
    servers = [(f"server p{p} {ep}", ep) for p, ep in mine]
    secret_dir = tempfile.mkdtemp(prefix="mfgserve-node-")  # 0700: the shutdown token
    token_file = os.path.join(secret_dir, "shutdown.token")
    token = new_token_file(token_file)
    try:
        for (p, ep), (name, _) in zip(mine, servers):
            group.spawn(name, server_argv(cfg, cfg.parts, p, ep, cluster_file, token_file))
        wait_ready(group, servers, args.startup_timeout_s)
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
        group.teardown(args.shutdown_timeout_s,
                       polite=lambda: shutdown_servers(servers, token))
        shutil.rmtree(secret_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raise_on_signals()
    cli = {k: v for k, v in vars(args).items()
           if k not in ("config", "cluster", "cluster_out", "host", "replicas",
                        "startup_timeout_s", "shutdown_timeout_s")}
    try:
        cfg = load_config(ServerConfig, args.config, cli)
        return run(args, cfg)
    except Interrupted as e:
        print(f"server-node: {e}: servers stopped", file=sys.stderr)
        return 0
    except LaunchError as e:
        print(f"server-node: error: {e}", file=sys.stderr)
        return 1
    except (MfgServeError, PartitionFormatError, ValueError, OSError) as e:
        print(f"server-node: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
