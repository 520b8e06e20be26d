"""Console entry of ``trainer-client``: reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) as defaults for the DDP options, then runs the trainer.
Environment variables are read here, in deploy/, and nowhere else."""

from __future__ import annotations

import os
from typing import NoReturn

from common.config import DDPConfig
from common.errors import ConfigError
from trainer_client.main import exit_process
from trainer_client.main import main as trainer_main

ENV = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
       "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}


def ddp_from_env(env: dict[str, str] | None = None) -> DDPConfig:
    env = dict(os.environ if env is None else env)
    d = DDPConfig()
    try:
        return DDPConfig(**{k: type(getattr(d, k))(env[v]) for k, v in ENV.items() if v in env})
    except ValueError as e:
        raise ConfigError(f"bad torchrun environment variable: {e}") from None


def main(argv: list[str] | None = None) -> NoReturn:
    """The ``trainer-client`` process. Does not return: it ends the process with the trainer's
    exit code through ``os._exit`` (see :func:`trainer_client.main.exit_process`: torch's
    gloo threads can abort the interpreter's normal exit)."""
    exit_process(trainer_main(argv, ddp_from_env))


if __name__ == "__main__":
    main()
