"""Regions without a broker: the local layout of `stack up --regions`, MirrorMaker's configuration, the
grants of a mirrored topic. The residency test itself (two clusters, a key served in its home region
through the other's gateway, nothing of it written there) is in tests/test_full_chain.py."""

from __future__ import annotations

import json
import stat

import pytest

from common.config import Settings
from gateway.home_region import bearer_digest
from schemas import keys as K
from tokenstream.stack import regions
from tokenstream.stack.kafka import Kafka
from tokenstream.stack.mirror import MirrorMaker
from topics.access import MIRROR, grants, users
from topics.registry import KEY_HOMES, REGISTRY, Role, all_topics, mirror_of


def test_each_local_region_gets_its_own_ports_folder_and_the_others_urls(tmp_path):
    base = Settings(data_dir=tmp_path, kafka_bootstrap="127.0.0.1:9092", redis_url="redis://127.0.0.1:6379/0")
    names = regions.parse("eu, us")
    eu, us = (regions.region_settings(n, names, base) for n in names)
    assert (eu.kafka_bootstrap, us.kafka_bootstrap) == ("127.0.0.1:9092", "127.0.0.1:9192")
    assert us.redis_url == "redis://127.0.0.1:6479/0" and us.kafka_controller_port == 9193
    assert us.data_dir == tmp_path / "regions" / "us" and us.region == "us"
    assert eu.regions == us.regions == {"eu": "http://127.0.0.1:8000", "us": "http://127.0.0.1:8100"}
    for field in ("gateway_port", "worker_metrics_port", "weaviate_http_port", "cache_redis_url"):
        assert getattr(eu, field) != getattr(us, field), field
    regions.record(names, base)  # each region's roles know how many regions share the host
    assert (
        regions.recorded(base) == regions.recorded(us) == names
        and regions.recorded(Settings(data_dir=us.data_dir)) == []
    )
    env = regions.environment(us)  # what a role started as region us reads back
    assert (
        Settings(
            **{
                k.removeprefix("TOKENSTREAM_").lower(): json.loads(v) if v[:1] in "[{" else v
                for k, v in env.items()
            }
        ).regions
        == us.regions
    )


@pytest.mark.parametrize("bad", ["eu", "eu,eu", "EU,us", "eu,u s", ""])
def test_regions_are_two_or_more_distinct_short_names(bad):
    with pytest.raises(ValueError):
        regions.parse(bad)


def test_mirrormaker_copies_the_mirrored_topics_both_ways_and_names_no_password(tmp_path):
    folders = (tmp_path / "data", tmp_path / "run", tmp_path / "logs", tmp_path / "cache")
    clusters = {
        r: Kafka(*(f / r for f in folders[:3]), folders[3], port=p, controller_port=p + 1)
        for r, p in (("eu", 9092), ("us", 9192))
    }
    mirror = MirrorMaker(*folders, clusters=clusters, topics=tuple(s.name for s in REGISTRY if s.mirrored))
    mirror.data_dir.mkdir(parents=True)
    mirror.prepare()
    props = mirror.properties_file.read_text()
    assert "eu->us.enabled = true" in props and "us->eu.enabled = true" in props
    assert "topics = ts\\.key\\.homes\n" in props  # the registry's mirrored topics, and nothing else
    secrets = {clusters[r].secret(MIRROR) for r in clusters}  # MirrorMaker's own user of each cluster
    assert not any(s in props for s in secrets)  # placeholders: the passwords stay in their own file
    assert "${file:" in props
    assert stat.S_IMODE(mirror.secrets_file.stat().st_mode) == 0o600
    assert all(s in mirror.secrets_file.read_text() for s in secrets)
    assert mirror.copies() == {"eu": ["us.ts.key.homes"], "us": ["eu.ts.key.homes"]}


def test_the_gateway_alone_reads_the_other_regions_copies_of_the_key_homes():
    specs = all_topics(["smollm2"])
    copies = {
        (g.user, g.operation) for g in grants(specs, peers=("us", "ap")) if g.name.endswith(".ts.key.homes")
    }
    assert copies == {(Role.GATEWAY.value, op) for op in ("read", "describe")}
    names = {g.name for g in grants(specs, peers=("us", "ap")) if g.name.endswith(".ts.key.homes")}
    assert names == {mirror_of(KEY_HOMES, "us"), mirror_of(KEY_HOMES, "ap")}
    assert not [g for g in grants(specs, peers=()) if g.name.endswith(".ts.key.homes")]
    writers = {g.user for g in grants(specs, peers=()) if g.name == KEY_HOMES.name and g.operation == "write"}
    assert writers == {Role.GATEWAY.value}


def test_mirrormaker_is_a_user_of_its_own_with_what_it_needs_only_where_there_are_regions():
    specs = all_topics(["smollm2"])
    assert MIRROR not in users(peers=()) and MIRROR in users(peers=("us",))
    assert not [g for g in grants(specs, peers=()) if g.user == MIRROR]
    mine = {
        (g.resource, g.name, g.operation, g.pattern) for g in grants(specs, peers=("us",)) if g.user == MIRROR
    }
    assert ("topic", KEY_HOMES.name, "read", "literal") in mine  # the source of eu's copies elsewhere
    assert ("topic", KEY_HOMES.name, "write", "literal") not in mine  # the gateways alone write it
    assert ("topic", "us.", "alter_configs", "prefixed") in mine  # us's copies here, their configs in step
    assert ("group", "us-mm2", "read", "prefixed") in mine
    assert not [m for m in mine if m[1].startswith("ts.") and m[1] != KEY_HOMES.name]  # no tenant's topic


def test_the_key_is_found_by_its_digest_whatever_the_scheme_is_spelt():
    secret = K.new_secret()
    assert bearer_digest([(b"authorization", f"Bearer {secret}".encode())]) == K.digest(secret)
    assert bearer_digest([(b"Authorization", f"bearer  {secret} ".encode())]) == K.digest(secret)
    assert bearer_digest([(b"authorization", b"Basic abc")]) is None
    assert bearer_digest([]) is None


# ---------------------------------------------------------------- the home-region middleware, in process


class _Homes:
    def __init__(self, homes: dict[str, str]) -> None:
        self.homes = homes

    def home(self, digest: str) -> str | None:
        return self.homes.get(digest)


def _gateway(homes: dict[str, str], regions_: dict[str, str]):
    from types import SimpleNamespace

    from gateway.metrics import Metrics

    return SimpleNamespace(key_homes=_Homes(homes), region="eu", regions=regions_, metrics=Metrics())


async def _local(scope, receive, send):
    """This region's own app: answers who served it."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"served in eu"})


async def _us(scope, receive, send):
    """The home region's gateway: echoes what it was sent, in two frames."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = dict(scope["headers"])
    await send(
        {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await send({"type": "http.response.body", "body": b"data: " + body + b"\n\n", "more_body": True})
    await send(
        {
            "type": "http.response.body",
            "body": b"via: "
            + headers.get(b"x-tokenstream-via", b"-")
            + b" path: "
            + scope["path"].encode()
            + b"?"
            + scope["query_string"],
        }
    )


async def test_a_key_at_home_elsewhere_is_proxied_there_refused_or_passed_through():
    import httpx

    from gateway.home_region import HomeRegion

    home_us, home_ap, mine = K.new_secret(), K.new_secret(), K.new_secret()
    gw = _gateway(
        {K.digest(home_us): "us", K.digest(home_ap): "ap", K.digest(mine): "eu"},
        {"eu": "http://eu.test", "us": "http://us.test"},
    )
    middleware = HomeRegion(_local, gw)
    middleware.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=_us))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=middleware), base_url="http://eu.test"
    ) as http:

        def call(secret, **kw):
            return http.post(
                "/v1/chat/completions?x=1",
                content=b'{"q":1}',
                headers={"Authorization": f"Bearer {secret}", **kw.pop("headers", {})},
            )

        proxied = await call(home_us)
        assert proxied.status_code == 201 and proxied.headers["x-tokenstream-region"] == "us"
        assert proxied.text == 'data: {"q":1}\n\nvia: eu path: /v1/chat/completions?x=1'
        for secret in (mine, K.new_secret()):  # at home here, or unknown anywhere (then 401 from the routes)
            assert (await call(secret)).text == "served in eu"
        refused = await call(home_ap)  # a region without a URL here
        assert refused.status_code == 421 and refused.json()["error"]["code"] == "wrong_region"
        assert "region ap" in refused.json()["error"]["message"]
        looped = await call(home_us, headers={"x-tokenstream-via": "us"})
        assert looped.status_code == 421
    gw.regions["us"] = "http://127.0.0.1:9"  # nothing listens there
    middleware = HomeRegion(_local, gw, connect_timeout_s=1)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=middleware), base_url="http://eu.test"
    ) as http:
        down = await http.get("/v1/models", headers={"Authorization": f"Bearer {home_us}"})
    assert down.status_code == 503 and down.json()["error"]["code"] == "region_unreachable"
    assert down.headers["retry-after"] == "5"
    assert 'region="us"' in gw.metrics.render().decode()
