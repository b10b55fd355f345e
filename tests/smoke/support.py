"""What the smoke tests share: a command run to its end, and a failure that says why."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ran:
    """A command that ran to its end, or was killed at its timeout, and what it wrote."""

    command: list[str]
    #: Its exit code; None when it was killed at the timeout.
    code: int | None
    stdout: str
    stderr: str
    timeout: float

    def why(self, expected: str) -> str:
        """An assertion message: what was expected, and everything the command said."""
        ended = f"killed after {self.timeout:g} s" if self.code is None else f"exit {self.code}"
        return (
            f"expected {expected}\n"
            f"command: {shlex.join(self.command)}\n"
            f"ended: {ended}\n"
            f"--- stdout ---\n{self.stdout}\n"
            f"--- stderr ---\n{self.stderr}"
        )


def run(command: Sequence[str], timeout: float = 240.0, cwd: Path = ROOT) -> Ran:
    """Run ``command`` in a session of its own, so that at the timeout every
    process it started is killed with it (none outlives the test)."""
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return Ran(list(command), None, stdout, stderr, timeout)
    return Ran(list(command), process.returncode, stdout, stderr, timeout)
