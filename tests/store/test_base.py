import threading

from kvboost_rag.store.base import TierCounters


def test_counters_add_fields_and_extras_and_snapshots_are_copies():
    c = TierCounters(extra=["corrupt"])
    c.read(found=True)
    c.read(found=False)
    c.add("puts", 3)
    c.add("evictions", 2)
    c.add("corrupt")
    c.add("late")  # an extra that was not declared up front
    s = c.snapshot()
    assert (s.hits, s.misses, s.puts, s.evictions) == (1, 1, 3, 2)
    assert s.extra == {"corrupt": 1, "late": 1}
    s.extra["corrupt"] = 99
    s.hits = 99
    again = c.snapshot()
    assert again.extra["corrupt"] == 1 and again.hits == 1


def test_counters_lose_nothing_across_threads():
    c = TierCounters()

    def bump() -> None:
        for _ in range(2000):
            c.read(found=True)
            c.add("skipped")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.snapshot()
    assert s.hits == 8000 and s.extra["skipped"] == 8000
