"""Runs scripts/dev/gpu_session.py (a GPU session's work in one device call) with the same
arguments: the development tool lives under scripts/dev/, this path stays for the instructions
that name it."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = str(Path(__file__).resolve().parent / "dev" / "gpu_session.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
