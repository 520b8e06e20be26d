"""Import DGL on a torch it was not built for.

The newest DGL wheel on PyPI (2.1.0) targets torch <= 2.2.1. On newer torch two things
break ``import dgl``:

* ``dgl.graphbolt`` loads a C++ library built per torch version (and needs
  ``torchdata.datapipes``, gone from recent torchdata); neither exists here.
* ``dgl.utils`` falls back to ``setuptools.extern.packaging`` when ``packaging`` is
  missing, and recent setuptools removed ``setuptools.extern``.

:func:`import_dgl` first tries the plain import. Only if that fails does it install a
stub ``dgl.graphbolt`` (whose every attribute raises a clear error: mfgserve never uses
graphbolt) and alias ``setuptools.extern.packaging`` to ``packaging``, then imports again.
Core DGL (sampling, ``to_block``, METIS, ``dgl.nn``, ``partition_graph``) works after that.
"""

from __future__ import annotations

import importlib
import sys
import types

__all__ = ["import_dgl", "DGLUnavailableError"]

_dgl = None


class DGLUnavailableError(ImportError):
    """DGL cannot be imported even with the compatibility shims."""


class _GraphboltStub(types.ModuleType):
    """Stands in for ``dgl.graphbolt``; any use names the cause instead of crashing later."""

    class FusedCSCSamplingGraph:  # isinstance() checks in dgl.distributed must keep working
        pass

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise DGLUnavailableError(
            f"dgl.graphbolt.{name} is unavailable: DGL's graphbolt library has no build for "
            "this torch version, and mfgserve stubbed it so that core DGL imports. "
            "Use a DGL build matching your torch to get graphbolt."
        )


def _purge_dgl_modules() -> None:
    for name in [m for m in sys.modules if m == "dgl" or m.startswith("dgl.")]:
        del sys.modules[name]


def _install_shims() -> None:
    try:
        import packaging.version  # noqa: F401

        have_packaging = True
    except ImportError:
        have_packaging = False
    try:
        importlib.import_module("setuptools.extern.packaging")
    except Exception:
        if have_packaging:
            import packaging

            ext = sys.modules.get("setuptools.extern") or types.ModuleType("setuptools.extern")
            ext.packaging = packaging  # type: ignore[attr-defined]
            sys.modules["setuptools.extern"] = ext
            sys.modules["setuptools.extern.packaging"] = packaging
            sys.modules["setuptools.extern.packaging.version"] = packaging.version
    sys.modules["dgl.graphbolt"] = _GraphboltStub("dgl.graphbolt")


def import_dgl():
    """Return the ``dgl`` module, applying the shims only when the normal import fails.

    Raises :class:`DGLUnavailableError` naming both failures when DGL still cannot load.
    """
    global _dgl
    if _dgl is not None:
        return _dgl
    try:
        import dgl  # noqa: PLC0415

        _dgl = dgl
        return dgl
    except Exception as first:  # graphbolt raises OSError / ImportError / FileNotFoundError
        first_error = first
    _purge_dgl_modules()
    _install_shims()
    try:
        import dgl  # noqa: PLC0415
    except Exception as second:
        raise DGLUnavailableError(
            f"cannot import dgl: plain import failed with {first_error!r}; with the graphbolt "
            f"stub and setuptools.extern alias it failed with {second!r}. Install dgl==2.1.0 "
            "(pip install dgl==2.1.0) with pandas and packaging."
        ) from second
    # dgl.__init__ binds the submodule attribute from sys.modules; make it the stub too.
    dgl.graphbolt = sys.modules["dgl.graphbolt"]
    _dgl = dgl
    return dgl
