"""Who this process is to the broker: the SASL/SCRAM user and password every Kafka client of it uses.

Each role runs as its own broker user (`gateway`, `worker`, `conversation`, ...), whose ACLs
`topics apply` derives from the registry (topics/access.py): the gateway alone may write
ts.chat.requests, so nothing outside it can put a request on the log in a tenant's name. The
operator's tools (topics, ops, chaos, bench) run as `admin`, the broker's super user.

Where the identity comes from, first found wins:
- TOKENSTREAM_KAFKA_USER / TOKENSTREAM_KAFKA_PASSWORD (a deployment: one Secret per role);
- the user `act_as(...)` named when the process started (the CLI names each role's), or `admin`,
  and its password read from TOKENSTREAM_KAFKA_CREDENTIALS_DIR/<user> (the local stack keeps one
  file per user there, mode 0600, written by `stack up` and `topics apply`).

TOKENSTREAM_KAFKA_SECURITY=plaintext turns all of it off (a broker without listeners for SASL);
sasl_ssl adds TLS, verified against TOKENSTREAM_KAFKA_SSL_CAFILE (docs/security.md).
"""

from __future__ import annotations

import secrets
import ssl
from pathlib import Path

from common import secret_files
from common.config import settings

ADMIN = "admin"
MECHANISM = "SCRAM-SHA-512"

_acting_as: str | None = None


class CredentialsMissing(RuntimeError):
    pass


def act_as(user: str) -> None:
    """Name the broker user of this process (the CLI does it for each role's command)."""
    global _acting_as
    _acting_as = user


def user() -> str:
    """The broker user this process authenticates as."""
    return settings().kafka_user or _acting_as or ADMIN


def credentials_folder() -> Path | None:
    """TOKENSTREAM_KAFKA_CREDENTIALS_DIR, else the local stack's folder when there is one."""
    cfg = settings()
    if cfg.kafka_credentials_dir is not None:
        return Path(cfg.kafka_credentials_dir)
    local = cfg.data_dir / "data" / "kafka" / "credentials"  # tokenstream/stack/kafka.py's
    return local if local.is_dir() else None


def ensure_password(folder: Path, name: str) -> str:
    """The password in folder/name, made first if missing."""
    return secret_files.ensure(folder / name, lambda: secrets.token_urlsafe(24))


def password(name: str | None = None) -> str:
    cfg = settings()
    name = name or user()
    if cfg.kafka_password is not None and name == user():
        return cfg.kafka_password.get_secret_value()
    folder = credentials_folder()
    try:
        return (folder / name).read_text().strip()  # type: ignore[operator]
    except (OSError, TypeError):
        raise CredentialsMissing(
            f"no Kafka password for user {name!r}: set TOKENSTREAM_KAFKA_PASSWORD, or "
            f"TOKENSTREAM_KAFKA_CREDENTIALS_DIR to a folder holding a file {name!r} "
            f"(the local stack's: run `tokenstream stack up` and `tokenstream topics apply`)"
        ) from None


def enabled() -> bool:
    return settings().kafka_security != "plaintext"


def _ssl_context() -> ssl.SSLContext | None:
    cfg = settings()
    if cfg.kafka_security != "sasl_ssl":
        return None
    return ssl.create_default_context(cafile=str(cfg.kafka_ssl_cafile) if cfg.kafka_ssl_cafile else None)


def client_options(name: str | None = None) -> dict:
    """Keyword arguments for any aiokafka client (producer, consumer, admin) of this process."""
    cfg = settings()
    if not enabled():
        return {"security_protocol": "PLAINTEXT"}
    name = name or user()
    return scram_options(name, password(name), cfg.kafka_security, _ssl_context())


def scram_options(
    name: str, secret: str, security: str = "sasl_plaintext", context: ssl.SSLContext | None = None
) -> dict:
    """aiokafka keyword arguments for one SCRAM user (also the local stack's own checks, as admin)."""
    options = dict(
        security_protocol=security.upper(),
        sasl_mechanism=MECHANISM,
        sasl_plain_username=name,
        sasl_plain_password=secret,
    )
    if context is not None:
        options["ssl_context"] = context
    return options


def faust_credentials():
    """The same identity in faust's terms (its `broker_credentials`), or None without SASL."""
    import faust

    if not enabled():
        return None
    return faust.SASLCredentials(
        username=user(), password=password(), mechanism=MECHANISM, ssl_context=_ssl_context()
    )


def librdkafka_config(name: str | None = None) -> dict:
    """The same identity for confluent-kafka's admin client (users and ACLs, topics/access.py)."""
    cfg = settings()
    if not enabled():
        return {"security.protocol": "plaintext"}
    name = name or user()
    config = {
        "security.protocol": cfg.kafka_security,
        "sasl.mechanism": MECHANISM,
        "sasl.username": name,
        "sasl.password": password(name),
    }
    if cfg.kafka_security == "sasl_ssl" and cfg.kafka_ssl_cafile:
        config["ssl.ca.location"] = str(cfg.kafka_ssl_cafile)
    return config
