"""What a knock from a key the lists do not hold may cost a relay or a model node (`directory.Knocks`):
a lookup of that key alone, within a rate; a read of the lists only for a key the ledger holds; and a
key found absent is refused unread for a while, in a memory of bounded size."""

from __future__ import annotations

from waiting import run

from planetserve.node.overlay.directory import Knocks


def knocks(held: set[bytes], **settings: float) -> tuple[Knocks, list[bytes], list[int]]:
    looked: list[bytes] = []
    reads: list[int] = []

    def lookup(key: bytes) -> bool | None:
        looked.append(key)
        return None if key == b"unreadable" else key in held

    async def refresh() -> None:
        reads.append(1)

    return Knocks(lookup, refresh, **settings), looked, reads


def test_only_a_key_the_ledger_holds_reads_the_lists():
    async def main():
        gate, looked, reads = knocks({b"registered"})
        for key in (b"fresh-1", b"fresh-2", b"registered"):
            await gate(key)
        assert looked == [b"fresh-1", b"fresh-2", b"registered"] and reads == [1]

    run(main())


def test_lookups_are_limited_to_the_rate_and_a_key_found_absent_is_not_looked_up_again():
    async def main():
        gate, looked, _ = knocks(set(), rate=0.001, burst=3)
        for i in range(10):
            await gate(b"fresh-%d" % i)
        await gate(b"fresh-0")
        assert looked == [b"fresh-0", b"fresh-1", b"fresh-2"]
        assert gate.counts == {"lookups": 3, "refreshes": 0, "absent": 1, "limited": 7}

    run(main())


def test_a_key_found_absent_is_looked_up_again_after_a_while_and_an_unreadable_answer_is_not_kept():
    async def main():
        gate, looked, reads = knocks({b"late"}, absent_for=0.0)
        await gate(b"unreadable")
        await gate(b"unreadable")  # the endpoint failed: no answer to remember
        assert looked == [b"unreadable"] * 2
        gate.lookup = lambda key: (looked.append(key), False)[1]  # not registered yet
        await gate(b"late")
        gate.lookup = lambda key: (looked.append(key), True)[1]  # its registration committed
        await gate(b"late")
        assert looked[2:] == [b"late", b"late"] and reads == [1]

    run(main())


def test_the_memory_of_absent_keys_is_bounded():
    async def main():
        gate, _, _ = knocks(set(), rate=1e9, burst=10_000, memory=100)
        for i in range(1_000):
            await gate(b"fresh-%d" % i)
        assert len(gate._absent) == 100 and b"fresh-999" in gate._absent and b"fresh-0" not in gate._absent

    run(main())
