"""``sampler-server``: serve one partition of a partition set over ZeroMQ.

Example::

    sampler-server --parts parts/ --part-id 0 --bind tcp://0.0.0.0:15550 --cluster cluster.yaml
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from common.config import ServerConfig, add_config_args, load_config
from common.errors import MfgServeError
from common.jsonout import dumps_strict
from partition.layout import PartitionFormatError


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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    try:
        cfg = load_config(ServerConfig, args.config, args)
        import torch

        from sampler_server.server import SamplerServer  # heavy imports after arg checks

        # Concurrency comes from --num-workers threads (and processes); keep each op serial
        # so co-located servers and trainers do not oversubscribe the cores.
        torch.set_num_threads(1)

        server = SamplerServer(cfg)
    except (MfgServeError, PartitionFormatError, OSError) as e:
        print(f"sampler-server: error: {e}", file=sys.stderr)
        return 2

    def on_signal(signum, _frame):
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    m = server.store.meta
    print(dumps_strict({"event": "serving", "endpoint": server.endpoint, "part_id": cfg.part_id,
                      "num_parts": m.num_parts, "part_nodes": server.store.end - server.store.start,
                      "dataset": m.dataset}), file=sys.stderr, flush=True)
    server.serve_forever()
    if server.fatal:
        print(f"sampler-server: error: {server.fatal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
