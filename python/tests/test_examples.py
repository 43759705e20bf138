"""The programs in python/examples run as a newcomer runs them (a subprocess of this Python, on
the installed package), made small enough for a test: a few steps of a smaller model."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_finetune_tiny_trains_and_reports_peak_memory(tmp_path):
    png = tmp_path / "loss.png"
    args = ["--steps", "12", "--batch", "4", "--seq", "32", "--vocab", "1024", "--hidden", "64"]
    args += ["--device", "cpu", "--plot", str(png)]
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_tiny.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    peaks = dict(re.findall(r"peak memory of a training step, (\S+): (.+?) \(", out))
    assert set(peaks) == {"unpatched", "xent.torch.patch"}, out
    first, last = map(float, re.search(r"loss: ([\d.]+) at the first step, ([\d.]+)", out).groups())
    assert last < first  # a few steps on bytes already beat the uniform guess
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in out and not png.exists()
