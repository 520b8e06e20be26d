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

from common.jsonout import dumps_strict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mfgserve-keys", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write NAME.key and "
                   "NAME.key_secret into (created if missing)")
    p.add_argument("--name", required=True, help="key pair name, e.g. server or trainer-a")
    p.add_argument("--authorize", metavar="DIR", help="also copy the public key into this "
                   "authorized-clients directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key pair")
    args = p.parse_args(argv)
    if not zmq.has("curve"):
        print("mfgserve-keys: error: this libzmq has no CURVE support", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{args.name}.key", out / f"{args.name}.key_secret"
    if (public.exists() or secret.exists()) and not args.force:
        print(f"mfgserve-keys: error: {public} already exists; pass --force to replace it",
              file=sys.stderr)
        return 2
    public_file, secret_file = zmq.auth.create_certificates(str(out), args.name)
    os.chmod(secret_file, 0o600)
    result = {"public": str(public_file), "secret": str(secret_file)}
    if args.authorize:
        auth_dir = Path(args.authorize)
        auth_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(public_file, auth_dir / Path(public_file).name)
        result["authorized"] = str(auth_dir / Path(public_file).name)
    print(dumps_strict(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
