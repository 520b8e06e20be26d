"""The wire alone: payload MB/s of mfgserve messages vs raw ZeroMQ frames, tcp and ipc.

A receiver process binds a PULL socket; this process sends ``count`` messages of ``mb`` MiB
of payload each. Two variants on the same sockets:

* ``raw``: one frame per message holding the payload bytes (the baseline: what zmq alone does);
* ``codec``: an :class:`MFGReply` whose feature tensor is the payload (plus small CSC tensors),
  encoded by :mod:`common.codec` (msgpack header + raw frames, ``copy=False``) and decoded on
  the receiver with full validation and ``torch.frombuffer`` (no copy).

The receiver times from the first to the last message (so process start-up is excluded) and
reports MB/s of payload; ``ratio`` = codec / raw. Run: ``python -m benchmarks.wire``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from common import codec
from common.messages import MFGReply
from common.sampled_mfg import Features, Layer, SampledMFG

RECEIVER = r"""
import sys, time, json, zmq
from common import codec
ep, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.setsockopt(zmq.RCVHWM, 4); s.bind(ep)
print("ready", flush=True)
payload = 0
for i in range(count):
    frames = s.recv_multipart(copy=False)
    if i == 0:
        t0 = time.perf_counter()
        continue
    if mode == "codec":
        msg, _ = codec.decode(frames)
        rows = msg.mfg.only.feat.rows
        payload += rows.numel() * rows.element_size()
    else:
        payload += len(frames[0])
dt = time.perf_counter() - t0
print(json.dumps({"mb_per_s": payload / dt / 1e6, "seconds": dt, "messages": count - 1}))
"""


def _message(payload_bytes: int) -> MFGReply:
    n = max(payload_bytes // (100 * 4), 1)
    seeds = min(n, 1024)
    layer = Layer.homogeneous(n, seeds, torch.zeros(seeds + 1, dtype=torch.int64),
                              torch.empty(0, dtype=torch.int64))
    return MFGReply(mfg=SampledMFG.homogeneous(torch.arange(n), [layer],
                                               Features.frames(torch.randn(n, 100)),
                                               torch.zeros(seeds, dtype=torch.int64)))


def measure(endpoint: str, mode: str, mb: float, count: int) -> dict:
    repo = Path(__file__).resolve().parents[1]
    recv = subprocess.Popen([sys.executable, "-c", RECEIVER, endpoint, mode, str(count)],
                            stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError("wire receiver failed to start")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(endpoint)
        msg = _message(int(mb * (1 << 20)))
        raw = memoryview(msg.mfg.only.feat.rows.numpy()).cast("B")
        for _ in range(count):
            if mode == "codec":
                sock.send_multipart(codec.encode(msg, 1), copy=False)
            else:
                sock.send(raw, copy=False)
        out, _ = recv.communicate(timeout=600)
        sock.close()
        ctx.term()
        if recv.returncode != 0:
            raise RuntimeError(f"wire receiver exited with {recv.returncode}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()


def measure_wire(mb: float = 64.0, count: int = 40) -> dict:
    """raw vs codec MB/s over tcp loopback and ipc, and the ratios."""
    out: dict = {"payload_mb": mb, "messages": count}
    with tempfile.TemporaryDirectory(prefix="mfgwire-") as tmp:
        for transport, ep in (("tcp", "tcp://127.0.0.1:{port}"), ("ipc", f"ipc://{tmp}/w")):
            for mode in ("raw", "codec"):
                endpoint = ep
                if transport == "tcp":
                    import socket

                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        endpoint = ep.format(port=s.getsockname()[1])
                out[f"{transport}_{mode}_mb_per_s"] = round(
                    measure(endpoint, mode, mb, count)["mb_per_s"], 1)
            out[f"{transport}_ratio"] = round(
                out[f"{transport}_codec_mb_per_s"] / out[f"{transport}_raw_mb_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wire", description=__doc__)
    p.add_argument("--mb", type=float, default=64.0, help="payload MiB per message (64)")
    p.add_argument("--count", type=int, default=40, help="messages per measurement (40)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    result = measure_wire(args.mb, args.count)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
