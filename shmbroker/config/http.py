"""The `[http]` table: the HTTP front door's address, its tenants' keys and its limits
(`httpapi/`, the OpenAI Files and Batches API).

Each key is a field of `HttpConfig` with its default. `[http.keys]` maps a tenant's name to its
bearer key: either the key itself or `"sha256:<hex>"`, its SHA-256. Keys are held hashed from the
moment they are read (`HttpConfig.key_hashes`), and `shmbroker config` shows neither.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from ..errors import ConfigError
from .broker import key, toml_keys
from .validator import Address, Integer, Number, Validator

TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HASHED = re.compile(r"sha256:([0-9a-f]{64})")
DEFAULT_ADDR = "127.0.0.1:8400"


def key_hash(secret: str) -> str:
    """The SHA-256 (hex) a key is known by."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP front door (a `http` role of `supervise`, or `shmbroker serve-http` beside a broker)."""

    addr: str = key(DEFAULT_ADDR, check=Address(),
                    help="the API's `host:port` (loopback unless set otherwise; port 0 picks a free one, written "
                         "to `broker.json`)")
    max_file_lines: int = key(50_000, check=Integer(1, 1 << 30), help="requests in one batch input file; past it "
                                                                       "the upload is refused (413)")
    max_file_bytes: int = key(200_000_000, check=Integer(1, 1 << 40), help="bytes of one uploaded file; past it "
                                                                           "the upload is refused (413)")
    upload_idle_seconds: float = key(30.0, check=Number(0.0, 86400.0, low_open=True),
                                     help="an upload that sends no byte this long is dropped, and leaves no file")
    tenant_max_files: int = key(0, check=Integer(0, 1 << 30), help="files one tenant may keep (0: no limit)")
    tenant_max_bytes: int = key(0, check=Integer(0, 1 << 50), help="bytes of files one tenant may keep (0: no limit)")
    tenant_max_batches: int = key(0, check=Integer(0, 1 << 30),
                                  help="batches of one tenant not yet ended (0: no limit)")
    key_hashes: tuple = key((), key="keys", table="[http.keys]", flat=True, default_text="none (no request is let in)",
                            help="tenant name = its bearer key, or `\"sha256:<hex>\"` of it; each tenant sees only "
                                 "its own files and batches")

    def tenant_of(self, secret: str) -> str | None:
        """The tenant whose key this is (compared as hashes, in constant time), or None."""
        h = key_hash(secret)
        return next((name for name, known in self.key_hashes if hmac.compare_digest(h, known)), None)


def parse_http(v: Validator, raw) -> HttpConfig:
    """The `[http]` table checked; ConfigError naming `http.<key>`."""
    if not isinstance(raw, dict):
        v.fail("http", "must be a table ([http])", raw)
    fields = {f.metadata.get("key", f.name): f for f in toml_keys(HttpConfig)}
    v.no_unknown(raw, set(fields), "http")
    values: dict = {}
    for name, f in fields.items():
        if name in raw and f.metadata["check"] is not None:
            values[f.name] = f.metadata["check"].read(v, raw, name, "http")
    hashes = keys(v, raw.get("keys", {}))
    values["key_hashes"] = tuple(sorted(hashes.items()))
    return HttpConfig(**values)


def keys(v: Validator, raw) -> dict[str, str]:
    """`[http.keys]`: tenant -> the key's hash; two tenants with one key are refused."""
    if not isinstance(raw, dict):
        v.fail("http.keys", "must be a table of tenant name = key", raw)
    out: dict[str, str] = {}
    for tenant, secret in raw.items():
        if TENANT_RE.fullmatch(tenant) is None:
            v.fail(f"http.keys.{tenant}", "a tenant name is 1-64 letters, digits, '_', '.' or '-'", tenant)
        if not isinstance(secret, str) or len(secret) < 8:
            v.fail(f"http.keys.{tenant}", "must be a key of at least 8 characters, or \"sha256:<hex>\"", "***")
        m = HASHED.fullmatch(secret)
        h = m.group(1) if m else key_hash(secret)
        if h in out.values():
            raise ConfigError(f"{v.where}: http.keys.{tenant}: the same key as another tenant")
        out[tenant] = h
    return out
