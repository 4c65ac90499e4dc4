"""The admission gate: bounded, refusing with 429 when full and 503 while draining; waits for idle."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from kvboost_rag.server.admission import Admission
from kvboost_rag.server.errors import ServerError


def test_admits_up_to_capacity_then_refuses_with_429():
    gate = Admission(2)
    first, _ = gate.admit(), gate.admit()
    with pytest.raises(ServerError) as e:
        gate.admit()
    assert (e.value.status, e.value.code) == (429, "queue_full") and "--max-queue" in str(e.value)
    gate.release(first)
    gate.release(first)  # releasing twice is harmless
    assert len(gate.tickets) == 1
    gate.admit()


def test_draining_refuses_with_503():
    gate = Admission(2)
    gate.draining = True
    with pytest.raises(ServerError) as e:
        gate.admit()
    assert (e.value.status, e.value.code) == (503, "server_shutting_down")


def test_waiting_counts_tickets_not_started():
    gate = Admission(3)
    started, queued = gate.admit(), gate.admit()
    started.waiting = lambda: False
    assert gate.waiting == 1 and queued.waiting()


async def test_wait_idle_returns_when_the_last_ticket_is_released():
    gate = Admission(2)
    assert await gate.wait_idle(0.01)
    ticket = gate.admit()
    assert not await gate.wait_idle(0.01)
    asyncio.get_running_loop().call_later(0.01, gate.release, ticket)
    assert await gate.wait_idle(5.0)
