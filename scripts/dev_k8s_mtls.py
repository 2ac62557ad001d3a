"""Make the dev overlay's mutual-TLS files at apply time: nothing private is committed.

    python scripts/dev_k8s_mtls.py && kubectl apply -k deploy/k8s/overlays/dev

The development CA and one certificate per identity are made (once) in a PKI folder outside the
overlay, ``<QUAYUTEC_DATA_DIR>/k8s-dev-pki/`` by default, whose ``ca/`` holds the CA's key; each
identity's folder (the CA certificate, its certificate, its key) is copied to
``deploy/k8s/overlays/dev/mtls/<identity>/``, which git ignores and the overlay's
secretGenerator reads. The CA's key never enters the overlay, so no Secret carries it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quayutec.config import DATA_DIR_ENV, env_str  # noqa: E402
from quayutec.settings import setting  # noqa: E402
from quayutec.tls import IDENTITIES, KEY_FILE, MtlsConfig, ensure_dev_pki  # noqa: E402

OVERLAY_MTLS = ROOT / "deploy" / "k8s" / "overlays" / "dev" / "mtls"


def write_overlay_mtls(pki: Path, out: Path) -> list[Path]:
    """Every identity's folder of the PKI in ``pki`` (made if missing), copied to ``out``; returns
    the folders written."""
    ensure_dev_pki(pki)
    written = []
    for name in IDENTITIES:
        dest = out / name
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        for source in MtlsConfig.dev(pki).identity_files(name):
            target = dest / source.name
            shutil.copyfile(source, target)
            os.chmod(target, 0o600 if source.name == KEY_FILE else 0o644)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    data_dir = Path(env_str(os.environ, setting(DATA_DIR_ENV))).absolute()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--pki", type=Path, default=data_dir / "k8s-dev-pki", help="the development PKI (its CA's key stays here)"
    )
    p.add_argument("--out", type=Path, default=OVERLAY_MTLS, help="where the overlay reads the files")
    args = p.parse_args(argv)
    for folder in write_overlay_mtls(args.pki, args.out):
        print(f"{folder}/  ca.crt tls.crt tls.key")
    print(f"the CA (its key) stays in {args.pki / 'ca'}; now: kubectl apply -k {args.out.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
