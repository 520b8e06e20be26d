"""``mfgserve-keys``: create CurveZMQ key pairs for server-client mode.

Example (one key pair for the servers, one per trainer host)::

    mfgserve-keys --out keys --name server
    mfgserve-keys --out keys --name trainer-a --authorize keys/authorized

writes ``keys/server.key`` (public: goes into the cluster file as ``curve_server_key`` and into
the authorized directory, since servers are clients of each other) and
``keys/server.key_secret`` (for ``sampler-server --curve-secret-key``); ``--authorize DIR``
also copies the public key into DIR, the directory servers read with
``--curve-authorized-keys``. Secret files are created readable by the owner only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import zmq
import zmq.auth

from common.cli import run_main
from common.config import KeysConfig, add_config_args, load_config
from common.errors import ConfigError
from common.jsonout import dumps_strict


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mfgserve-keys", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, KeysConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mfgserve-keys`` (errors mapped by :func:`common.cli.run_main`)."""
    return run_main("mfgserve-keys", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = load_config(KeysConfig, None, build_parser().parse_args(argv))
    if not zmq.has("curve"):
        raise ConfigError("this libzmq has no CURVE support")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{cfg.name}.key", out / f"{cfg.name}.key_secret"
    if (public.exists() or secret.exists()) and not cfg.force:
        raise ConfigError(f"{public} already exists; pass --force to replace it")
    public_file, secret_file = zmq.auth.create_certificates(str(out), cfg.name)
    os.chmod(secret_file, 0o600)
    result = {"public": str(public_file), "secret": str(secret_file)}
    if cfg.authorize:
        auth_dir = Path(cfg.authorize)
        auth_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(public_file, auth_dir / Path(public_file).name)
        result["authorized"] = str(auth_dir / Path(public_file).name)
    print(dumps_strict(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
