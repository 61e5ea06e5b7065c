import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    paths = [p for p in ("src", "tests", "benchmarks", "scripts") if (ROOT / p).is_dir()]
    result = subprocess.run([sys.executable, "-m", "ruff", "check", *paths], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
