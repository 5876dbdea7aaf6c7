"""Making the broker's users and ACLs match topics/access.py (part of `topics apply`).

aiokafka has no admin calls for SCRAM users or ACLs; confluent-kafka's AdminClient (librdkafka,
kept by Confluent) has both, so this module alone uses it. Its calls are blocking; they run in a
thread so that `apply` stays a coroutine like the rest of topics/admin.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from common import kafka_auth
from topics.access import Grant, grants, users
from topics.registry import TopicSpec

SCRAM_ITERATIONS = 8192


def _admin(bootstrap: str):
    from confluent_kafka.admin import AdminClient

    # log_level 4: librdkafka's warnings and errors only (its notices would fill every role's log)
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 4, **kafka_auth.librdkafka_config()})


def _binding(grant: Grant):
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBinding(
        ResourceType[grant.resource.upper()],
        grant.name,
        ResourcePatternType[grant.pattern.upper()],
        f"User:{grant.user}",
        "*",
        AclOperation[grant.operation.upper()],
        AclPermissionType.ALLOW,
    )


def _grant(binding) -> Grant | None:
    """The Grant an ACL on the broker stands for (None: one this module does not write)."""
    if (
        binding.permission_type.name != "ALLOW"
        or binding.host != "*"
        or not binding.principal.startswith("User:")
    ):
        return None
    return Grant(
        binding.principal.removeprefix("User:"),
        binding.restype.name.lower(),
        binding.name,
        binding.operation.name.lower(),
        binding.resource_pattern_type.name.lower(),
    )


def passwords(folder: Path | None) -> dict[str, str]:
    """Each role user's password from `folder`, made for a user without one."""
    return {} if folder is None else {user: kafka_auth.ensure_password(folder, user) for user in users()}


def _apply(specs: list[TopicSpec], bootstrap: str, folder: Path | None) -> tuple[list[str], list[Grant]]:
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    admin = _admin(bootstrap)
    # Users: created once with the password of their file; an existing one is left alone (a re-run
    # must not re-salt the credentials of running roles).
    known = set(admin.describe_user_scram_credentials().result())
    wanted = {u: p for u, p in passwords(folder).items() if u not in known}
    if wanted:
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
        futures = admin.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(u, info, p.encode()) for u, p in wanted.items()]
        )
        for future in futures.values():
            future.result(timeout=30)
    # ACLs: each grant `specs` need that the broker lacks (creating one twice is harmless, but the
    # diff is what `topics apply` reports).
    present = _held(admin)
    missing = [g for g in grants(specs) if g not in present]
    if missing:
        for future in admin.create_acls([_binding(g) for g in missing]).values():
            future.result(timeout=30)
        _wait_until_seen(admin, set(missing))
    return sorted(wanted), missing


def _wait_until_seen(admin, expected: set[Grant], timeout_s: float = 30.0) -> None:
    """Return once the broker answers with every grant of `expected`: created ACLs take effect when the
    broker has read them from the metadata log, a moment after the controller accepted them."""
    deadline = time.monotonic() + timeout_s
    while not expected <= _held(admin):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the broker did not show the ACLs created within {timeout_s:.0f}s")
        time.sleep(0.1)


def _held(admin) -> set[Grant]:
    """The grants the broker holds now."""
    return {g for g in map(_grant, _describe(admin)) if g is not None}


def _describe(admin) -> list:
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    match_all = AclBindingFilter(
        ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY, AclPermissionType.ANY
    )
    return admin.describe_acls(match_all).result(timeout=30)


#: (bootstrap, grant) this process has seen the broker hold: users and ACLs are not taken away by
#: anything but an operator, so an `apply` that needs nothing new asks the broker nothing (the test
#: suite applies its topics hundreds of times in one process).
_seen: set[tuple[str, Grant]] = set()


async def apply_access(specs: list[TopicSpec], bootstrap: str) -> tuple[list[str], list[Grant]]:
    """Create the role users (those the credentials folder names, when there is one) and every grant of
    `specs` the broker lacks; (users created, grants added). Nothing to do on a broker without SASL."""
    if not kafka_auth.enabled():
        return [], []
    wanted = grants(specs)
    if all((bootstrap, g) in _seen for g in wanted):
        return [], []
    users, added = await asyncio.to_thread(_apply, specs, bootstrap, kafka_auth.credentials_folder())
    _seen.update((bootstrap, g) for g in wanted)
    return users, added


async def broker_grants(bootstrap: str) -> set[Grant]:
    """Every ACL on the broker, as grants (tests, `topics describe --access`)."""
    return await asyncio.to_thread(_held, _admin(bootstrap))
