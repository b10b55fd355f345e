"""The README's demo command keeps working."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_demo_streams_a_chat_completion_through_twistd(tmp_path: Path) -> None:
    demo = shutil.which("nixlproxy-demo", path=os.path.dirname(sys.executable))
    assert demo, "nixlproxy-demo is installed with the package"
    result = subprocess.run(
        [demo, "--token-interval", "0.01"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "twistd nixlproxy:" in result.stdout
    (said,) = [line for line in result.stdout.splitlines() if line.startswith("assistant> ")]
    # One whole sentence by default: it ends on its full stop, not on the next one's start.
    assert said.startswith("assistant> Hello from the fake decode ")
    assert said.rstrip().endswith(" all through nixl-twisted."), said
