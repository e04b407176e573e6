"""A loop a call's end cancels must end, even when what it awaits is ready in the same tick:
on Python 3.11, `asyncio.wait_for` returns that result instead and the cancel is lost, so a
call whose send or watch loop was cancelled that way never hung up (seen in CI)."""

import asyncio

from realtime_omni.aio import wait_set, within
from realtime_omni.gateway.config import PhoneConfig
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports import phone
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord


def test_the_idle_watch_ends_when_cancelled_as_an_event_arrives() -> None:
    async def body() -> None:
        s = Session(FakeCoord())
        watch = asyncio.create_task(phone.watch(s, PhoneConfig(idle_timeout_s=30), "default"))
        await asyncio.sleep(0.05)  # waiting for the next event
        s._emit("input_audio_buffer.speech_started")  # ready in the tick the cancel lands
        watch.cancel()
        done, _ = await asyncio.wait({watch}, timeout=1.0)
        assert watch in done and watch.cancelled()

    run(body(), 10)


def test_within_keeps_a_cancel_that_lands_as_its_awaitable_is_ready() -> None:
    async def body() -> None:
        ready = asyncio.Event()
        waiter = asyncio.create_task(within(ready.wait(), 5.0))
        await asyncio.sleep(0.01)
        ready.set()
        waiter.cancel()
        done, _ = await asyncio.wait({waiter}, timeout=1.0)
        assert waiter in done and waiter.cancelled()
        assert not await wait_set(asyncio.Event(), 0.01)  # and a timeout is still a timeout

    run(body(), 10)
