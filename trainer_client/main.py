"""``trainer-client``: one DDP rank training GraphSAGE on MFGs served by the sampler servers.

Rank/world size come from the command line or, under ``torchrun``, from the environment
(read in :mod:`deploy.trainer_cli`, the console-script entry point).

Exit codes: 0 done (rank 0 printed the summary), 2 an mfgserve error (bad option, a server or
another rank failed, the training loss became NaN/inf: see :class:`NonFiniteLossError`);
an unexpected exception exits 1 with its traceback.

The process ends through :func:`exit_process` (``os._exit`` after flushing): once every rank
has delivered its result and passed the final barrier nothing is left to do, and skipping the
interpreter's and C++ static destructors avoids an upstream crash where torch's gloo threads
abort the process ("terminate called without an active exception", SIGABRT) at exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from common.config import TrainerConfig, add_config_args, load_config
from common.errors import MfgServeError
from common.jsonout import dumps_strict
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
    g.add_argument("--done-file", default="",
                   help="write this file once this rank is finished (rank 0's summary "
                        "delivered, every rank past the final barrier); a launcher counts a "
                        "rank that dies after writing it, in teardown, as finished")
    return p


DDP_KEYS = ("rank", "world_size", "local_rank", "master_addr", "master_port", "ddp_timeout_s",
            "done_file")


def exit_process(code: int) -> NoReturn:
    """End the process now with ``code``: flush logging, stdout and stderr, then ``os._exit``
    (no atexit handlers, no interpreter or C++ static destructors: the gloo teardown crash
    described in the module docstring cannot happen)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_and_exit(entry: Callable[[], int]) -> NoReturn:
    """Run a trainer entry point as the whole process: its return value (or 1 after printing
    the traceback of an unexpected exception) becomes the exit code, via :func:`exit_process`.
    ``SystemExit`` (``--help``, a bad option) and ``KeyboardInterrupt`` exit the usual way."""
    try:
        code = entry()
    except Exception:
        traceback.print_exc()
        code = 1
    exit_process(code)


def main(argv: list[str] | None = None, ddp_defaults: DDPSetup | None = None) -> int:
    args = build_parser(ddp_defaults).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    ddp = DDPSetup(rank=args.rank, world_size=args.world_size, local_rank=args.local_rank,
                   master_addr=args.master_addr, master_port=args.master_port,
                   timeout_s=args.ddp_timeout_s)
    cfg_args = {k: v for k, v in vars(args).items() if k not in DDP_KEYS and k != "config"}

    def deliver(summary: dict) -> None:  # before the final barrier: every rank waits for it
        if ddp.rank == 0:
            if cfg.summary_out:
                write_summary(summary, cfg.summary_out)
            print(dumps_strict(summary), flush=True)

    try:
        cfg = load_config(TrainerConfig, args.config, cfg_args)
        if not 0 <= ddp.rank < ddp.world_size:
            raise MfgServeError(f"--rank {ddp.rank} must be in [0, --world-size {ddp.world_size})")
        run_trainer(cfg, ddp, deliver, args.done_file)
    except MfgServeError as e:
        print(f"trainer-client (rank {ddp.rank}): error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_and_exit(main)
