"""common/first_records.py without a Redis: which records are noted, how their writes are batched, and
that a failing store costs the writer nothing but a log line."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common.first_records import FirstRecords, first_offsets, starts_stream, verdict_in_band
from schemas import keys as K


class _Pipe:
    def __init__(self, store: _Store) -> None:
        self.store, self.ops = store, []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def set(self, key, value, ex=None, nx=False):
        self.ops.append((key, value, ex, nx))

    async def execute(self):
        if self.store.down:
            raise ConnectionError("refused")
        self.store.pipelines.append(self.ops)
        for key, value, _, nx in self.ops:
            if not (nx and key in self.store.data):
                self.store.data[key] = value


class _Store:
    def __init__(self, down: bool = False) -> None:
        self.data: dict[str, str] = {}
        self.pipelines: list[list] = []
        self.down = down

    def pipeline(self, transaction=True):
        return _Pipe(self)

    async def mget(self, keys):
        if self.down:
            raise ConnectionError("refused")
        return [self.data.get(k) for k in keys]

    async def aclose(self):
        pass


def _writer(store: _Store) -> FirstRecords:
    first = FirstRecords(None)
    first.redis = store
    return first


def _acked(partition: int, offset: int) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(SimpleNamespace(partition=partition, offset=offset))
    return future


def test_only_a_workers_first_record_is_noted_flagged_where_a_verdict_may_come_first():
    assert starts_stream(0) and not starts_stream(3) and not starts_stream(None)  # 3: a takeover's next
    assert not verdict_in_band("serial", False)
    assert verdict_in_band("parallel", False)  # the input verdict may precede it in band
    assert verdict_in_band("serial", True)  # moderated output: the input verdict is in band


async def test_a_resume_needs_the_verdicts_note_where_it_may_come_first_a_takeover_does_not():
    store = _Store()
    first = _writer(store)
    first.note("serial", _acked(2, 50))
    first.note("parallel", _acked(2, 60), verdict_first=True)
    first.note("judged", _acked(2, 70), verdict_first=True)
    first.note_verdict("judged", _acked(2, 65))
    await asyncio.sleep(0)
    await first.close()
    assert store.data[K.first_record("parallel")] == "2:60:v"
    wanted = {"serial": 2, "parallel": 2, "judged": 2}
    assert await first_offsets(store, wanted) == {"serial": 50, "judged": 65}  # "parallel": scan
    assert await first_offsets(store, wanted, verdicts=False) == {"serial": 50, "parallel": 60, "judged": 70}


async def test_the_acks_of_one_batch_go_in_one_pipeline_the_first_offset_kept():
    store = _Store()
    first = _writer(store)
    for i in range(50):
        first.note(f"r{i}", _acked(3, 100 + i))
    first.note("r0", _acked(3, 999))  # a later writer of the same request: NX keeps the first
    await asyncio.sleep(0)  # the acks' callbacks run
    await first.close()
    assert len(store.pipelines) == 1 and len(store.pipelines[0]) == 50
    assert store.data[K.first_record("r0")] == "3:100"
    assert all(op[2] == K.GATEWAY_META_TTL_S and op[3] for op in store.pipelines[0])
    assert await first_offsets(store, {"r0": 3, "r1": 3, "r2": 4, "nope": 3}) == {"r0": 100, "r1": 101}


async def test_a_failed_send_is_not_noted_and_a_store_that_is_down_only_logs(caplog):
    store = _Store(down=True)
    first = _writer(store)
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("not written"))
    first.note("lost", failed)
    first.note("r", _acked(1, 7))
    await asyncio.sleep(0)
    await first.close()
    assert store.data == {} and first.written == 0
    assert "not written" in caplog.text
    assert await first_offsets(store, {"r": 1}) == {}  # readers scan instead
