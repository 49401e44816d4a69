"""hicache-l3 as the L3 tier of a real SGLang 0.5.23 server (``python -m sglang.launch_server``).

The servers run on CPU from .venv-sglang (built by `make setup-sglang`), on 127.0.0.1 and free
ports, with the CPU recipe of tests/e2e/server.py (SGLANG_USE_CPU_ENGINE=1, --device cpu,
torch_native attention, --skip-tokenizer-init so requests carry input_ids, float32, pages of
64 tokens, HiCache writing through) and the L3 flags that `hicache-l3 sglang-args` prints.
The model is a tiny Llama with random weights written here (make_model.py); the hybrid
scenario uses a tiny Mellum (a sliding-window and a full-attention layer), which SGLang
serves as a hybrid SWA model: a full and a sliding-window host pool, the second one handed to
our backend through the v2 interface (batch_exists_v2/batch_get_v2/batch_set_v2).

Each scenario checks, for one connector or route (the file connector in page_first,
layer_first and with `--hicache-io-backend direct`; Mooncake Store from the project's
launcher; NIXL file mode; hf3fs in POSIX mode; the opt-in plugin's
`--hicache-storage-backend file`; and the hybrid SWA model on the file connector):
1. a ~1600-token prompt is answered; after `POST /flush_cache` (SGLang empties the device and
   host tiers, L3 is kept) the same prompt reports `meta_info.cached_tokens_details.storage`
   > 0: its prefix came back from L3;
2. our own counters (the backend's `stats()`, read through the stand-in module) show the
   pages written and read, and SGLang's `/metrics` shows the L3 prefetch (fed by our
   `get_stats()`) and the storage hit tokens;
3. a second server process on the same storage gets storage hits on its first request;
4. output tokens and logprobs are bit-identical to a server without L3 answering the prompt
   from its device cache (same prefix length, same compute path).

Test-only stand-ins (tests/e2e/standins/sitecustomize.py, on the servers' PYTHONPATH only)
replace four things SGLang's CPU path lacks here, none on the L2<->L3 path under test:
- `copy_all_layer_kv_cache_cpu` / `assign_req_to_token_pool_cpu` (sgl-kernel's CPU build is
  source-only; the PyPI wheel is CUDA-only): row moves in the device KV pool and the
  request->token table, L1 bookkeeping;
- CUDA host registration of the `pin_memory=True` host pools (needs a CUDA driver): the pool
  memory is allocated as SGLang allocates it, only the registration is skipped;
- the device<->host KV copies (`transfer_kv_*`) that pool_host/mha.py imports only on
  CUDA/ROCm/XPU: the L1<->L2 hop, done with torch row copies with the kernels' arithmetic;
- (hybrid SWA model only) the torch_native attention backend reads a sliding-window layer's
  K/V at untranslated full-pool slots while it writes them at SWA-pool slots: the stand-in
  translates the read as SGLang's GPU backends do (L1 compute; a no-op for the Llama).
The L2<->L3 path (SGLang's HiCacheController calling our backend with host-pool indices, our
connector moving those pages to and from its engine) runs unchanged; if a stand-in copied
wrong bytes, check 4 would fail.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_server import HICACHE_FLAGS, SGLANG_PY, SGLangServer, sglang_args

# module fixtures (the model, the baseline server) count toward the first test: a longer bound
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PAGE = 64
PROMPT_TOKENS = 1600
# SGLang matches whole pages and always computes the last token: 1600 tokens -> 24 pages.
CACHED = (PROMPT_TOKENS - 1) // PAGE * PAGE
MODEL_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


def make_model(workdir: Path, arch: str) -> Path:
    """A tiny random model of ``arch`` (make_model.py), written under ``workdir``."""
    assert SGLANG_PY.exists(), f"{SGLANG_PY} is missing: run `make setup-sglang`"
    path = workdir / f"tiny-{arch}"
    out = subprocess.run([str(SGLANG_PY), str(Path(__file__).parent / "make_model.py"), str(path),
                          arch], capture_output=True, text=True, timeout=MODEL_TIMEOUT)
    assert out.returncode == 0, f"make_model.py failed:\n{out.stderr[-4000:]}"
    return path


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    """The tiny random Llama, written once per module."""
    return make_model(workdir, "llama")


@pytest.fixture(scope="module")
def hybrid_model(workdir: Path) -> Path:
    """The tiny random Mellum (one sliding-window layer, one full layer), written once per
    module: SGLang serves it as a hybrid SWA model."""
    return make_model(workdir, "mellum")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(15)
    return [rng.randrange(3, 4096) for _ in range(PROMPT_TOKENS)]


def answer(result: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """(output token ids, output logprobs) of a /generate answer."""
    meta = result["meta_info"]
    return result["output_ids"], [lp[0] for lp in meta["output_token_logprobs"]]


def storage_hits(result: dict[str, Any]) -> int:
    details = result["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0))


def device_hit_answer(name: str, model: Path, workdir: Path,
                      prompt: list[int]) -> tuple[list[Any], list[Any]]:
    """Output and logprobs of a server without L3, the prompt's prefix from its device cache."""
    with SGLangServer(name, model, ["--enable-hierarchical-cache", *HICACHE_FLAGS],
                      workdir) as server:
        server.generate(prompt)
        again = server.generate(prompt)
    assert again["meta_info"]["cached_tokens"] == CACHED, again["meta_info"]
    return answer(again)


@pytest.fixture(scope="module")
def baseline(model: Path, workdir: Path, prompt: list[int]) -> tuple[list[Any], list[Any]]:
    """The Llama's answer without L3 (device-cache hit)."""
    return device_hit_answer("baseline", model, workdir, prompt)


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_model: Path, workdir: Path,
                    prompt: list[int]) -> tuple[list[Any], list[Any]]:
    """The hybrid model's answer without L3 (device-cache hit)."""
    return device_hit_answer("hybrid-baseline", hybrid_model, workdir, prompt)


def l3_round(server: SGLangServer, prompt: list[int], baseline: tuple[list[Any], list[Any]],
             *, fresh: bool) -> dict[str, Any]:
    """One server's part: (first server) prompt, wait for the write-through to L3, flush L1/L2;
    then the prompt again, which must come from L3 with the baseline's exact answer."""
    if fresh:
        first = server.generate(prompt)
        assert storage_hits(first) == 0, first["meta_info"]
        wait_backed_up(server, CACHED // PAGE)
        server.flush_cache()
    result = server.generate(prompt)
    assert storage_hits(result) > 0, server.fail(f"no storage hits: {result['meta_info']}")
    assert storage_hits(result) == CACHED, result["meta_info"]
    assert answer(result) == baseline, "outputs/logprobs differ from the run without L3"
    return result


def wait_backed_up(server: SGLangServer, pages: int, timeout: float = 60.0) -> None:
    """Wait until our backend has stored ``pages`` pages (write-through is asynchronous)."""
    import time

    deadline = time.monotonic() + timeout
    stored = 0
    while time.monotonic() < deadline:
        stats = server.our_stats()
        stored = pages_ok(stats, "set")
        if stored >= pages:
            return
        time.sleep(0.5)
    raise server.fail(f"only {stored} of {pages} pages written to L3 within {timeout:.0f}s")


def pages_ok(stats: list[dict[str, Any]], op: str) -> int:
    """Pages that succeeded in ``op`` (a hit, for get) over the backends' ``stats()``."""
    return sum(int(s.get("ops", {}).get(op, {}).get("ok", 0)) for s in stats)


def check_counters(server: SGLangServer, *, wrote: bool) -> None:
    """Our stats and SGLang's /metrics both show the L3 reads (and, for the first server,
    the writes)."""
    stats = server.our_stats()
    assert stats, server.fail("no hicache-l3 backend attached")
    got = pages_ok(stats, "get")
    assert got >= CACHED // PAGE, server.fail(f"our stats count {got} pages read: {stats}")
    if wrote:
        assert pages_ok(stats, "set") >= CACHED // PAGE, stats
    metrics = server.metrics()
    assert metrics.get("sglang:prefetch_pgs_sum", 0) >= CACHED // PAGE, server.fail(
        f"/metrics shows no L3 prefetch: { {k: v for k, v in metrics.items() if 'pgs' in k} }")
    hit_tokens = metrics.get("sglang:storage_prefetch_hit_tokens_total", 0)
    assert hit_tokens >= CACHED, server.fail(
        f"/metrics shows no storage hit tokens: { {k: v for k, v in metrics.items() if 'storage' in k} }")


# ---- scenarios ---------------------------------------------------------------------------------


def run_scenario(name: str, model: Path, workdir: Path, prompt: list[int],
                 baseline: tuple[list[Any], list[Any]], flags: list[str],
                 env: dict[str, str] | None = None,
                 check: Callable[[SGLangServer, bool], None] | None = None) -> None:
    """Two server processes in turn on the same L3 storage, each checked as the docstring says
    (and by ``check(server, wrote)``, if given, after the common checks)."""
    with SGLangServer(f"{name}-1", model, [*flags, *HICACHE_FLAGS], workdir, env) as first:
        l3_round(first, prompt, baseline, fresh=True)
        check_counters(first, wrote=True)
        if check:
            check(first, True)
    with SGLangServer(f"{name}-2", model, [*flags, *HICACHE_FLAGS], workdir, env) as second:
        l3_round(second, prompt, baseline, fresh=False)
        check_counters(second, wrote=False)
        if check:
            check(second, False)


@pytest.fixture()
def scenario(model: Path, workdir: Path, prompt: list[int],
             baseline: tuple[list[Any], list[Any]]) -> Iterator[Any]:
    def run(name: str, flags: list[str], env: dict[str, str] | None = None) -> None:
        run_scenario(name, model, workdir, prompt, baseline, flags, env)
    yield run


def test_file_page_first(scenario: Any, workdir: Path) -> None:
    root = workdir / "file-page-first"
    flags = sglang_args("file", workdir / "file-page-first.toml", {"root": str(root)})
    scenario("file-page-first", flags)
    assert any(root.rglob("*")), "the file connector left nothing in its root"


def with_layout(flags: list[str], layout: str) -> list[str]:
    """``flags`` with ``--hicache-mem-layout`` set to ``layout``."""
    out = list(flags)
    out[out.index("--hicache-mem-layout") + 1] = layout
    return out


def test_file_layer_first(scenario: Any, workdir: Path) -> None:
    flags = sglang_args("file", workdir / "file-layer-first.toml", {"root": str(workdir / "file-lf")})
    scenario("file-layer-first", with_layout(flags, "layer_first"))


def test_plugin_file(scenario: Any, workdir: Path) -> None:
    """The opt-in plugin: SGLang's own `--hicache-storage-backend file`, served by our file
    connector (HICACHE_L3_SGLANG_BACKENDS=file), root from SGLang's own variable."""
    root = workdir / "plugin-file"
    scenario("plugin-file", ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first",
                             "--hicache-storage-backend", "file"],
             {"HICACHE_L3_SGLANG_BACKENDS": "file", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(root)})
    assert any(root.rglob("*")), "the plugin's file connector left nothing in its root"


def test_file_direct_io(scenario: Any, workdir: Path) -> None:
    """``--hicache-io-backend direct`` with SGLang's direct host layout (page_first_direct:
    direct io takes page_first_direct or layer_first), our backend handed that pool's pages."""
    flags = sglang_args("file", workdir / "file-direct.toml", {"root": str(workdir / "file-direct")})
    scenario("file-direct", [*with_layout(flags, "page_first_direct"), "--hicache-io-backend", "direct"])


def test_mooncake(scenario: Any, workdir: Path) -> None:
    """Mooncake Store from the project's launcher (master + a segment holder on loopback):
    the servers hold no segment, so the pages written by the first live in the holder and
    the second server reads them. The servers run with the loopback shim preloaded, so their
    transfer engines listen on 127.0.0.1 only."""
    from hicache_l3.engines import MooncakeEngine, loopback

    with MooncakeEngine(holder=True, segment_size="512 MB") as engine:
        sets = {key: str(value) for key, value in engine.settings.items()}
        flags = sglang_args("mooncake", workdir / "mooncake.toml", sets)
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        if loopback.SHIM:
            env["LD_PRELOAD"] = loopback.SHIM
        scenario("mooncake", flags, env)


def test_nixl_file_mode(scenario: Any, workdir: Path) -> None:
    """NIXL in file mode (its POSIX backend moving the pages between SGLang's host pool and
    our slab files)."""
    root = workdir / "nixl-file"
    flags = sglang_args("nixl", workdir / "nixl-file.toml", {"root": str(root), "mode": "file"})
    scenario("nixl-file", flags)
    assert any(root.rglob("*")), "the nixl connector left nothing in its root"


def test_hf3fs_posix(scenario: Any, workdir: Path) -> None:
    """The hf3fs connector in POSIX mode on a directory (no 3FS here: the mount is a plain
    directory and USRBIO is off)."""
    root = workdir / "hf3fs"
    flags = sglang_args("hf3fs", workdir / "hf3fs.toml", {"root": str(root), "usrbio": "off"})
    scenario("hf3fs", flags)
    assert any(root.rglob("*")), "the hf3fs connector left nothing in its root"


def check_swa_pool(server: SGLangServer, wrote: bool) -> None:
    """The sliding-window pool went through our v2 path: its own connector stored (first
    server) and loaded pages (the window's trailing pages, SGLang's ``trailing_pages`` hit
    policy), and SGLang's log names the pool as served through the v2 interface."""
    assert "serving extra host pools ['swa'] through the v2 interface" in server.log(), server.fail(
        "the sliding-window host pool was not registered with hicache-l3")
    pools = [s.get("extra_pools", {}).get("swa") for s in server.our_stats()]
    swa = [p for p in pools if p]
    assert swa, server.fail(f"no 'swa' pool connector in our stats: {pools}")
    got = sum(int(p["ops"]["get"]["ok"]) for p in swa)
    assert got >= 1, server.fail(f"no sliding-window page loaded from L3: {swa}")
    if wrote:
        stored = sum(int(p["ops"]["set"]["ok"]) for p in swa)
        assert stored >= got, server.fail(f"sliding-window pages: {stored} stored, {got} loaded: {swa}")


def test_hybrid_mellum(hybrid_model: Path, workdir: Path, prompt: list[int],
                       hybrid_baseline: tuple[list[Any], list[Any]]) -> None:
    """A hybrid SWA model (tiny Mellum: a sliding-window layer and a full-attention layer)
    on the file connector: SGLang builds a full and a sliding-window host pool and hands both
    to our backend (`register_mem_host_pool_v2`, `batch_set_v2`/`batch_get_v2`), so the
    prefix coming back from L3 after a flush carries both pools' pages."""
    root = workdir / "hybrid-mellum"
    flags = sglang_args("file", workdir / "hybrid-mellum.toml", {"root": str(root)})
    run_scenario("hybrid-mellum", hybrid_model, workdir, prompt, hybrid_baseline, flags,
                 check=check_swa_pool)
    assert any(root.rglob("*")), "the file connector left nothing in its root"
