"""Heterogeneous TP end to end: a TP=2 and a TP=1 SGLang 0.5.23 server share one L3 store.

Both servers run the tiny random Llama of make_model.py (2 KV heads) on CPU with the recipe of
tests/e2e/e2e_server.py, the ``page_head`` host layout and the file connector with
``tp_lcm_size = 2`` in the extra config: pages are stored per head group (one KV head each).
The two servers run at once.
1. The TP=2 server answers a prompt (its two ranks write their head group of every page),
   and after ``/flush_cache`` answers it again from L3 (storage hits, the same output).
2. The TP=1 server answers the same prompt: every page of the prefix comes from L3, both
   groups written by the TP=2 ranks, and its output tokens are the TP=2 server's; its
   logprobs agree with them within float32 all-reduce rounding (the TP=2 server sums two
   partial products where the TP=1 server makes one).
3. The TP=1 server answers a second prompt and writes it; the TP=2 server then reads each
   rank's head group of it from those whole-page writes (storage hits), with the TP=1 answer.
4. ``POST /hicache/storage-backend/clear`` on the TP=1 server removes the shared pages (the
   TP=2 server misses afterwards) and leaves a page of another namespace in the same store.

What it took on CPU (test-only stand-ins, tests/e2e/standins/sitecustomize.py): SGLang builds
a PyNccl (CUDA) communicator for every TP group on the CPU platform, turned off so the
groups all-reduce through gloo; the ``page_head`` layout's device<->host copies; and
``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank), which SGLang requires when the ranks
outnumber the NUMA nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_server import HICACHE_FLAGS, SGLANG_PY, SGLangServer

from hicache_l3.sglang.config import extra_config_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PAGE = 64
PROMPT_TOKENS = 1600
CACHED = (PROMPT_TOKENS - 1) // PAGE * PAGE  # whole pages; SGLang computes the last token
LOGPROB_TOLERANCE = 1e-3  # float32 partial sums of two ranks against one


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e-hetero-tp")


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    path = workdir / "tiny-llama"
    out = subprocess.run([str(SGLANG_PY), str(Path(__file__).parent / "make_model.py"), str(path), "llama"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"make_model.py failed:\n{out.stderr[-4000:]}"
    assert json.loads((path / "config.json").read_text())["num_key_value_heads"] == 2
    return path


def flags(workdir: Path) -> list[str]:
    """The L3 flags: the file connector with tp_lcm_size = 2, page_head host layout."""
    config = workdir / "hicache-l3.json"
    extra = {**extra_config_for("file", {"root": str(workdir / "pages")}), "tp_lcm_size": 2}
    config.write_text(json.dumps(extra))
    return ["--enable-hierarchical-cache", *HICACHE_FLAGS, "--hicache-mem-layout", "page_head",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", f"@{config}"]


def server(name: str, model: Path, workdir: Path, tp: int) -> SGLangServer:
    env = {}
    if tp > 1:
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp))
    return SGLangServer(name, model, [*flags(workdir), "--tp-size", str(tp)], workdir, env)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(PROMPT_TOKENS)]


def answer(result: dict[str, Any]) -> tuple[list[int], list[float]]:
    meta = result["meta_info"]
    return result["output_ids"], [lp[0] for lp in meta["output_token_logprobs"]]


def storage_hits(result: dict[str, Any]) -> int:
    return int((result["meta_info"].get("cached_tokens_details") or {}).get("storage", 0))


def our_pages(srv: SGLangServer, op: str) -> int:
    """Head-group objects of ``op`` that succeeded, over every rank: our Prometheus counter
    ``hicache_l3_pages_total`` on SGLang's ``/metrics`` (fed by ``get_stats``)."""
    total = 0.0
    for line in str(srv.request("/metrics", method="GET")).splitlines():
        if line.startswith("hicache_l3_pages_total{") and f'op="{op}"' in line and 'result="ok"' in line:
            total += float(line.rpartition(" ")[2])
    return int(total)


def wait_written(srv: SGLangServer, groups: int, timeout: float = 120.0) -> None:
    """Wait until the server's ranks have stored ``groups`` head-group objects in all."""
    import time

    deadline = time.monotonic() + timeout
    stored = 0
    while time.monotonic() < deadline:
        stored = our_pages(srv, "set")
        if stored >= groups:
            return
        time.sleep(1.0)
    raise srv.fail(f"only {stored} of {groups} head groups written to L3 within {timeout:.0f}s")


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    (ids, lps), (want_ids, want_lps) = answer(got), answer(want)
    assert ids == want_ids, (ids, want_ids)
    assert max(abs(a - b) for a, b in zip(lps, want_lps)) < LOGPROB_TOLERANCE, (lps, want_lps)


def test_tp2_and_tp1_servers_share_pages_per_head_group(model: Path, workdir: Path) -> None:
    first, second = prompt(21), prompt(22)
    pages = CACHED // PAGE
    with contextlib.ExitStack() as stack:
        # both start at once (each SGLangServer starts its process when built)
        tp2_server, tp1_server = server("tp2", model, workdir, 2), server("tp1", model, workdir, 1)
        tp2, tp1 = stack.enter_context(tp2_server), stack.enter_context(tp1_server)
        written = tp2.generate(first)
        assert storage_hits(written) == 0, written["meta_info"]
        wait_written(tp2, 2 * pages)  # two ranks, one group of each page each
        tp2.flush_cache()
        again = tp2.generate(first)
        assert storage_hits(again) == CACHED, tp2.fail(f"TP=2 own pages: {again['meta_info']}")
        assert answer(again) == answer(written)
        read = tp1.generate(first)
        assert storage_hits(read) == CACHED, tp1.fail(f"TP=1 of TP=2's pages: {read['meta_info']}")
        same_answer(read, written)
        assert our_pages(tp1, "get") >= 2 * pages  # both head groups of every page
        own = tp1.generate(second)
        assert storage_hits(own) == 0, own["meta_info"]
        wait_written(tp1, 2 * pages)  # one rank, both groups of each page
        read = tp2.generate(second)
        assert storage_hits(read) == CACHED, tp2.fail(f"TP=2 of TP=1's pages: {read['meta_info']}")
        same_answer(read, own)
        # SGLang's clear endpoint on one server removes the shared head-group pages, nothing else
        with keeper_page(workdir) as still_there:
            tp1.request("/hicache/storage-backend/clear")
            tp2.flush_cache()
            cleared = tp2.generate(second)
            assert storage_hits(cleared) == 0, tp2.fail(f"pages left after clear: {cleared['meta_info']}")
            assert still_there(), "the clear endpoint removed another namespace's page"


@contextlib.contextmanager
def keeper_page(workdir: Path) -> Iterator[Callable[[], bool]]:
    """One page in another namespace of the same file store; yields whether it is still there."""
    from hicache_l3.common.memory import HostBuffer
    from hicache_l3.common.registry import open_connector
    from hicache_l3.sglang.config import build_namespace

    namespace = build_namespace(model_name="another/model", tag="", kv_dtype="uint8", layout="page_first",
                                page_size=1)
    buf = HostBuffer(4096, pin=False)
    connector = open_connector("file", namespace, {"root": str(workdir / "pages")})
    try:
        connector.register(buf)
        assert connector.batch_set(["keep"], [((buf.address, 4096),)]) == [True]
        yield lambda: connector.batch_exists(["keep"]) == [True]
    finally:
        connector.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
