"""Generate the Python code for protos/quayutec/v1 into quayutec/v1 (committed).

Run with `python scripts/gen_protos.py`; `--check` regenerates into a scratch folder and fails
when the committed output differs, which CI uses to catch stale generated code.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("quayutec") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
INIT_TEXT = '"""Generated from protos/quayutec/v1 by scripts/gen_protos.py; do not edit."""\n'


def generate(out_root: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bin_dir = Path(sys.executable).parent
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_root / PACKAGE_DIR / "__init__.py").write_text(INIT_TEXT)


def generated_files(root: Path) -> list[str]:
    folder = root / PACKAGE_DIR
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES) or p.name == "__init__.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if regenerating changes anything")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        (out / PACKAGE_DIR).mkdir(parents=True)
        generate(out)
        fresh = generated_files(out)
        target = ROOT / PACKAGE_DIR
        if opts.check:
            current = generated_files(ROOT) if target.exists() else []
            _, mismatch, errors = filecmp.cmpfiles(out / PACKAGE_DIR, target, fresh, shallow=False)
            stale = sorted(set(mismatch) | set(errors) | (set(current) ^ set(fresh)))
            if stale:
                print("generated code is stale; run `python scripts/gen_protos.py`:", *stale, sep="\n  ")
                return 1
            print(f"generated code is current ({len(fresh)} files)")
            return 0
        target.mkdir(parents=True, exist_ok=True)
        for name in generated_files(ROOT) if target.exists() else []:
            (target / name).unlink()
        for name in fresh:
            shutil.copy2(out / PACKAGE_DIR / name, target / name)
        print(f"wrote {len(fresh)} files to {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
