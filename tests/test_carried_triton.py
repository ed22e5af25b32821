"""scripts/carried_triton.sh: the GPU scripts put a carried Triton (scripts/triton_bundle.sh's
.triton/triton-VERSION-cpTAG.tar.xz) first on PYTHONPATH for the linear parts only. Here with a
stand-in bundle whose triton package names its version: unpacked once, chosen by the python's tag,
nothing printed without a bundle for that python."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = f"{sys.version_info[0]}{sys.version_info[1]}"


def _bundle(path, version: str) -> None:
    code = f"__version__ = {version!r}\n".encode()
    with tarfile.open(path, "w:xz") as tar:
        info = tarfile.TarInfo("triton/__init__.py")
        info.size = len(code)
        tar.addfile(info, io.BytesIO(code))


def _path(cwd, dest) -> str:
    script = os.path.join(REPO, "scripts", "carried_triton.sh")
    proc = subprocess.run(["bash", "-c", f'. "{script}"; carried_triton_path "{sys.executable}"'], cwd=cwd,
                          env={**os.environ, "CARRIED_TRITON_DIR": str(dest)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_carried_triton_goes_first_for_its_python_only(tmp_path):
    dest = tmp_path / "unpacked"
    assert _path(tmp_path, dest) == ""  # no .triton
    (tmp_path / ".triton").mkdir()
    _bundle(tmp_path / ".triton" / "triton-9.9.9-cp0.tar.xz", "9.9.9")  # another python's
    assert _path(tmp_path, dest) == ""
    _bundle(tmp_path / ".triton" / f"triton-3.7.1-cp{TAG}.tar.xz", "3.7.1")
    got = _path(tmp_path, dest)
    assert got == str(dest)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__, triton.__file__)"],
                             env={**os.environ, "PYTHONPATH": got}, capture_output=True, text=True, timeout=60)
    assert version.stdout.split() == ["3.7.1", str(dest / "triton" / "__init__.py")], version
    (dest / "marker").write_text("kept")  # a second call reuses the unpacked copy
    assert _path(tmp_path, dest) == str(dest) and (dest / "marker").exists()
