"""Executors: where a :class:`~common.service.Service` runs the requests it offloads.

One interface, three kinds:

* :class:`InlineExecutor` runs a request in the IO thread as it arrives (tests, tools; never
  for a server whose sampling waits on peer servers, which could wait on it in turn).
* :class:`ThreadExecutor`: N threads behind a bounded queue; results come back to the IO
  thread through an inproc PULL socket.
* :class:`ProcessExecutor`: N worker processes (``run_worker_process``) on a private ``ipc``
  socket; a process takes a job only when idle. Jobs and results are codec messages::

      server -> worker:  SampleJob (the decoded request, its client and arrival time)
                         WorkerStop
      worker -> server:  WorkerReady once loaded
                         SampleResult (client, stats, the reply's frames, sent on unchanged)

A worker object (a :class:`JobWorker`, one per thread or process) serves one request:
``serve(msg, rid, t_in) -> (reply frames, SampleCounts)``. :func:`run_job` turns whatever it
raises into an error reply through the service's one mapping. A thread or process that
breaks (not a request: the thread or process itself) stops the service (exit code 1).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import subprocess
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
import zmq

from common import codec
from common.errors import ChildFailedError
from common.lifetime import die_with_parent
from common.messages import Message, SampleJob, SampleResult, WorkerReady, WorkerStop
from common.rundirs import make_run_dir, remove_stale_run_dirs
from common.service import Call, Service, error_reply
from common.sockets import make_socket
from common.stats import SampleCounts

log = logging.getLogger("mfgserve.server")
START_TIMEOUT_S = 300.0


class JobWorker(Protocol):
    def serve(self, msg: Any, rid: int, t_in: float) -> tuple[list, SampleCounts]: ...

    def idle(self) -> None: ...  # called about every 0.2 s while there is no work

    def close(self) -> None: ...


MakeWorker = Callable[[zmq.Context], JobWorker]


def run_job(worker: JobWorker, msg: Any, rid: int, t_in: float, where: str
            ) -> tuple[list, SampleCounts]:
    """(reply frames, counts) of one request; an exception becomes an error reply."""
    try:
        return worker.serve(msg, rid, t_in)
    except Exception as e:
        return codec.encode(error_reply(e, where), rid), SampleCounts(errors=1)


class Executor:
    """The interface (and the no-op parts) every executor has."""

    service: Service

    def start(self, service: Service) -> None:
        self.service = service

    def submit(self, msg: Message, call: Call) -> bool:
        """Queue ``msg`` (False: the queue is full)."""
        raise NotImplementedError

    def sockets(self) -> list[zmq.Socket]:
        """Sockets the IO loop watches for results."""
        return []

    def drain(self, sock: zmq.Socket) -> None:
        """Send the results waiting on ``sock`` (called by the IO loop)."""

    def tick(self) -> None:
        """Called by the IO loop after every poll (at least every 0.2 s)."""

    def queue_len(self) -> int:
        """Requests queued or being served."""
        return 0

    def samplers(self) -> tuple[str, int, int]:
        """What serves the offloaded requests: (kind, how many, how many are alive)."""
        return "inline", 1, 1

    def close(self) -> bool:
        """Stop; True when no thread of it still holds a socket."""
        return True


class InlineExecutor(Executor):
    def __init__(self, make_worker: MakeWorker):
        self.make_worker = make_worker
        self.worker: JobWorker | None = None

    def start(self, service: Service) -> None:
        super().start(service)
        self.worker = self.make_worker(service.ctx)

    def submit(self, msg: Message, call: Call) -> bool:
        assert self.worker is not None
        frames, counts = run_job(self.worker, msg, call.rid, call.t_in, self.service.where)
        self.service.stats.add(counts)
        self.service.send(call.client, frames)
        return True

    def tick(self) -> None:
        if self.worker is not None:
            self.worker.idle()

    def close(self) -> bool:
        if self.worker is not None:
            self.worker.close()
        return True


class ThreadExecutor(Executor):
    def __init__(self, make_worker: MakeWorker, threads: int, max_queue: int, join_s: float):
        self.make_worker = make_worker
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.join_s = join_s
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True,
                                         name=f"sampler-{i}") for i in range(threads)]

    def start(self, service: Service) -> None:
        super().start(service)
        self.results_ep = f"inproc://results-{uuid.uuid4().hex[:8]}"
        self.results = make_socket(service.ctx, zmq.PULL, self.results_ep, bind=True, hwm=0)
        for t in self.threads:
            t.start()

    def submit(self, msg: Message, call: Call) -> bool:
        try:
            self.jobs.put_nowait((msg, call))
            return True
        except queue.Full:
            return False

    def sockets(self) -> list[zmq.Socket]:
        return [self.results]

    def drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.service.send(frames[0], frames[1:])

    def queue_len(self) -> int:
        return self.jobs.qsize()

    def samplers(self) -> tuple[str, int, int]:
        return "threads", len(self.threads), sum(t.is_alive() for t in self.threads)

    def _loop(self, index: int) -> None:
        """One sampling thread; if the thread itself breaks, the service stops (exit 1), so
        that clients see a dropped connection and fail over."""
        service, push, worker = self.service, None, None
        try:
            push = make_socket(service.ctx, zmq.PUSH, self.results_ep, bind=False, hwm=0)
            worker = self.make_worker(service.ctx)
            while not service.stop_event.is_set():
                worker.idle()
                try:
                    msg, call = self.jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                frames, counts = run_job(worker, msg, call.rid, call.t_in, service.where)
                service.stats.add(counts)
                push.send_multipart([call.client, *frames], copy=False)
        except Exception as e:
            log.exception("%s: sampler thread %d failed; stopping the server", service.where,
                          index)
            service.fail(f"sampler thread {index} failed: {type(e).__name__}: {e}")
        finally:
            if worker is not None:
                worker.close()
            if push is not None:
                push.close(0)

    def close(self) -> bool:
        for t in self.threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=self.join_s)
        self.results.close(0)
        return not any(t.is_alive() for t in self.threads)


def _client_tensor(client: Any) -> torch.Tensor:
    data = client.bytes if isinstance(client, zmq.Frame) else bytes(client)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _frames_as_tensors(frames: list) -> list[torch.Tensor]:
    """Encoded reply frames as uint8 tensors (zero-copy but for the small header)."""
    out = []
    for f in frames:
        view = memoryview(f).cast("B")
        if view.readonly:
            view = memoryview(bytearray(view))  # the msgpack header: a few hundred bytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out.append(torch.frombuffer(view, dtype=torch.uint8) if view.nbytes
                       else torch.empty(0, dtype=torch.uint8))
    return out


class ProcessExecutor(Executor):
    def __init__(self, argv: Callable[[str, int], list[str]], procs: int, max_queue: int,
                 stop_s: float):
        self.argv = argv  # (backend endpoint, index) -> the worker process's command line
        self.num_procs = procs
        self.max_queue = max_queue
        self.stop_s = stop_s
        self.procs: list[subprocess.Popen] = []
        self.pending: deque = deque()  # (msg, call) not yet given to a process
        self.idle: deque = deque()  # identities of idle worker processes
        self.dir: str | None = None

    def start(self, service: Service) -> None:
        """Start the processes and wait until each has loaded (it says WorkerReady)."""
        super().start(service)
        remove_stale_run_dirs()  # left by servers killed with SIGKILL (common/rundirs.py)
        self.dir = str(make_run_dir("samplers-"))  # 0700: the backend socket
        backend = f"ipc://{self.dir}/backend.sock"
        self.backend = make_socket(service.ctx, zmq.ROUTER, backend, bind=True, hwm=0)
        try:
            for i in range(self.num_procs):
                self.procs.append(subprocess.Popen(self.argv(backend, i),
                                                   stdin=subprocess.DEVNULL,
                                                   preexec_fn=die_with_parent))
            self._wait_ready()
        except BaseException:
            # The service never starts serving, so close() will not run: stop what started.
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.idle) < len(self.procs):
            self.tick()
            if self.service.fatal:
                raise ChildFailedError(f"{self.service.where}: {self.service.fatal}")
            if time.monotonic() > deadline:
                raise ChildFailedError(
                    f"{self.service.where}: {len(self.procs) - len(self.idle)} sampler "
                    f"process(es) not ready after {START_TIMEOUT_S:.0f}s; use fewer "
                    "--sampler-procs or check memory")
            if self.backend.poll(200):
                self.drain(self.backend)

    def submit(self, msg: Message, call: Call) -> bool:
        if len(self.pending) >= self.max_queue:
            return False
        self.pending.append((msg, call))
        self._pump()
        return True

    def _pump(self) -> None:
        while self.idle and self.pending:
            msg, call = self.pending.popleft()
            job = SampleJob.of(msg, _client_tensor(call.client), call.t_in)
            self.backend.send_multipart([self.idle.popleft(), *codec.encode(job, call.rid)],
                                        copy=False)

    def sockets(self) -> list[zmq.Socket]:
        return [self.backend]

    def drain(self, sock: zmq.Socket) -> None:
        """Results (sent on, their counts added) and ready workers; then more jobs."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg, _ = codec.decode(frames[1:], self.service.max_bytes + (1 << 20))
            if isinstance(msg, SampleResult):
                self.service.stats.add(SampleCounts.from_wire(msg.stats))
                self.service.send(msg.client.numpy().tobytes(),
                                  [t.numpy() for t in msg.reply])
            self.idle.append(frames[0].bytes)
        self._pump()

    def tick(self) -> None:
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and self.service.fatal is None:
                self.service.fail(f"sampler process {i} (pid {proc.pid}) exited with code "
                                  f"{code}; see its log lines above")

    def queue_len(self) -> int:
        return len(self.pending) + len(self.procs) - len(self.idle)

    def samplers(self) -> tuple[str, int, int]:
        return "processes", len(self.procs), sum(p.poll() is None for p in self.procs)

    def close(self) -> bool:
        """Tell every process to stop; kill those that do not within the deadline."""
        stop = codec.encode(WorkerStop(), 0)
        for wid in set(self.idle):
            self.backend.send_multipart([wid, *stop])
        # Busy ones finish their job first; their stop goes when they report back.
        deadline = time.monotonic() + self.stop_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            if self.backend.poll(100):
                self.backend.send_multipart([self.backend.recv_multipart()[0], *stop])
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.backend.close(0)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return True


def run_worker_process(backend: str, make_worker: MakeWorker, index: int,
                       max_message_bytes: int, where: str) -> int:
    """The loop of a worker process of a :class:`ProcessExecutor`: serve jobs until told to
    stop (0), or until the server process is gone (1)."""
    parent = os.getppid()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, backend, bind=False, hwm=0)
    worker = make_worker(ctx)
    try:
        sock.send_multipart(codec.encode(WorkerReady(index=index, pid=os.getpid()), 0))
        while True:
            if not sock.poll(200):
                worker.idle()
                if os.getppid() != parent:
                    log.error("%s: sampler process %d: the server is gone; exiting", where,
                              index)
                    return 1
                continue
            job, rid = codec.decode(sock.recv_multipart(copy=False), max_message_bytes)
            if not isinstance(job, SampleJob):  # WorkerStop
                return 0
            frames, counts = run_job(worker, job, rid, job.t_in, where)
            result = SampleResult(client=job.client, stats=counts.to_wire(),
                                  reply=_frames_as_tensors(frames))
            sock.send_multipart(codec.encode(result, rid), copy=False)
    finally:
        worker.close()
        sock.close(0)
        ctx.term()
