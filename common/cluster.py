"""The cluster file: which server endpoints serve which partition.

YAML::

    partitions:
      0: [tcp://10.0.0.1:15550, tcp://10.0.0.2:15550]   # two replicas of part 0
      1: [tcp://10.0.0.3:15550]

Every part 0..P-1 must be listed with at least one endpoint. With CurveZMQ authentication
the file also names the servers' public key (written by ``mfgserve-keys``)::

    curve_server_key: keys/server.key
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from common.errors import ConfigError
from common.sockets import CurveKeys


@dataclass
class ClusterSpec:
    partitions: dict[int, list[str]]
    curve_server_key: str = ""

    @property
    def num_parts(self) -> int:
        return len(self.partitions)

    def all_endpoints(self) -> list[tuple[int, str]]:
        return [(p, ep) for p in sorted(self.partitions) for ep in self.partitions[p]]

    def client_keys(self, secret_key_file: str, where: str) -> CurveKeys | None:
        """A client's CurveZMQ keys for these servers (None: the cluster runs without
        CurveZMQ). ``secret_key_file`` is the client's --curve-secret-key, ``where`` names the
        cluster file in messages; the two must agree on whether CurveZMQ is on."""
        if secret_key_file and not self.curve_server_key:
            raise ConfigError(f"--curve-secret-key is set but cluster file {where} has no "
                              "curve_server_key (the servers' public key file); add it")
        if self.curve_server_key and not secret_key_file:
            raise ConfigError(f"cluster file {where} names curve_server_key: its servers "
                              "require CurveZMQ; pass this client's key with --curve-secret-key")
        return CurveKeys.load(secret_key_file, self.curve_server_key) if secret_key_file else None

    def to_yaml(self) -> str:
        data: dict = {"partitions": {p: list(v) for p, v in self.partitions.items()}}
        if self.curve_server_key:
            data["curve_server_key"] = self.curve_server_key
        return yaml.safe_dump(data)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"cluster file {path} does not exist; fix --cluster")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"cluster file {path} is not valid YAML: {e}") from e
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: object, where: str) -> ClusterSpec:
        if (not isinstance(data, dict) or "partitions" not in data
                or not set(data) <= {"partitions", "curve_server_key"}
                or not isinstance(data["partitions"], dict)):
            raise ConfigError(f"{where}: expected a mapping 'partitions: {{0: [endpoint, ...]}}' "
                              "and optionally 'curve_server_key: FILE'")
        server_key = data.get("curve_server_key", "")
        if not isinstance(server_key, str):
            raise ConfigError(f"{where}: curve_server_key must be a file path")
        parts: dict[int, list[str]] = {}
        for key, eps in data["partitions"].items():
            if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                raise ConfigError(f"{where}: partition key {key!r} must be an integer >= 0")
            if isinstance(eps, str):
                eps = [eps]
            if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
                raise ConfigError(f"{where}: partition {key} needs a list of endpoints")
            for e in eps:
                if not e.startswith(("tcp://", "ipc://", "inproc://")):
                    raise ConfigError(f"{where}: {e!r} is not a ZeroMQ endpoint "
                                      "(tcp://HOST:PORT or ipc:///path)")
            parts[key] = eps
        if sorted(parts) != list(range(len(parts))):
            raise ConfigError(f"{where}: partitions must be numbered 0..P-1, got {sorted(parts)}")
        if server_key and not Path(server_key).is_absolute():
            server_key = str(Path(where).parent / server_key)  # relative to the cluster file
        return cls(parts, server_key)
