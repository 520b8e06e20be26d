"""``trainer-client``: one DDP rank training a GNN (GraphSAGE by default) on MFGs served by the sampler servers.

Rank/world size come from the command line or, under ``torchrun``, from the environment
(read in :mod:`deploy.trainer_cli`, the console-script entry point).

Exit codes (see :mod:`common.cli`): 0 done (rank 0 printed the summary), 2 an mfgserve error
(bad option, a server or another rank failed, the training loss became NaN/inf: see
:class:`NonFiniteLossError`); an unexpected exception exits 1 with its traceback.

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
from collections.abc import Callable
from typing import NoReturn

from common.cli import run_main
from common.config import DDPConfig, TrainerConfig, add_config_args, load_config
from common.jsonout import dumps_strict
from common.logs import setup_logging
from trainer_client.train import DDPSetup, run_trainer, write_summary

PROG = "trainer-client"


def build_parser(ddp_defaults: DDPConfig | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a GNN (--model) with PyTorch DDP on mini-batches (MFGs + features + "
                    "labels) sampled by mfgserve sampler servers. Prints a JSON summary as the "
                    "last stdout line (rank 0).")
    p.add_argument("--config", help="YAML file with trainer options (command-line options "
                   "override it)")
    add_config_args(p, TrainerConfig)
    add_config_args(p.add_argument_group(
        "distributed launch (torchrun sets these through RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR, MASTER_PORT)"), DDPConfig, defaults=ddp_defaults)
    return p


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


def _setup(d: DDPConfig) -> DDPSetup:
    return DDPSetup(rank=d.rank, world_size=d.world_size, local_rank=d.local_rank,
                    master_addr=d.master_addr, master_port=d.master_port,
                    timeout_s=d.ddp_timeout_s, launcher_tty=d.launcher_tty)


def main(argv: list[str] | None = None,
         ddp_defaults: Callable[[], DDPConfig] = DDPConfig) -> int:
    """Run one trainer; returns the exit code (errors mapped by :func:`common.cli.run_main`).
    ``ddp_defaults`` gives the DDP options' defaults (the console entry reads torchrun's
    environment)."""
    ddp = [DDPConfig()]  # known once parsed: error messages name the rank

    def body() -> int:
        defaults = ddp_defaults()
        ddp[0] = defaults
        args = build_parser(defaults).parse_args(argv)
        ddp[0] = load_config(DDPConfig, None, args, base=defaults)
        setup_logging(f"trainer rank {ddp[0].rank}")
        cfg = load_config(TrainerConfig, args.config, args)

        def deliver(summary: dict) -> None:  # before the final barrier: every rank waits
            if ddp[0].rank == 0:
                if cfg.summary_out:
                    write_summary(summary, cfg.summary_out)
                print(dumps_strict(summary), flush=True)

        run_trainer(cfg, _setup(ddp[0]), deliver, ddp[0].done_file)
        return 0

    return run_main(lambda: f"{PROG} (rank {ddp[0].rank})", body)


if __name__ == "__main__":
    exit_process(main())
