"""Console entry of ``trainer-client``: reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) as defaults for the DDP options, then runs the trainer.
Environment variables are read here, in deploy/, and nowhere else."""

from __future__ import annotations

import os
from typing import NoReturn

from trainer_client.main import main as trainer_main
from trainer_client.main import run_and_exit
from trainer_client.train import DDPSetup


def ddp_from_env(env: dict[str, str] | None = None) -> DDPSetup:
    env = dict(os.environ if env is None else env)
    d = DDPSetup()
    try:
        return DDPSetup(
            rank=int(env.get("RANK", d.rank)),
            world_size=int(env.get("WORLD_SIZE", d.world_size)),
            local_rank=int(env.get("LOCAL_RANK", d.local_rank)),
            master_addr=env.get("MASTER_ADDR", d.master_addr),
            master_port=int(env.get("MASTER_PORT", d.master_port)),
        )
    except ValueError as e:
        raise SystemExit(f"trainer-client: bad torchrun environment variable: {e}") from None


def main(argv: list[str] | None = None) -> NoReturn:
    """The ``trainer-client`` process. Does not return: it ends the process with the trainer's
    exit code through ``os._exit`` (see :func:`trainer_client.main.exit_process`: torch's
    gloo threads can abort the interpreter's normal exit)."""
    ddp = ddp_from_env()
    run_and_exit(lambda: trainer_main(argv, ddp))


if __name__ == "__main__":
    main()
