"""Who may write and read what: the broker's users and ACLs, derived from the registry alone.

Each role is one broker user named for it (`Role.value`). A topic's writers may WRITE it, its readers
READ it (both DESCRIBE it), a reader's consumer group may be joined by that role alone. Nothing else
is allowed: the broker runs the StandardAuthorizer with allow.everyone.if.no.acl.found=false, so the
gateway alone can put a ChatRequest (a tenant's request) on the log, the tool processor alone a
ToolResult. What the registry cannot say in a topic's writers and readers is listed here, each with
its reason (`_extra`): the faust processors' own topics, the audit's rescreen groups, the lag readers'
view of a worker group's offsets (theirs, and the autoscaler's, a user of no role).

`topics apply` creates the users whose passwords the credentials folder holds (the local stack's) and
adds every grant; `grants()` is also what `topics export --format strimzi-users` writes as KafkaUser
resources, and what tests/test_access.py holds the broker to.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import settings
from topics.registry import (
    FAUST_COMMIT,
    LAG_READ,
    RESCREEN_GROUP_PREFIX,
    Role,
    TopicSpec,
    mirror_of,
    processor_group,
)

#: The autoscaler (KEDA on Kubernetes) reads each worker group's lag, nothing else: no role's user.
AUTOSCALER = "autoscaler"
#: Every broker user: one per role, and the autoscaler. The operator's tools run as `admin`, the super
#: user (common/kafka_auth.py).
USERS: tuple[str, ...] = (*(role.value for role in Role), AUTOSCALER)
#: MirrorMaker 2 between regions (tokenstream/stack/mirror.py): a user of each region's cluster, where
#: the deployment names regions.
MIRROR = "mirror"


def users(peers: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Every broker user of this cluster: the roles', the autoscaler's, and MirrorMaker's with regions."""
    peers = other_regions() if peers is None else peers
    return (*USERS, MIRROR) if peers else USERS


@dataclass(frozen=True, order=True)
class Grant:
    """One ACL: `user` may do `operation` on the `resource` (topic or group) named `name`
    (`pattern` literal: exactly that name; prefixed: every name starting with it)."""

    user: str
    resource: str  # topic | group
    name: str
    operation: str  # read | write | describe | create
    pattern: str = "literal"

    def __str__(self) -> str:
        star = "*" if self.pattern == "prefixed" else ""
        return f"User:{self.user} {self.operation} {self.resource} {self.name}{star}"


def grants(specs: list[TopicSpec], peers: tuple[str, ...] | None = None) -> list[Grant]:
    """Every ACL the roles need to do what the registry says they do with `specs`, sorted. `peers`: the
    other regions, whose copies of a mirrored topic its readers read too (default: the settings')."""
    out: set[Grant] = set()
    faust_roles: set[Role] = set()
    peers = other_regions() if peers is None else peers
    for spec in specs:
        if spec.mirrored:
            out |= {
                Grant(reader.role.value, "topic", mirror_of(spec, region), op)
                for reader in spec.readers
                for region in peers
                for op in ("read", "describe")
            }
        for writer in spec.writers:
            out |= {Grant(writer.role.value, "topic", spec.name, op) for op in ("write", "describe")}
        for reader in spec.readers:
            out |= {Grant(reader.role.value, "topic", spec.name, op) for op in ("read", "describe")}
            if reader.group:
                out.add(Grant(reader.role.value, "group", reader.group, "read"))
            if reader.commit == LAG_READ:  # the committed offsets of the groups that consume the topic
                out |= {Grant(reader.role.value, "group", group, "describe") for group in spec.groups}
                out |= {Grant(AUTOSCALER, "group", group, "describe") for group in spec.groups}
                out.add(Grant(AUTOSCALER, "topic", spec.name, "describe"))
            if reader.commit == FAUST_COMMIT:
                faust_roles.add(reader.role)
    out |= set(_extra(faust_roles))
    out |= set(_mirroring(specs, peers))
    return sorted(out)


def _mirroring(specs: list[TopicSpec], peers: tuple[str, ...]) -> list[Grant]:
    """What MirrorMaker 2 needs of this cluster, as the source of its mirrored topics and as the target
    of the peers' copies: read the mirrored topics and their configs; make and write the copies
    (`<peer>.<topic>`, their configs kept in step, and `<peer>.checkpoints.internal`) and its own
    topics (`mm2-configs|offsets|status.<peer>.internal`, `mm2-offset-syncs.<peer>.internal`); join the
    group of the Connect worker that copies each peer's topics here (`<peer>-mm2`)."""
    if not peers:
        return []
    out = [
        Grant(MIRROR, "topic", spec.name, op)
        for spec in specs
        if spec.mirrored
        for op in ("read", "describe", "describe_configs")
    ]
    out += [
        Grant(MIRROR, "topic", "mm2-", op, "prefixed")
        for op in ("create", "read", "write", "describe", "describe_configs")
    ]
    for peer in peers:
        out += [
            Grant(MIRROR, "topic", f"{peer}.", op, "prefixed")
            for op in ("create", "read", "write", "describe", "describe_configs", "alter_configs")
        ]
        out += [Grant(MIRROR, "group", f"{peer}-mm2", op, "prefixed") for op in ("read", "describe")]
    return out


def other_regions() -> tuple[str, ...]:
    """The deployment's regions other than this one (TOKENSTREAM_REGIONS, TOKENSTREAM_REGION)."""
    cfg = settings()
    return tuple(sorted(set(cfg.regions) - {cfg.region}))


def _extra(faust_roles: set[Role]) -> list[Grant]:
    """The grants that no topic's writers and readers name."""
    extra = [
        # `tokenstream audit rescreen` commits what it re-judged in one group per policy version.
        Grant(Role.AUDIT.value, "group", RESCREEN_GROUP_PREFIX, "read", "prefixed"),
    ]
    for role in sorted(faust_roles):
        # A faust app declares (creates if missing) and uses topics named for its app id: its tables'
        # changelogs (in the registry) and its assignor's leader topic (faust's own, not in it).
        prefix = processor_group(role.value) + "-"
        extra += [
            Grant(role.value, "topic", prefix, op, "prefixed")
            for op in ("create", "read", "write", "describe")
        ]
    return extra


def by_user(specs: list[TopicSpec], peers: tuple[str, ...] | None = None) -> dict[str, list[Grant]]:
    """grants(specs, peers), per user (every user of `users(peers)` listed, even one without grants)."""
    out: dict[str, list[Grant]] = {user: [] for user in users(peers)}
    for grant in grants(specs, peers):
        out[grant.user].append(grant)
    return out
