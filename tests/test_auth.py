"""CurveZMQ authentication in server-client mode: only listed client keys get replies, and
servers authenticate to each other for cross-partition requests."""

from __future__ import annotations

import json

import pytest
import torch
import zmq
from procs import run_cli
from rpc_helpers import call

from common.cluster import ClusterSpec
from common.errors import PeerDisconnectedError, PeerTimeoutError
from common.messages import MFGReply, Ping, Pong, SampleRequest
from common.sockets import CurveKeys

pytestmark = pytest.mark.timeout(180)


def _keys(tmp_path, name: str, authorize: bool) -> dict:
    args = ["--out", tmp_path / "keys", "--name", name]
    if authorize:
        args += ["--authorize", tmp_path / "authorized"]
    return json.loads(run_cli("deploy.keys", args, timeout=60).stdout.strip().splitlines()[-1])


def test_only_authorized_clients_are_answered(server_factory, synth_parts2, tmp_path):
    server = _keys(tmp_path, "server", authorize=True)  # servers are clients of each other
    trainer = _keys(tmp_path, "trainer", authorize=True)
    intruder = _keys(tmp_path, "intruder", authorize=False)
    cluster = ClusterSpec({p: [f"ipc://{tmp_path}/a{p}.sock"] for p in range(2)},
                          curve_server_key=server["public"])
    cluster_file = tmp_path / "cluster.yaml"
    cluster.write(cluster_file)
    curve_args = ["--curve-secret-key", server["secret"],
                  "--curve-authorized-keys", str(tmp_path / "authorized")]
    for p, ep in cluster.all_endpoints():
        server_factory(synth_parts2, p, cluster=cluster_file, endpoint=ep, extra=curve_args)
    ep0 = cluster.partitions[0][0]
    ctx = zmq.Context()
    try:
        good = CurveKeys.load(trainer["secret"], server["public"])
        call(ep0, Ping(), Pong, ctx=ctx, timeout_s=20, curve=good)
        # seeds of both parts: part 0's server must authenticate to part 1's server
        seeds = torch.tensor([0, 1, 2, 2999, 2998])
        reply = call(ep0, SampleRequest(seeds=seeds, fanouts=[3, 3]), ctx=ctx, timeout_s=20,
                     curve=good)
        assert isinstance(reply, MFGReply) and reply.mfg.only.label.numel() == 5
        assert reply.timings["remote_requests"] > 0

        wrong_server = _keys(tmp_path, "fake-server", authorize=False)
        attempts = {
            "no keys": None,
            "unlisted client key": CurveKeys.load(intruder["secret"], server["public"]),
            "wrong server key": CurveKeys.load(trainer["secret"], wrong_server["public"]),
        }
        for _what, curve in attempts.items():
            # refused: the handshake fails, so no reply ever comes (a dropped connection
            # or the deadline, never an answer)
            with pytest.raises((PeerTimeoutError, PeerDisconnectedError)):
                call(ep0, Ping(), ctx=ctx, timeout_s=2, curve=curve)
    finally:
        ctx.destroy(linger=0)

    # the trainer CLI with its key trains against the authenticated servers
    proc = run_cli("deploy.trainer_cli", ["--cluster", cluster_file, "--epochs", "1",
                                          "--batch-size", "512", "--fanouts", "4,4",
                                          "--no-progress", "--curve-secret-key",
                                          trainer["secret"]], timeout=120)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["epochs"] == 1
    # and without it, it stops with a clear error instead of hanging
    proc = run_cli("deploy.trainer_cli", ["--cluster", cluster_file, "--epochs", "1",
                                          "--no-progress", "--request-timeout-s", "3"],
                   timeout=60, check=False)
    assert proc.returncode == 2 and "--curve-secret-key" in proc.stderr, proc.stderr


def test_key_file_errors_are_clear(synth_parts1, tmp_path):
    proc = run_cli("sampler_server.main", ["--parts", synth_parts1, "--curve-secret-key",
                                           tmp_path / "missing.key_secret",
                                           "--curve-authorized-keys", tmp_path],
                   timeout=60, check=False)
    assert proc.returncode == 2 and "mfgserve-keys" in proc.stderr
    proc = run_cli("sampler_server.main", ["--parts", synth_parts1, "--curve-secret-key",
                                           tmp_path / "x"], timeout=60, check=False)
    assert proc.returncode == 2 and "--curve-authorized-keys" in proc.stderr
