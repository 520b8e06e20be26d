"""Host-device synchronisations made by a piece of CUDA code, as torch's sync debug mode
reports them (a warning naming the Python line of each), for the tests that the GPU path
never makes the host wait."""

from __future__ import annotations

import warnings

import torch

SYNC_WARNING = "called a synchronizing"  # torch's warning in sync debug mode "warn"


def syncs_of(fn) -> list[str]:
    """``file:line: message`` of every synchronising call ``fn()`` makes (each once)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                   if SYNC_WARNING in str(w.message)})


def assert_detects_a_sync() -> None:
    """The control: reading a device value back is reported (so an empty report means
    something on this torch)."""
    x = torch.ones(3, device="cuda")
    assert syncs_of(lambda: float(x.sum())), "sync debug mode reported no synchronisation"
