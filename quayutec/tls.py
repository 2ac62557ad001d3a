"""Mutual TLS between our services: who each process is, and the credentials that prove it.

Every internal service (Room, Claims, Runtime) serves only callers that present a certificate
signed by our CA, and every internal client presents its own (the console too, on the Gateway's
console port). A certificate names one identity
of ``IDENTITIES``: its common name, a DNS name and the URI ``spiffe://quayutec/<identity>``.
Clients check that the server they reach holds the certificate of the service they meant to reach
(the DNS name is the identity, whatever host was dialled).

Where the certificates come from:

* Production: ``QUAYUTEC_MTLS_CA``, ``QUAYUTEC_MTLS_CERT`` and ``QUAYUTEC_MTLS_KEY`` name PEM files
  (the CA that signs every service, this process's certificate and its private key).
* One machine, nothing configured: the development PKI under ``<data dir>/pki/``, made by the
  admin tooling (``quayutec up``, ``quayutec demo``, ``quayutec pki init``, any admin command),
  never by a service::

      pki/ca/         ca.key, ca.crt         the CA: only the admin tooling reads this folder
      pki/<identity>/ ca.crt, tls.crt, tls.key   one folder per identity (gateway, room, ...)

  A service reads its own folder alone: the CA certificate, its certificate and its key; it is
  never handed the CA's key, so it cannot mint another identity. Folders are 0700 and keys 0600;
  creation holds a file lock so tools starting together do not race.

A caller with no certificate, or one our CA did not sign, is refused during the TLS handshake: it
never reaches a handler, and its client sees UNAVAILABLE.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from quayutec.envread import DATA_DIR_ENV, ConfigError, env_str
from quayutec.settings import setting

GATEWAY = "gateway"
ROOM = "room"
CLAIMS = "claims"
RUNTIME = "runtime"
ADMIN = "admin"
# The console: it calls the Gateway's console port (QUAYUTEC_GATEWAY_CONSOLE_LISTEN) as itself, and
# the Gateway trusts the browser address it passes on from this identity alone.
CONSOLE = "console"
# Every identity a certificate can name: the four services, the admin command line and the console.
IDENTITIES: tuple[str, ...] = (GATEWAY, ROOM, CLAIMS, RUNTIME, ADMIN, CONSOLE)

CA_ENV = "QUAYUTEC_MTLS_CA"
CERT_ENV = "QUAYUTEC_MTLS_CERT"
KEY_ENV = "QUAYUTEC_MTLS_KEY"
SPIFFE_PREFIX = "spiffe://quayutec/"
PKI_FOLDER = "pki"
# Inside the PKI folder: the CA's own folder, and in each identity's folder the files a Kubernetes
# TLS Secret also holds.
CA_FOLDER = "ca"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

_CA_DAYS = 3650
_CERT_DAYS = 825


@dataclass(frozen=True)
class MtlsConfig:
    """Where this process's certificates come from: three PEM files, or the development PKI."""

    pki_dir: Path
    ca_path: Path | None = None
    cert_path: Path | None = None
    key_path: Path | None = field(default=None, repr=False)

    @property
    def from_files(self) -> bool:
        return self.cert_path is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MtlsConfig:
        env = os.environ if env is None else env
        paths = {name: env_str(env, setting(name)) for name in (CA_ENV, CERT_ENV, KEY_ENV)}
        given = [name for name, value in paths.items() if value]
        if given and len(given) != 3:
            missing = sorted(set(paths) - set(given))
            raise ConfigError(f"set all of {CA_ENV}, {CERT_ENV} and {KEY_ENV} (PEM files), or none; missing {missing}")
        data_dir = Path(env_str(env, setting(DATA_DIR_ENV))).absolute()
        if not given:
            return cls(pki_dir=data_dir / PKI_FOLDER)
        return cls(
            pki_dir=data_dir / PKI_FOLDER,
            ca_path=Path(paths[CA_ENV]),
            cert_path=Path(paths[CERT_ENV]),
            key_path=Path(paths[KEY_ENV]),
        )

    @classmethod
    def dev(cls, pki_dir: Path) -> MtlsConfig:
        """The development PKI in ``pki_dir`` (made by ``ensure_dev_pki``, the admin tooling)."""
        return cls(pki_dir=Path(pki_dir).absolute())

    def identity_files(self, name: str) -> tuple[Path, Path, Path]:
        """The CA certificate, certificate and key ``name`` reads: the configured files, or its own
        folder of the development PKI."""
        if self.from_files:
            assert self.ca_path is not None and self.cert_path is not None and self.key_path is not None
            return self.ca_path, self.cert_path, self.key_path
        folder = identity_dir(self.pki_dir, name)
        return folder / CA_CERT, folder / CERT_FILE, folder / KEY_FILE


@dataclass(frozen=True)
class Identity:
    """One service identity with the PEM material that proves it."""

    name: str
    ca_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve as this identity; callers must present a certificate signed by the same CA."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Call as this identity; the server must hold a certificate signed by the same CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )


def load_identity(name: str, config: MtlsConfig | None = None) -> Identity:
    """This process's identity ``name``: from the configured files, or its folder of the development
    PKI. Only ``admin`` (the admin tooling) makes a missing development PKI; a service that finds
    none stops and says how to make it."""
    if name not in IDENTITIES:
        raise ValueError(f"unknown identity {name!r}; one of {', '.join(IDENTITIES)}")
    config = MtlsConfig.from_env() if config is None else config
    ca_path, cert_path, key_path = config.identity_files(name)
    if config.from_files:
        ca, cert, key_pem = _read(ca_path, CA_ENV), _read(cert_path, CERT_ENV), _read(key_path, KEY_ENV)
        named = certificate_identity(x509.load_pem_x509_certificate(cert))
        if named != name:
            raise ConfigError(
                f"{CERT_ENV} ({cert_path}) names {named or 'no quayutec identity'}, but this process is "
                f"{name!r}: give it a certificate with URI SAN {SPIFFE_PREFIX}{name}"
            )
        return Identity(name=name, ca_pem=ca, cert_pem=cert, key_pem=key_pem)
    if name == ADMIN:
        ensure_dev_pki(config.pki_dir)
    try:
        return Identity(
            name=name, ca_pem=ca_path.read_bytes(), cert_pem=cert_path.read_bytes(), key_pem=key_path.read_bytes()
        )
    except FileNotFoundError:
        raise ConfigError(
            f"no development certificate for {name} in {ca_path.parent}: the admin tooling makes the development "
            f"PKI (`quayutec pki init`, `quayutec up` or `quayutec demo`, with the same {DATA_DIR_ENV}); a service "
            f"never makes it. Or set {CA_ENV}, {CERT_ENV} and {KEY_ENV}."
        ) from None


def identity_dir(pki_dir: Path, name: str) -> Path:
    """The folder of the development PKI that identity ``name`` reads (``ca`` for the CA itself)."""
    return pki_dir / name


def _read(path: Path, env: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {env} ({path}): {exc.strerror}") from exc


def certificate_identity(cert: x509.Certificate) -> str | None:
    """The identity a certificate names through its ``spiffe://quayutec/<identity>`` URI SAN."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(SPIFFE_PREFIX) and uri.removeprefix(SPIFFE_PREFIX) in IDENTITIES:
            return uri.removeprefix(SPIFFE_PREFIX)
    return None


def peer_identity(auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
    """The identity named by the caller's verified certificate, from a call's ``auth_context()``;
    None when the call did not come over mutual TLS or the certificate names no identity."""
    for uri in auth_context.get("peer_uri", ()):
        text = uri.decode("ascii", "replace") if isinstance(uri, bytes) else str(uri)
        if text.startswith(SPIFFE_PREFIX) and text.removeprefix(SPIFFE_PREFIX) in IDENTITIES:
            return text.removeprefix(SPIFFE_PREFIX)
    return None


# -- the development PKI ------------------------------------------------------------------------------


def ensure_dev_pki(pki_dir: Path) -> None:
    """Make the development CA (``pki_dir/ca/``) and every identity's folder if missing. For the
    admin tooling only: it reads and writes the CA's key.

    Safe when several processes start at once: creation holds an exclusive lock on
    ``pki_dir/.lock``, and every file is written to a temporary name and renamed into place. A
    PKI of the old flat layout (the CA's key beside the services' keys) is removed and made anew."""
    if _complete(pki_dir):
        return
    pki_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(pki_dir / ".lock"):
        if _complete(pki_dir):
            return
        _remove_flat_layout(pki_dir)
        ca_dir = _private_dir(pki_dir / CA_FOLDER)
        ca_key_path, ca_cert_path = ca_dir / CA_KEY, ca_dir / CA_CERT
        if ca_key_path.exists() and ca_cert_path.exists():
            ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
            ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
            if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
                raise ConfigError(f"{ca_key_path} is not an EC key; remove {pki_dir} to make a new development CA")
            new_ca = False
        else:
            ca_key, ca_cert = _make_ca()
            _write(ca_key_path, _key_pem(ca_key), 0o600)
            _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
            new_ca = True
        ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        for name in IDENTITIES:
            folder = _private_dir(identity_dir(pki_dir, name))
            if not new_ca and all((folder / f).exists() for f in (CA_CERT, CERT_FILE, KEY_FILE)):
                continue
            key, cert = _make_leaf(name, ca_key, ca_cert)
            _write(folder / KEY_FILE, _key_pem(key), 0o600)
            _write(folder / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM), 0o644)
            _write(folder / CA_CERT, ca_pem, 0o644)


def write_host_pki(pki_dir: Path, leaves: Mapping[str, tuple[str, Sequence[str], Sequence[str]]]) -> None:
    """A new CA in ``pki_dir`` and, for each ``file stem: (identity, host names, addresses)``, a
    certificate of that identity naming where it serves (``<stem>.crt`` / ``<stem>.key``): the
    certificates of several hosts, each replica of a service with its own (the multi-host test bed)."""
    pki_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key, ca_cert = _make_ca()
    _write(pki_dir / "ca.key", _key_pem(ca_key), 0o600)
    _write(pki_dir / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    for stem, (identity, hosts, addresses) in leaves.items():
        if identity not in IDENTITIES:
            raise ValueError(f"unknown identity {identity!r}; one of {', '.join(IDENTITIES)}")
        key, cert = _make_leaf(identity, ca_key, ca_cert, hosts=hosts, addresses=addresses)
        _write(pki_dir / f"{stem}.key", _key_pem(key), 0o600)
        _write(pki_dir / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _complete(pki_dir: Path) -> bool:
    names = [f"{CA_FOLDER}/{CA_CERT}", f"{CA_FOLDER}/{CA_KEY}"]
    names += [f"{n}/{f}" for n in IDENTITIES for f in (CA_CERT, CERT_FILE, KEY_FILE)]
    return all((pki_dir / n).exists() for n in names)


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _remove_flat_layout(pki_dir: Path) -> None:
    """The first layout kept every file, the CA's key included, in ``pki_dir`` itself."""
    for name in (CA_CERT, CA_KEY, *(f"{n}.{ext}" for n in IDENTITIES for ext in ("crt", "key"))):
        (pki_dir / name).unlink(missing_ok=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _make_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quayutec development CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_leaf(
    name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    *,
    hosts: Sequence[str] = (),
    addresses: Sequence[str] = (),
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate of identity ``name``; it also names the ``hosts`` and ``addresses`` it serves on
    (loopback when none are given: the development PKI of one machine)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    where: list[x509.GeneralName] = (
        [x509.DNSName(h) for h in hosts] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
        if hosts or addresses
        else [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
    )
    sans: list[x509.GeneralName] = [
        x509.DNSName(name),
        x509.UniformResourceIdentifier(f"{SPIFFE_PREFIX}{name}"),
        *where,
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert
