"""A sampler worker process of a server (``sampler-server --sampler-procs N``).

Started by the server (:class:`common.executors.ProcessExecutor`), never by hand. It maps the
same partition files (page cache shared with the server and its other workers), connects to
the server's private ``ipc`` backend socket and serves the SampleJobs it is given
(:func:`common.executors.run_worker_process`: the messages, and how it stops). The server sends
the reply frames on to the client unchanged. The worker exits when told to, when the server
process goes away (PR_SET_PDEATHSIG, and a parent-pid check), or with exit code 1 if it
breaks; the server treats any worker exit it did not ask for as fatal.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from common.alloc import retain_freed_memory
from common.cluster import ClusterSpec
from common.config import ServerConfig, add_config_args, load_config, to_argv
from common.executors import run_worker_process
from partition.layout import load_hot_rank
from sampler_server.partition_store import PartitionStore
from sampler_server.sample_worker import SampleWorker, peer_keys

log = logging.getLogger("mfgserve.server")


def worker_argv(cfg: ServerConfig, backend: str, index: int) -> list[str]:
    return [sys.executable, "-m", "sampler_server.sampler_proc", "--backend", backend,
            "--index", str(index), *to_argv(cfg)]


def run(cfg: ServerConfig, backend: str, index: int) -> int:
    store = PartitionStore(cfg.parts, cfg.part_id, seed=cfg.seed * 1000 + index + 1)
    cluster = ClusterSpec.load(cfg.cluster) if cfg.cluster else None
    hot_rank, keys = load_hot_rank(cfg.parts), peer_keys(cfg, cluster)
    return run_worker_process(
        backend, lambda ctx: SampleWorker(cfg, store, hot_rank, ctx, cluster, keys), index,
        cfg.max_message_mb << 20, where=f"part {cfg.part_id} sampler process {index}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sampler_server.sampler_proc",
                                description="internal: a sampler server's worker process")
    p.add_argument("--backend", required=True)
    p.add_argument("--index", type=int, required=True)
    add_config_args(p, ServerConfig)  # the server's own config (to_argv)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(name)s[sampler {args.index}] %(message)s")
    torch.set_num_threads(1)
    cfg = load_config(ServerConfig, None, args)
    retain_freed_memory(cfg.malloc_retain_mb, f"part {cfg.part_id} sampler process {args.index}")
    try:
        return run(cfg, args.backend, args.index)
    except KeyboardInterrupt:
        return 0
    except Exception:
        log.exception("sampler process %d failed", args.index)
        return 1


if __name__ == "__main__":
    sys.exit(main())
