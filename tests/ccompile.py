"""Compile one of the tests' C programs with the system compiler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def compile_c(source: Path, out_dir: Path, *, opt: str = "-O0") -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, f"a C compiler (cc) is needed to build {source.name}"
    exe = out_dir / source.stem
    subprocess.run(
        [cc, "-std=c11", opt, "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(source)],
        check=True,
        capture_output=True,
        text=True,
    )
    return exe
