"""100 SpecDecodeDeployments reconciled against the emulator: all Ready, no errors (slow)."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_hundred_fleets_become_ready_without_errors():
    result = subprocess.run([sys.executable, str(ROOT / "operator" / "scripts" / "scale_test.py"), "--count", "100",
                             "--timeout", "240"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| 100 |" in result.stdout
