"""common/cpus.py: the calling thread's CPU, and a helper thread kept off the caller's."""

from __future__ import annotations

import os
import threading

from hicache_l3.common import cpus


def test_the_current_cpu_is_one_this_thread_may_use() -> None:
    assert cpus.current_cpu() in os.sched_getaffinity(0)


def test_a_helper_is_kept_off_a_cpu_and_nothing_else_changes() -> None:
    allowed = set(os.sched_getaffinity(0))
    assert len(allowed) >= 2, f"this test needs two CPUs, the process may use {allowed}"
    cpu = min(allowed)
    parked, seen = threading.Event(), {}

    def helper() -> None:
        parked.wait(10)

    t = threading.Thread(target=helper)
    t.start()
    try:
        assert t.native_id
        assert cpus.keep_off(t.native_id, allowed, cpu)
        seen["kept"] = os.sched_getaffinity(t.native_id)
        assert not cpus.keep_off(0, allowed, cpu)  # 0 would be the caller itself
        assert not cpus.keep_off(t.native_id, allowed, -1)
        assert not cpus.keep_off(t.native_id, {cpu}, cpu)  # no other CPU left
        seen["after"] = os.sched_getaffinity(t.native_id)
    finally:
        parked.set()
        t.join()
    assert seen["kept"] == seen["after"] == allowed - {cpu}
    assert os.sched_getaffinity(0) == allowed
