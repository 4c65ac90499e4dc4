"""The thread-to-loop stream bridge, and the event stream's cleanup however the response ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")

from kvboost_rag.async_stream import END, StreamBridge
from kvboost_rag.results import StreamChunk
from kvboost_rag.server.streaming import EventStream


async def drain(bridge: StreamBridge) -> list[Any]:
    items = []
    while (item := await asyncio.wait_for(bridge.queue.get(), 10)) is not END:
        items.append(item)
    return items


async def test_items_arrive_in_order_then_end_and_the_bridge_is_done():
    bridge = StreamBridge(iter([StreamChunk("a"), StreamChunk("b")]), asyncio.get_running_loop())
    assert not bridge.done
    bridge.start()
    assert [c.text for c in await drain(bridge)] == ["a", "b"]
    await asyncio.to_thread(bridge.wait_done, 10)
    assert bridge.done and bridge.started


async def test_an_error_in_the_stream_is_handed_over():
    def failing() -> Iterator[StreamChunk]:
        yield StreamChunk("a")
        raise RuntimeError("out of memory")

    bridge = StreamBridge(failing(), asyncio.get_running_loop())
    bridge.start()
    items = await drain(bridge)
    assert items[0].text == "a" and isinstance(items[1], RuntimeError)


async def test_cancel_stops_and_closes_the_engine_stream():
    closed, step = threading.Event(), threading.Event()

    def endless() -> Iterator[StreamChunk]:
        try:
            while True:
                step.wait(10)
                yield StreamChunk("x")
        finally:
            closed.set()

    bridge = StreamBridge(endless(), asyncio.get_running_loop())
    bridge.cancel.set()
    bridge.start()
    step.set()
    assert await drain(bridge) == [] and not bridge.started
    assert await asyncio.to_thread(closed.wait, 10)


@pytest.mark.parametrize("fail", [False, True])
async def test_event_stream_runs_on_close_however_it_ends(fail):
    closed = []

    async def body():
        yield b"data: 1\n\n"
        if fail:
            raise RuntimeError("the body failed")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)  # the client never disconnects on its own here
        return {"type": "http.disconnect"}

    response = EventStream(body(), lambda: closed.append(True))
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/", "headers": []}
    if fail:
        with pytest.raises(RuntimeError):
            await response(scope, receive, send)
    else:
        await response(scope, receive, send)
    assert closed == [True]
    assert (
        sent[0]["status"] == 200
        and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    )
