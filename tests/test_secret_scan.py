"""The secret scan `make test` runs (scripts/scan_secrets.py): this repository holds no private key,
and a key planted in a git work tree, in any usual encoding, fails the scan naming the file. The
planted keys are made here when the test runs: none is ever written into the repository.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

ROOT = Path(__file__).resolve().parent.parent
SCAN = ROOT / "scripts" / "scan_secrets.py"


def scan(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCAN), str(root)], capture_output=True, text=True, timeout=300)


def work_tree(path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "README.md").write_text("a clean work tree\n")
    (path / ".gitignore").write_text("ignored/\n")
    return path


def pem_keys() -> dict[str, bytes]:
    """One private key per encoding a key file is usually found in."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    none = serialization.NoEncryption()
    pem = serialization.Encoding.PEM
    return {
        "pkcs8.key": ec_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, none),
        "ec.pem": ec_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, none),
        "rsa.pem": rsa_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, none),
        "id_ed25519": ed25519.Ed25519PrivateKey.generate().private_bytes(
            pem, serialization.PrivateFormat.OpenSSH, none
        ),
    }


def test_the_repository_holds_no_private_key() -> None:
    done = scan(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no private key or token" in done.stdout


def test_a_clean_work_tree_passes(tmp_path: Path) -> None:
    assert scan(work_tree(tmp_path)).returncode == 0


@pytest.mark.parametrize("name", sorted(pem_keys()))
def test_a_planted_key_file_fails_the_scan(tmp_path: Path, name: str) -> None:
    tree = work_tree(tmp_path)
    planted = tree / "deploy" / "overlay" / name
    planted.parent.mkdir(parents=True)
    planted.write_bytes(pem_keys()[name])
    subprocess.run(["git", "add", "-A"], cwd=tree, check=True)
    done = scan(tree)
    assert done.returncode == 1
    assert re.search(rf"^deploy/overlay/{re.escape(name)}:1: Private Key$", done.stdout, re.MULTILINE), done.stdout


def test_a_key_inside_a_manifest_or_not_yet_added_fails_too(tmp_path: Path) -> None:
    """A key pasted into a YAML Secret, and one only created (git would commit it next), are found;
    a file git ignores is not what the scan is for."""
    tree = work_tree(tmp_path)
    key = pem_keys()["pkcs8.key"].decode()
    indented = "".join(f"    {line}\n" for line in key.splitlines())
    (tree / "secret.yaml").write_text(f"apiVersion: v1\nkind: Secret\nstringData:\n  tls.key: |\n{indented}")
    (tree / "notes.txt").write_text("copied here for later:\n" + key)
    (tree / "ignored").mkdir()
    (tree / "ignored" / "local.key").write_text(key)
    subprocess.run(["git", "add", "secret.yaml"], cwd=tree, check=True)
    done = scan(tree)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "notes.txt:2: Private Key",
        "secret.yaml:4: Private Key",
    ]  # the line of its YAML key


def test_make_test_runs_the_scan() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (test_line,) = [line for line in makefile.splitlines() if line.startswith("test:")]
    assert "secrets" in test_line.split()
    assert "scripts/scan_secrets.py" in makefile.split("\nsecrets:", 1)[1].split("\n\n", 1)[0]
