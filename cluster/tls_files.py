"""`TLSFiles`: a server's PEM files (certificate chain, key, and the client CA of mutual TLS),
re-read when they change on disk, so that a rotated certificate is served without a restart.

Both ingresses use it: the gRPC server asks at each new connection's handshake (gRPC's dynamic
server credentials), the HTTP server polls (`HttpServer`, every `TLS_POLL_S`) and loads the new
chain into its live SSL context. A change is a new (inode, size, mtime) of any of the files, as
when a mounted Kubernetes Secret is updated (its files are swapped by a symlink). A new set is
taken only once the certificate and the key match (a half-written rotation keeps the old one).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TLS_POLL_S = 10.0
"""How often the HTTP server looks for a rotated certificate."""


@dataclass(frozen=True, slots=True)
class TLSMaterial:
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None


class TLSFiles:
    """The files of one server's TLS; `changed()` reads them again when they changed since the
    last read, and returns the new material once it is consistent."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str | None = None) -> None:
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        self._lock = threading.Lock()
        self._seen = self._stamp()
        self.material = self._read()
        check_pair(self.cert_file, self.key_file)  # a bad pair at start is an error, not a skip
        self.reloads = 0  # rotated sets taken

    def _paths(self) -> list[str]:
        return [p for p in (self.cert_file, self.key_file, self.ca_file) if p is not None]

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        stats = (os.stat(p) for p in self._paths())
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def _read(self) -> TLSMaterial:
        ca = None if self.ca_file is None else Path(self.ca_file).read_bytes()
        return TLSMaterial(Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(), ca)

    def changed(self) -> TLSMaterial | None:
        """The new material when the files changed since the last read and the new certificate
        and key match; else None (unchanged, or a rotation not complete yet: asked again
        later)."""
        with self._lock:
            try:
                stamp = self._stamp()
                if stamp == self._seen:
                    return None
                check_pair(self.cert_file, self.key_file)
                material = self._read()
            except (OSError, ssl.SSLError) as exc:
                logger.warning(
                    "TLS files changed but do not load (%s): keeping the served ones", exc
                )
                return None
            self._seen, self.material = stamp, material
            self.reloads += 1
            logger.info("TLS: serving the rotated certificate of %s", self.cert_file)
            return material


def check_tls_files(cert_file: str | None, key_file: str | None, ca_file: str | None) -> None:
    """Raise ValueError unless the flags make sense together: a certificate and its key, or
    neither; a client CA (mutual TLS) only with them."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    if ca_file is not None and cert_file is None:
        raise ValueError("tls_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")


def check_pair(cert_file: str, key_file: str) -> None:
    """Raise `ssl.SSLError` (or `OSError`) unless the key belongs to the certificate."""
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
