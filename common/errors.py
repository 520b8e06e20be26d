"""Error types shared by every layer. Each message says what failed and what to change."""

from __future__ import annotations


class MfgServeError(Exception):
    """Base class of mfgserve's own errors: expected failures, reported by a CLI as one line
    ``PROG: error: MESSAGE`` and exit code ``exit_code`` (see common/cli.py)."""

    exit_code = 2  # bad input, unless a subclass says otherwise


class ChildFailedError(MfgServeError):
    """A child process (a server, a trainer, a sampler process) failed or never became
    ready; the message names it."""

    exit_code = 1


class ConfigError(MfgServeError, ValueError):
    """A config file or command-line option is invalid."""


class ProtocolError(MfgServeError):
    """A message violates the wire protocol. ``code`` is a short machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class PeerTimeoutError(MfgServeError, TimeoutError):
    """A peer did not answer within its deadline."""


class PeerDisconnectedError(MfgServeError, ConnectionError):
    """A peer's connection dropped with requests unanswered (it died or restarted)."""


class StoppingError(MfgServeError):
    """This process is stopping: a wait for a peer's reply was given up (a server stops within
    moments of SIGTERM, not after a request to a dead peer times out)."""


class RemoteError(MfgServeError):
    """A peer answered with an error reply."""

    def __init__(self, peer: str, code: str, message: str, rid: int = 0):
        super().__init__(f"{peer} replied with error [{code}]: {message}")
        self.peer = peer
        self.code = code
        self.rid = rid  # the request it answers


class BadRequestError(MfgServeError, ValueError):
    """A well-formed request a server cannot serve as asked (e.g. for nodes it does not
    hold): answered with error code ``bad_request`` (common/service.py), not a bug."""
