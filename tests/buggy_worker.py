"""A sampler worker with a bug, for the service runtime's tests (tests/test_service.py); run
as a process, ``python -m tests.buggy_worker BACKEND INDEX``, it serves a ProcessExecutor."""

from __future__ import annotations

import sys

from common import codec
from common.executors import run_worker_process
from common.messages import Ack
from common.stats import SampleCounts


class BuggyWorker:
    """Sampling with a bug (an IndexError) for odd first seeds; an Ack for the others."""

    def serve(self, msg, rid, t_in):
        if int(msg.seeds[0]) % 2:
            return [0][1], SampleCounts()
        return codec.encode(Ack(), rid), SampleCounts(sample_requests=1)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(run_worker_process(sys.argv[1], lambda ctx: BuggyWorker(), int(sys.argv[2]),
                                1 << 20, where="test worker"))
