"""``sampler-server``: serve one partition of a partition set over ZeroMQ.

Example::

    sampler-server --parts parts/ --part-id 0 --bind tcp://0.0.0.0:15550 --cluster cluster.yaml
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from common import native
from common.alloc import retain_freed_memory
from common.cli import run_main
from common.config import ServerConfig, add_config_args, load_config
from common.errors import ChildFailedError
from common.jsonout import dumps_strict
from common.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sampler-server",
        description="Load one graph partition and serve sampled message-flow graphs (MFGs), "
                    "input features and seed labels to trainer clients over ZeroMQ.",
    )
    p.add_argument("--config", help="YAML file with server options (command-line options "
                   "override it)")
    add_config_args(p, ServerConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sampler-server``: 0 once stopped (SIGTERM, SIGINT or a Shutdown
    message), 2 for bad input, 1 when a sampler process failed (errors mapped by
    :func:`common.cli.run_main`)."""
    return run_main("sampler-server", lambda: _serve(argv))


def _serve(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(ServerConfig, args.config, args)
    setup_logging(f"server part {cfg.part_id}")
    import torch

    from sampler_server.server import SamplerServer  # heavy imports after arg checks

    # Concurrency comes from --num-workers threads (and processes); keep each op serial
    # so co-located servers and trainers do not oversubscribe the cores.
    torch.set_num_threads(1)
    retain_freed_memory(cfg.malloc_retain_mb, f"server part {cfg.part_id}")
    if cfg.nice:
        os.nice(cfg.nice)
    server = SamplerServer(cfg)

    def on_signal(signum, _frame):
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    m = server.store.meta
    print(dumps_strict({"event": "serving", "endpoint": server.endpoint, "part_id": cfg.part_id,
                        "num_parts": m.num_parts,
                        "part_nodes": server.store.end - server.store.start,
                        "dataset": m.dataset, "native": native.status()}),
          file=sys.stderr, flush=True)
    server.serve_forever()
    if server.fatal:
        raise ChildFailedError(str(server.fatal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
