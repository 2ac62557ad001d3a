"""Generate the Python code for protos/quayutec/v1 into quayutec/v1, and the Python client's copy of
the Gateway API's messages into clients/python/src/quayutec_client/_proto (both committed).

Run with `python scripts/gen_protos.py`; `--check` regenerates into a scratch folder and fails
when the committed output differs, which CI uses to catch stale generated code.

The client ships its own copy under its own package name, so it never imports our `quayutec`
package: the same generated code with its imports pointed at `quayutec_client._proto`. Only
gateway.proto and what it imports are copied, and no gRPC stubs: the client builds its calls from
the service descriptor.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("quayutec") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
INIT_TEXT = '"""Generated from protos/quayutec/v1 by scripts/gen_protos.py; do not edit."""\n'

CLIENT_PACKAGE = "quayutec_client._proto"
CLIENT_PROTOS = ("common.proto", "gateway.proto")
CLIENT_INIT_TEXT = (
    '"""The Gateway API\'s messages, generated from protos/quayutec/v1 by scripts/gen_protos.py; do not edit."""\n'
)


@dataclass(frozen=True)
class Target:
    """One folder of generated code: where it is committed and how it is made."""

    name: str
    folder: Path  # relative to the repository

    def generate(self, out: Path) -> None:
        if self.name == "services":
            _protoc(out, sorted(p.name for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto")), grpc=True)
            (out / "__init__.py").write_text(INIT_TEXT)
        else:
            _protoc(out, list(CLIENT_PROTOS), grpc=False)
            for path in out.iterdir():
                _point_imports_at_client(path)
            (out / "__init__.py").write_text(CLIENT_INIT_TEXT)


TARGETS = (
    Target("services", PACKAGE_DIR),
    Target("client", Path("clients/python/src/quayutec_client/_proto")),
)


def _protoc(out: Path, names: list[str], *, grpc: bool) -> None:
    """Run protoc on ``names`` (files of protos/quayutec/v1) and move its output flat into ``out``."""
    include = Path(protoc.__file__).parent / "_proto"
    bin_dir = Path(sys.executable).parent
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={scratch}",
            f"--mypy_out={scratch}",
        ]
        if grpc:
            args += [f"--grpc_python_out={scratch}", f"--mypy_grpc_out={scratch}"]
        if protoc.main([*args, *(str(PACKAGE_DIR / n) for n in names)]) != 0:
            raise SystemExit("protoc failed")
        for path in (Path(scratch) / PACKAGE_DIR).iterdir():
            shutil.move(path, out / path.name)


_IMPORT_LINE = re.compile(r"^(from|import) quayutec\.v1\b", re.M)
_MODULE_NAME = re.compile(r"'quayutec\.v1\.(\w+_pb2)'")


def _point_imports_at_client(path: Path) -> None:
    """Rename the package in imports and module names only: the serialized descriptors inside keep
    the proto package `quayutec.v1`, which is what goes on the wire."""
    text = path.read_text()
    text = _IMPORT_LINE.sub(lambda m: f"{m.group(1)} {CLIENT_PACKAGE}", text)
    text = _MODULE_NAME.sub(lambda m: f"'{CLIENT_PACKAGE}.{m.group(1)}'", text)
    if path.suffix == ".pyi":  # type stubs name types by module path; they hold no descriptor bytes
        text = text.replace("quayutec.v1.", f"{CLIENT_PACKAGE}.")
    path.write_text(text)


def generated_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES) or p.name == "__init__.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if regenerating changes anything")
    opts = parser.parse_args()
    stale: list[str] = []
    for target in TARGETS:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch)
            target.generate(out)
            fresh = generated_files(out)
            committed = ROOT / target.folder
            current = generated_files(committed) if committed.exists() else []
            if opts.check:
                _, mismatch, errors = filecmp.cmpfiles(out, committed, fresh, shallow=False)
                changed = set(mismatch) | set(errors) | (set(current) ^ set(fresh))
                stale += [str(target.folder / name) for name in sorted(changed)]
                continue
            committed.mkdir(parents=True, exist_ok=True)
            for name in current:
                (committed / name).unlink()
            for name in fresh:
                shutil.copy2(out / name, committed / name)
            print(f"wrote {len(fresh)} files to {target.folder}")
    if opts.check:
        if stale:
            print("generated code is stale; run `python scripts/gen_protos.py`:", *stale, sep="\n  ")
            return 1
        print("generated code is current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
