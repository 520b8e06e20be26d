"""docs/configuration.md is generated from the config dataclasses and must be current; every
option of every command's real parser is in it, and every console script has a section."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import REPO

from common import configdoc


def _configdoc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.configdoc", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)


@pytest.mark.timeout(300)
def test_committed_reference_is_current():
    proc = _configdoc("--check")
    assert proc.returncode == 0, (
        "docs/configuration.md is stale; run `python -m common.configdoc` and commit it:\n"
        + proc.stderr[-2000:])


@pytest.mark.timeout(120)
def test_check_names_a_stale_file(tmp_path, capsys):
    doc = tmp_path / "configuration.md"
    assert configdoc.main(["--out", str(doc)]) == 0
    assert configdoc.main(["--check", "--out", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("| `--fanouts` |", "| `--fan-outs` |", 1))
    capsys.readouterr()
    assert configdoc.main(["--check", "--out", str(doc)]) == 1
    err = capsys.readouterr().err
    assert str(doc) in err and "python -m common.configdoc" in err


def _parser_flags(cmd: configdoc.Command) -> set[str]:
    parser = configdoc._load(cmd.parser)()
    return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help", "--config"}


@pytest.mark.timeout(120)
def test_every_parser_option_is_documented():
    """Each command's real parser has exactly the documented options, each in its section."""
    text = configdoc.generate()
    commands = [c for c in configdoc.COMMANDS if configdoc._available(c)]
    assert {"sampler-server", "trainer-client", "worker-mode", "server-node",
            "partition-ogbn", "mfgserve-keys", "mfgserve-plot"} <= {c.name for c in commands}
    for cmd in commands:
        assert _parser_flags(cmd) == configdoc.documented_flags(cmd), cmd.name
        section = text.split(f"## {cmd.name}\n", 1)[1].split("\n## ", 1)[0]
        for flag in configdoc.documented_flags(cmd):
            if not flag.startswith("--no-"):
                assert f"`{flag}" in section, (cmd.name, flag)


def _console_scripts() -> list[str]:
    """The names under pyproject.toml's [project.scripts] (no tomllib: Python 3.10)."""
    text = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    section = text.split("\n[", 1)[0]
    return [ln.split("=")[0].strip() for ln in section.splitlines() if "=" in ln]


def test_every_console_script_has_a_section():
    scripts = _console_scripts()
    assert "worker-mode" in scripts and "mfgserve-plot" in scripts
    listed = {c.name for c in configdoc.COMMANDS}
    missing = [name for name in scripts if name not in listed]
    assert not missing, f"console scripts without an entry in configdoc.COMMANDS: {missing}"


def stray_option_parser():
    """plot_cli's parser plus an option no config dataclass holds (for the test below)."""
    from deploy.plot_cli import build_parser

    p = build_parser()
    p.add_argument("--stray", help="not a config field")
    return p


def test_an_option_outside_the_dataclasses_is_refused():
    cmd = configdoc.Command("mfgserve-plot", f"{__name__}:stray_option_parser",
                            (("common.config:PlotConfig", ""),))
    with pytest.raises(RuntimeError, match="--stray"):
        configdoc.command_section(cmd)
