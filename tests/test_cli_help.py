"""The ``quads`` command line itself: ``quads --help`` imports no subcommand (so no torch) and stays fast."""

import subprocess
import sys

import pytest


def test_top_level_help_imports_no_subcommand_module():
    code = ("import sys\nfrom quads.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('quads.rl', 'quads.export')))\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "train" in out and "export" in out  # every subcommand is listed
    assert "HEAVY []" in out, out.splitlines()[-1]


@pytest.mark.parametrize("command", ["eval", "export", "train", "diagnose"])
def test_commands_that_compute_take_threads(command, capsys):
    from quads.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--threads" in capsys.readouterr().out
