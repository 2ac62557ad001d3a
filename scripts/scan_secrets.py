"""Fail when the repository holds a private key or a cloud or registry token: `make test` runs it.

Scans every file git would commit (tracked, and untracked ones not ignored) with detect-secrets'
detectors for PEM/OpenSSH/PGP/PuTTY private keys and for tokens whose shape is unmistakable (AWS,
GitHub, OpenAI, Slack, Stripe, PyPI). Nothing is allow-listed: a test that needs a key makes one
when it runs. Prints each finding as ``path:line: type`` and exits 1; exits 0 when there is none.

    python scripts/scan_secrets.py [ROOT]     # ROOT: a git work tree (default: this repository)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from detect_secrets.core.scan import scan_file
from detect_secrets.settings import transient_settings

ROOT = Path(__file__).resolve().parent.parent
DETECTORS = (
    "PrivateKeyDetector",
    "AWSKeyDetector",
    "GitHubTokenDetector",
    "OpenAIDetector",
    "SlackDetector",
    "StripeDetector",
    "PypiTokenDetector",
)


def committable_files(root: Path) -> list[str]:
    """What git would commit in ``root``: tracked files and untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (root / name).is_file()})


def findings(root: Path) -> list[tuple[str, int, str]]:
    """(path, line, type) of every secret found in ``root``'s committable files."""
    found: list[tuple[str, int, str]] = []
    # Only detect-secrets' own file checks (binary and unreadable files are skipped): its heuristic
    # filters are for entropy detectors, which are not used, and cost ten times the scan.
    settings = {"plugins_used": [{"name": name} for name in DETECTORS], "filters_used": []}
    with transient_settings(settings):
        for name in committable_files(root):
            for secret in scan_file(str(root / name)):
                found.append((name, secret.line_number, secret.type))
    return sorted(set(found))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("root", nargs="?", type=Path, default=ROOT, help="a git work tree (default: this repository)")
    root = p.parse_args(argv).root.resolve()
    found = findings(root)
    for name, line, kind in found:
        print(f"{name}:{line}: {kind}")
    if found:
        print(
            f"secret scan: {len(found)} secret(s) in files git would commit; remove them (a test makes its keys "
            "when it runs; the dev overlay's are made by scripts/dev_k8s_mtls.py)",
            file=sys.stderr,
        )
        return 1
    print(f"secret scan: no private key or token in {len(committable_files(root))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
