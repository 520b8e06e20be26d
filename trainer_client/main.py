"""``trainer-client``: one DDP rank training GraphSAGE on MFGs served by the sampler servers.

Rank/world size come from the command line or, under ``torchrun``, from the environment
(read in :mod:`deploy.trainer_cli`, the console-script entry point).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from common.config import TrainerConfig, add_config_args, load_config
from common.errors import MfgServeError
from trainer_client.train import DDPSetup, run_trainer, write_summary


def build_parser(ddp_defaults: DDPSetup | None = None) -> argparse.ArgumentParser:
    d = ddp_defaults or DDPSetup()
    p = argparse.ArgumentParser(
        prog="trainer-client",
        description="Train GraphSAGE with PyTorch DDP on mini-batches (MFGs + features + "
                    "labels) sampled by mfgserve sampler servers. Prints a JSON summary as the "
                    "last stdout line (rank 0).")
    p.add_argument("--config", help="YAML file with trainer options (command-line options "
                   "override it)")
    add_config_args(p, TrainerConfig)
    g = p.add_argument_group("distributed launch (torchrun sets these through RANK, "
                             "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    g.add_argument("--rank", type=int, default=d.rank, help=f"this trainer's DDP rank (default: {d.rank})")
    g.add_argument("--world-size", type=int, default=d.world_size,
                   help=f"number of trainers in the job (default: {d.world_size})")
    g.add_argument("--local-rank", type=int, default=d.local_rank,
                   help=f"rank on this node; picks the GPU (default: {d.local_rank})")
    g.add_argument("--master-addr", default=d.master_addr,
                   help=f"address of rank 0 for DDP rendezvous (default: {d.master_addr})")
    g.add_argument("--master-port", type=int, default=d.master_port,
                   help=f"port of rank 0 for DDP rendezvous (default: {d.master_port})")
    g.add_argument("--ddp-timeout-s", type=float, default=d.timeout_s,
                   help=f"seconds a DDP collective may wait for the other ranks (default: {d.timeout_s})")
    return p


DDP_KEYS = ("rank", "world_size", "local_rank", "master_addr", "master_port", "ddp_timeout_s")


def main(argv: list[str] | None = None, ddp_defaults: DDPSetup | None = None) -> int:
    args = build_parser(ddp_defaults).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    ddp = DDPSetup(rank=args.rank, world_size=args.world_size, local_rank=args.local_rank,
                   master_addr=args.master_addr, master_port=args.master_port,
                   timeout_s=args.ddp_timeout_s)
    cfg_args = {k: v for k, v in vars(args).items() if k not in DDP_KEYS and k != "config"}
    try:
        cfg = load_config(TrainerConfig, args.config, cfg_args)
        if not 0 <= ddp.rank < ddp.world_size:
            raise MfgServeError(f"--rank {ddp.rank} must be in [0, --world-size {ddp.world_size})")
        summary = run_trainer(cfg, ddp)
    except MfgServeError as e:
        print(f"trainer-client (rank {ddp.rank}): error: {e}", file=sys.stderr)
        return 2
    if ddp.rank == 0:
        if cfg.summary_out:
            write_summary(summary, cfg.summary_out)
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
