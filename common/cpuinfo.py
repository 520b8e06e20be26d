"""The first CPU's entry in Linux's ``/proc/cpuinfo``, read once for every caller that picks
or reports by CPU: ``trainer_client.model`` (which library multiplies the products, whether
bfloat16 has hardware) and ``benchmarks.report`` (the machine a benchmark ran on)."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def first_cpu(text: str | None = None) -> dict[str, str]:
    """The fields of the first processor's block of ``/proc/cpuinfo`` (or of ``text`` in its
    format), keys and values stripped, e.g. ``vendor_id``, ``cpu family``, ``model``,
    ``model name``, ``flags``; empty where the file is not there (not Linux)."""
    if text is None:
        try:
            text = CPUINFO.read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields
