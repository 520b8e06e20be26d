"""A sampler worker process of a server (``sampler-server --sampler-procs N``).

Started by the server, never by hand. It maps the same partition files (page cache shared with
the server and its other workers), connects a DEALER to the server's private ``ipc`` backend
socket and loops::

    server -> worker:  [b"JOB", client identity, t_in (float64), *request frames]
                       [b"STOP"]
    worker -> server:  [b"READY"]  once loaded
                       [b"R", stats (msgpack), client identity, *reply frames]

The server forwards the reply frames to the client unchanged. The worker exits when told to,
when the server process goes away (PR_SET_PDEATHSIG, and a parent-pid check), or with exit
code 1 if it breaks; the server treats any worker exit it did not ask for as fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import struct
import sys

import msgpack
import torch
import zmq

from common import codec
from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.messages import ErrorReply, SampleRequest
from common.sockets import make_socket
from partition.layout import load_hot_rank
from sampler_server.partition_store import PartitionStore
from sampler_server.sample_worker import SampleWorker, peer_keys

log = logging.getLogger("mfgserve.server")
T_IN = struct.Struct("<d")


def worker_argv(cfg: ServerConfig, backend: str, index: int) -> list[str]:
    return [sys.executable, "-m", "sampler_server.sampler_proc", "--backend", backend,
            "--index", str(index), "--config-json", json.dumps(dataclasses.asdict(cfg))]


def run(cfg: ServerConfig, backend: str, index: int) -> int:
    parent = os.getppid()
    store = PartitionStore(cfg.parts, cfg.part_id, seed=cfg.seed * 1000 + index + 1)
    cluster = ClusterSpec.load(cfg.cluster) if cfg.cluster else None
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, backend, bind=False, hwm=0)
    worker = SampleWorker(cfg, store, load_hot_rank(cfg.parts), ctx, cluster,
                          peer_keys(cfg, cluster))
    max_bytes = cfg.max_message_mb << 20
    try:
        sock.send(b"READY")
        while True:
            if not sock.poll(200):
                worker.shm.expire()
                if os.getppid() != parent:
                    log.error("sampler process %d: the server is gone; exiting", index)
                    return 1
                continue
            frames = sock.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == b"STOP":
                return 0
            ident, t_in = frames[1], T_IN.unpack(frames[2].bytes)[0]
            try:
                msg, rid = codec.decode(frames[3:], max_bytes)
                if not isinstance(msg, SampleRequest):
                    raise TypeError(f"sampler process got {type(msg).__name__}")
                reply, stats = worker.serve(msg, rid, t_in)
            except Exception as e:  # the server decoded it already: a bug, reported
                log.exception("sampler process %d: bad job", index)
                reply = codec.encode(ErrorReply(code="internal", message=f"{e}"),
                                     codec.peek_request_id(frames[3]))
                stats = {"errors": 1}
            sock.send_multipart([b"R", msgpack.packb(stats), ident, *reply], copy=False)
    finally:
        worker.close()
        sock.close(0)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sampler_server.sampler_proc",
                                description="internal: a sampler server's worker process")
    p.add_argument("--backend", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--config-json", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(name)s[sampler {args.index}] %(message)s")
    torch.set_num_threads(1)
    cfg = ServerConfig(**json.loads(args.config_json))
    try:
        return run(cfg, args.backend, args.index)
    except KeyboardInterrupt:
        return 0
    except Exception:
        log.exception("sampler process %d failed", args.index)
        return 1


if __name__ == "__main__":
    sys.exit(main())
