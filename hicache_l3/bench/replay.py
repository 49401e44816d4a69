"""hicache-l3 replay: an agentic workload through a simulated L1/L2 per serving instance
and one real L3 connector, with and without the L3, and its effect on time to first token.

Per request: the leading prompt pages found in L1, then L2 (simulated LRU), then L3 (the
real connector: batch_exists, then batch_get, timed, every page verified); the rest is
recomputed and written to L3 (batch_set, timed, off the TTFT path). Modelled TTFT = L3
exists + get time + recomputed tokens / --prefill-tps; L1/L2 hits are free. The baseline
replays the same requests without L3. Workload and defaults: docs/replay.md.

Examples:
  hicache-l3 replay                                       # file connector in a temp dir
  hicache-l3 replay --sessions 64 --turns 20 --seed 1 --json r.json --plot r.png
  hicache-l3 replay --backend file --set file.root=/mnt/nvme/kv --page-bytes 1MiB
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hicache_l3.bench.runner import parse_settings, progress, quantile, size_arg
from hicache_l3.bench.tiers import InstanceCache, L3Tier, LoadResult
from hicache_l3.bench.workload import Request, Workload, WorkloadParams, generate
from hicache_l3.common.errors import ConfigError, HiCacheL3Error
from hicache_l3.common.keys import Namespace
from hicache_l3.common.logs import quiet_credential_loggers

# Fields of a per-turn record that must be identical for identical seeds.
HIT_FIELDS = ("index", "instance", "agent", "event", "prompt_tokens", "pages_needed",
              "l1_hits", "l2_hits", "l3_hits", "l3_hits_cross_instance", "recompute_tokens",
              "recompute_tokens_no_l3", "l3_set_pages")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """The tiers and the TTFT model (defaults and their sources: docs/replay.md)."""

    page_tokens: int = 64
    page_bytes: int = 64 << 10
    l1_pages: int = 512
    l2_pages: int = 1024
    prefill_tps: float = 20_000.0
    batch: int = 128
    ref_kv_bytes_per_token: int = 128 << 10

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value."""
        for name in ("page_tokens", "page_bytes", "l1_pages", "l2_pages", "batch",
                     "ref_kv_bytes_per_token"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, "
                                  f"got {getattr(self, name)}")
        if self.l2_pages < self.l1_pages:
            raise ConfigError(f"--l2-pages ({self.l2_pages}) must be >= --l1-pages "
                              f"({self.l1_pages}): HiCache keeps a host copy of every GPU page")
        if self.page_bytes % 64:
            raise ConfigError(f"--page-bytes must be a multiple of 64, got {self.page_bytes}")
        if self.prefill_tps <= 0:
            raise ConfigError(f"--prefill-tps must be > 0, got {self.prefill_tps}")


@dataclasses.dataclass
class ReplayResult:
    """Per-turn records and the per-instance caches a replay ended with."""

    rows: list[dict[str, Any]]
    caches: list[InstanceCache]


def replay(workload: Workload, config: ReplayConfig, l3: L3Tier | None,
           tick: Callable[[], None] | None = None) -> ReplayResult:
    """Run every request of ``workload`` through fresh L1/L2 caches and ``l3`` (None:
    no L3). Returns one record per request (see docs/replay.md for the fields)."""
    caches = [InstanceCache(config.l1_pages, config.l2_pages)
              for _ in range(workload.params.instances)]
    writer: dict[str, int] = {}
    rows = []
    pt = config.page_tokens
    for r in workload.requests:
        cache = caches[r.instance]
        l1, l2 = cache.match(r.keys)
        rest = r.keys[l1 + l2 :]
        loaded = l3.load(r.instance, rest) if (l3 is not None and rest) else LoadResult()
        cross = sum(1 for k in rest[: loaded.hits] if writer.get(k, r.instance) != r.instance)
        cached = l1 + l2 + loaded.hits
        new = r.keys[cached:] + r.out_keys
        stored, set_s = (l3.store(r.instance, new) if (l3 is not None and new) else (0, 0.0))
        if l3 is not None:
            for k in new:
                writer.setdefault(k, r.instance)
        cache.insert(r.keys + r.out_keys)
        recompute = r.prompt_tokens - cached * pt
        recompute_base = r.prompt_tokens - (l1 + l2) * pt
        l3_s = loaded.exists_s + loaded.get_s
        rows.append({
            "index": r.index, "time_s": round(r.time, 3), "instance": r.instance,
            "session": r.session, "agent": r.agent, "kind": r.kind, "turn": r.turn,
            "event": r.event, "prompt_tokens": r.prompt_tokens, "pages_needed": len(r.keys),
            "l1_hits": l1, "l2_hits": l2, "l3_hits": loaded.hits,
            "l3_hits_cross_instance": cross, "recompute_pages": len(r.keys) - cached,
            "recompute_tokens": recompute, "recompute_tokens_no_l3": recompute_base,
            "l3_bytes": loaded.hits * config.page_bytes, "l3_exists_s": loaded.exists_s,
            "l3_get_s": loaded.get_s, "l3_get_failures": loaded.get_failures,
            "l3_verify_failures": loaded.verify_failures, "l3_set_pages": stored,
            "l3_set_s": set_s, "ttft_s": l3_s + recompute / config.prefill_tps,
            "ttft_no_l3_s": recompute_base / config.prefill_tps,
        })
        if tick is not None:
            tick()
    return ReplayResult(rows, caches)


def check_baseline(with_l3: Sequence[dict[str, Any]], without: Sequence[dict[str, Any]]) -> None:
    """The baseline must see the same requests and the same L1/L2 hits (L1/L2 end each
    request holding the same pages whether they came from L3 or were recomputed)."""
    fields = ("index", "instance", "pages_needed", "l1_hits", "l2_hits")
    for a, b in zip(with_l3, without):
        if any(a[f] != b[f] for f in fields):
            raise HiCacheL3Error(f"baseline diverged at request {a['index']}: "
                                 f"{ {f: (a[f], b[f]) for f in fields} }")
    if len(with_l3) != len(without):
        raise HiCacheL3Error("baseline has a different number of requests")


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def summarize(rows: Sequence[dict[str, Any]], config: ReplayConfig,
              caches: Sequence[InstanceCache]) -> dict[str, Any]:
    """Hit rates, TTFT with and without L3, L3 traffic, working set, per-event figures."""
    def tot(field: str, subset: Sequence[dict[str, Any]] = rows) -> float:
        return sum(r[field] for r in subset)

    needed, l1, l2, l3 = tot("pages_needed"), tot("l1_hits"), tot("l2_hits"), tot("l3_hits")
    ttft = [r["ttft_s"] for r in rows]
    base = [r["ttft_no_l3_s"] for r in rows]
    get_s, exists_s, set_s = tot("l3_get_s"), tot("l3_exists_s"), tot("l3_set_s")
    l3_bytes = tot("l3_bytes")
    set_bytes = tot("l3_set_pages") * config.page_bytes
    scale = config.page_tokens * config.ref_kv_bytes_per_token / config.page_bytes
    projected = [r["l3_exists_s"] + r["l3_get_s"] * scale + r["recompute_tokens"] / config.prefill_tps
                 for r in rows]
    by_event = {}
    for event in sorted({r["event"] for r in rows}):
        sub = [r for r in rows if r["event"] == event]
        n = tot("pages_needed", sub)
        by_event[event] = {
            "requests": len(sub),
            "hit_rate_no_l3": _ratio(tot("l1_hits", sub) + tot("l2_hits", sub), n),
            "hit_rate_with_l3": _ratio(tot("l1_hits", sub) + tot("l2_hits", sub) + tot("l3_hits", sub), n),
            "ttft_mean_no_l3_s": _ratio(tot("ttft_no_l3_s", sub), len(sub)),
            "ttft_mean_s": _ratio(tot("ttft_s", sub), len(sub)),
        }
    seen = [len(c.seen) for c in caches]
    all_pages: set[str] = set().union(*(c.seen for c in caches)) if caches else set()
    mean = _ratio(sum(ttft), len(ttft))
    mean_base = _ratio(sum(base), len(base))
    mean_proj = _ratio(sum(projected), len(projected))
    return {
        "requests": len(rows),
        "pages_needed": needed, "l1_hits": l1, "l2_hits": l2, "l3_hits": l3,
        "l3_hits_cross_instance": tot("l3_hits_cross_instance"),
        "hit_rate_no_l3": _ratio(l1 + l2, needed),
        "hit_rate_with_l3": _ratio(l1 + l2 + l3, needed),
        "l3_hit_rate": _ratio(l3, needed - l1 - l2),
        "token_hit_rate_no_l3": 1 - _ratio(tot("recompute_tokens_no_l3"), tot("prompt_tokens")),
        "token_hit_rate_with_l3": 1 - _ratio(tot("recompute_tokens"), tot("prompt_tokens")),
        "ttft_mean_no_l3_s": mean_base, "ttft_mean_s": mean,
        **{f"ttft_p{q}{side}_s": quantile(values, q / 100) for q in (50, 90, 99)
           for side, values in (("_no_l3", base), ("", ttft))},
        "ttft_reduction_mean": 1 - _ratio(mean, mean_base),
        "ttft_reduction_p50": 1 - _ratio(quantile(ttft, 0.5), quantile(base, 0.5)),
        "l3_bytes_loaded": l3_bytes, "l3_get_s": get_s, "l3_exists_s": exists_s,
        "l3_read_gib_per_s": _ratio(l3_bytes, get_s) / 2**30,
        "l3_set_pages": tot("l3_set_pages"), "l3_set_s": set_s,
        "l3_write_gib_per_s": _ratio(set_bytes, set_s) / 2**30,
        "l3_get_failures": tot("l3_get_failures"), "l3_verify_failures": tot("l3_verify_failures"),
        "l3_pages_verified": l3,
        "working_set_pages": len(all_pages),
        "max_request_pages": max((r["pages_needed"] for r in rows), default=0),
        "working_set_pages_per_instance": seen,
        "projected_real_page_bytes": {
            "page_bytes": config.page_tokens * config.ref_kv_bytes_per_token,
            "l3_get_time_scale": scale,
            "break_even_read_gib_per_s": config.ref_kv_bytes_per_token * config.prefill_tps / 2**30,
            "ttft_mean_s": mean_proj,
            "ttft_reduction_mean": 1 - _ratio(mean_proj, mean_base),
            "note": "batch_get time scaled linearly by real page bytes / --page-bytes (a model, "
                    "not a measurement: larger transfers usually run faster per byte); loading a "
                    "page beats recomputing it only above break_even_read_gib_per_s",
        },
        "by_event": by_event,
    }


# ---- command line ----------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay's command-line options (defaults: :class:`ReplayConfig`, WorkloadParams)."""
    d, w = ReplayConfig(), WorkloadParams()
    parser.add_argument("--backend", default="file", help="L3 connector (default: file, in a temp dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="BACKEND.KEY=VALUE", help="a connector setting, e.g. file.root=/mnt/kv")
    parser.add_argument("--sessions", type=int, default=w.sessions, help=f"agent sessions ({w.sessions})")
    parser.add_argument("--turns", type=int, default=w.turns, help=f"turns per session ({w.turns})")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (1)")
    parser.add_argument("--instances", type=int, default=w.instances,
                        help=f"serving instances sharing the L3 ({w.instances})")
    parser.add_argument("--l1-pages", type=int, default=d.l1_pages,
                        help=f"simulated GPU cache per instance, pages ({d.l1_pages})")
    parser.add_argument("--l2-pages", type=int, default=d.l2_pages,
                        help=f"simulated host cache per instance, pages ({d.l2_pages})")
    parser.add_argument("--page-tokens", type=int, default=d.page_tokens,
                        help=f"tokens per page ({d.page_tokens})")
    parser.add_argument("--page-bytes", type=size_arg, default=d.page_bytes,
                        help="real bytes moved per page (64KiB)")
    parser.add_argument("--prefill-tps", type=float, default=d.prefill_tps,
                        help=f"recompute throughput, tokens/s ({d.prefill_tps:.0f})")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"pages per L3 call ({d.batch})")
    parser.add_argument("--ref-kv-bytes-per-token", type=size_arg, default=d.ref_kv_bytes_per_token,
                        help="KV bytes per token of the reference model, for the projection "
                             "to real page sizes (128KiB: Llama-3.1-8B bf16)")
    parser.add_argument("--connectors", choices=["per-instance", "shared"], default="per-instance",
                        help="one connector per serving instance (default) or one for all")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the file backend stores pages (default: a temp dir, removed after)")
    parser.add_argument("--json", type=Path, default=None, help="write config, summary and per_turn here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of hits and TTFT (matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _settings(backend: str, overrides: list[str]) -> dict[str, Any]:
    parsed = parse_settings(overrides)
    for item in overrides:
        if item.partition(".")[0] != backend:
            raise ConfigError(f"--set {item!r}: the replay runs backend {backend!r} only")
    return parsed.get(backend, {})


def _env_configured(name: str, field: str = "") -> bool:
    prefix = f"HICACHE_L3_{name.upper()}_{field.upper()}"
    return any(k.startswith(prefix) for k in os.environ)


def _has_root(name: str) -> bool:
    """True for connectors that keep pages under a directory (``root`` setting)."""
    from hicache_l3.common.registry import config_class

    return any(f.name == "root" for f in dataclasses.fields(config_class(name)))


def open_l3(
    backend: str, settings: dict[str, Any], instances: int, shared: bool, config: ReplayConfig,
    stack: contextlib.ExitStack, workdir: Path,
) -> tuple[L3Tier, dict[str, Any]]:
    """Open the L3 connectors (starting a local engine when no address is configured);
    registered on ``stack`` for closing. Returns the tier and the settings used."""
    from hicache_l3.common.registry import open_connector, resolve_name
    from hicache_l3.engines import ENGINES

    name = resolve_name(backend)
    settings = dict(settings)
    if not settings and not _env_configured(name) and name in ENGINES:
        engine = stack.enter_context(ENGINES[name]())  # stopped when the stack closes
        settings = dict(engine.settings)
    if _has_root(name) and "root" not in settings and not _env_configured(name, "root"):
        settings["root"] = str(workdir / "l3")
    if not settings and not _env_configured(name):
        raise ConfigError(f"no address configured for {name!r} and no local launcher; "
                          f"pass --set {name}.KEY=VALUE or HICACHE_L3_{name.upper()}_* variables")
    settings.setdefault("page_bytes", config.page_bytes)
    namespace = Namespace(model="hicache-l3-replay", kv_dtype="bfloat16", layout="page_first",
                          page_size=config.page_tokens, tag=f"replay-{uuid.uuid4().hex[:12]}")
    connectors = []
    try:
        for _ in range(1 if shared else instances):
            connectors.append(open_connector(name, namespace, settings))
        tier = L3Tier(connectors, config.page_bytes, config.batch)
    except BaseException:
        for conn in connectors:
            conn.close()
        raise

    def _close() -> None:
        with contextlib.suppress(HiCacheL3Error, OSError):
            tier.connectors[0].clear()  # this run's namespace only
        tier.close()

    stack.callback(_close)
    shown = {k: ("***" if any(s in k.lower() for s in ("secret", "key", "password", "token")) else v)
             for k, v in settings.items()}
    return tier, shown


def run(args: argparse.Namespace) -> int:
    """Generate the workload, replay it with and without L3, print and write results."""
    quiet_credential_loggers()
    started = time.monotonic()
    config = ReplayConfig(args.page_tokens, args.page_bytes, args.l1_pages, args.l2_pages,
                          args.prefill_tps, args.batch, args.ref_kv_bytes_per_token)
    params = WorkloadParams(sessions=args.sessions, turns=args.turns, instances=args.instances)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hicache-l3-replay-"))
    try:
        config.validate()
        params.validate()
        workload = generate(params, config.page_tokens, args.seed)
        with contextlib.ExitStack() as stack:
            settings = _settings(args.backend, args.overrides)
            tier, shown = open_l3(args.backend, settings, params.instances,
                                  args.connectors == "shared", config, stack, workdir)
            with progress(len(workload.requests), args.quiet, "replay", "req", delay=1.0,
                          mininterval=0.5) as tick:
                result = replay(workload, config, tier, tick)
        baseline = replay(workload, config, None)
        check_baseline(result.rows, baseline.rows)
    except (HiCacheL3Error, ValueError, OSError) as exc:
        print(f"hicache-l3 replay failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(result.rows, config, result.caches)
    meta = {
        "backend": args.backend, "settings": shown, "seed": args.seed,
        "connectors": args.connectors, "replay": dataclasses.asdict(config),
        "workload": dataclasses.asdict(params), "workload_counts": workload.counts,
        "profile_tokens": workload.profile_tokens,
        "ttft_model": "L3 exists+get time (measured) + recompute_tokens / prefill_tps; "
                      "L1/L2 hits free; L3 writes asynchronous (not in TTFT)",
        "baseline": "the same requests replayed through the same L1/L2 with no L3",
        "elapsed_s": round(time.monotonic() - started, 2),
    }
    print(format_report(meta, summary))
    if args.json:
        args.json.write_text(json.dumps({"config": meta, "summary": summary, "per_turn": result.rows},
                                        indent=1))
    if args.plot:
        plot_replay(result.rows, summary, args.plot, params.turns, config.page_tokens)
    return 1 if summary["l3_verify_failures"] else 0


def format_report(meta: dict[str, Any], s: dict[str, Any]) -> str:
    """The human-readable summary printed by ``hicache-l3 replay``."""
    w, c, n = meta["workload"], meta["replay"], meta["workload_counts"]
    proj = s["projected_real_page_bytes"]

    def ms(x: float) -> str:
        return f"{x * 1e3:9.1f} ms"

    lines = [
        f"hicache-l3 replay: backend={meta['backend']}, {w['sessions']} sessions x {w['turns']} turns, "
        f"seed {meta['seed']}, {w['instances']} serving instances sharing one L3",
        f"workload: {s['requests']} requests; {n['subagents']} sub-agents from {n['forks']} forks, "
        f"{n['pauses']} pauses ({n['migrations']} resumed elsewhere); profiles of "
        f"{', '.join(str(t) for t in meta['profile_tokens'])} tokens",
        f"defaults used: page = {c['page_tokens']} tokens, {c['page_bytes']} real bytes; "
        f"L1 {c['l1_pages']} pages, L2 {c['l2_pages']} pages per instance; recompute "
        f"{c['prefill_tps']:,.0f} tokens/s; L3 batch {c['batch']} pages",
        f"working set: {s['working_set_pages']:,} distinct pages; per instance "
        f"{', '.join(f'{x:,}' for x in s['working_set_pages_per_instance'])}; longest prompt "
        f"{s['max_request_pages']:,} pages"
        + (" (more than L1 holds)" if s["max_request_pages"] > c["l1_pages"] else ""),
        "",
        f"{'':28}{'without L3':>14}{'with L3':>14}",
        f"{'page hit rate':28}{s['hit_rate_no_l3']:>14.1%}{s['hit_rate_with_l3']:>14.1%}",
        f"{'token hit rate':28}{s['token_hit_rate_no_l3']:>14.1%}{s['token_hit_rate_with_l3']:>14.1%}",
        *(f"{'TTFT ' + q:28}{ms(s[f'ttft_{q}_no_l3_s']):>14}{ms(s[f'ttft_{q}_s']):>14}"
          for q in ("mean", "p50", "p90", "p99")),
        "",
        f"pages: {s['pages_needed']:,} needed; L1 {s['l1_hits']:,}, L2 {s['l2_hits']:,}, "
        f"L3 {s['l3_hits']:,} ({s['l3_hits_cross_instance']:,} written by another instance); "
        f"L3 hit rate {s['l3_hit_rate']:.1%} of what L1/L2 missed",
        f"TTFT reduction with L3: mean {s['ttft_reduction_mean']:.1%}, p50 {s['ttft_reduction_p50']:.1%}",
        f"L3 reads: {s['l3_bytes_loaded'] / 2**30:.2f} GiB in {s['l3_get_s']:.2f} s "
        f"({s['l3_read_gib_per_s']:.2f} GiB/s) + exists {s['l3_exists_s']:.2f} s; every page "
        f"verified ({s['l3_pages_verified']:,} ok, {s['l3_verify_failures']} wrong, "
        f"{s['l3_get_failures']} failed gets)",
        f"L3 writes: {s['l3_set_pages']:,} pages in {s['l3_set_s']:.2f} s "
        f"({s['l3_write_gib_per_s']:.2f} GiB/s)",
        f"projected at real page size ({proj['page_bytes'] / 2**20:.0f} MiB, "
        f"get time x{proj['l3_get_time_scale']:.0f}): "
        f"TTFT mean {ms(proj['ttft_mean_s']).strip()}, reduction {proj['ttft_reduction_mean']:.1%} "
        f"(loading beats recomputing above {proj['break_even_read_gib_per_s']:.2f} GiB/s)",
        "by event:  " + "; ".join(
            f"{e} {v['requests']} req, hits {v['hit_rate_no_l3']:.0%}->{v['hit_rate_with_l3']:.0%}, "
            f"TTFT {v['ttft_mean_no_l3_s'] * 1e3:.0f}->{v['ttft_mean_s'] * 1e3:.0f} ms"
            for e, v in s["by_event"].items()),
        f"({meta['elapsed_s']:.1f} s)",
    ]
    return "\n".join(lines)


def plot_replay(rows: Sequence[dict[str, Any]], summary: dict[str, Any], path: Path, turns: int,
                page_tokens: int) -> None:
    """Three panels: where pages came from by turn, TTFT distribution with and without
    L3, and the running hit rate over the replay."""
    from hicache_l3.bench.plot import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    main = [r for r in rows if r["kind"] == "main"]
    xs = list(range(turns))
    parts: dict[str, list[float]] = {"L1": [], "L2": [], "L3": [], "recomputed": []}
    for t in xs:
        sub = [r for r in main if r["turn"] == t]
        need = sum(r["prompt_tokens"] for r in sub) or 1
        parts["L1"].append(sum(r["l1_hits"] for r in sub) * page_tokens / need)
        parts["L2"].append(sum(r["l2_hits"] for r in sub) * page_tokens / need)
        parts["L3"].append(sum(r["l3_hits"] for r in sub) * page_tokens / need)
        parts["recomputed"].append(sum(r["recompute_tokens"] for r in sub) / need)
    bottom = [0.0] * len(xs)
    colors = {"L1": "#2b8a3e", "L2": "#74b816", "L3": "#1971c2", "recomputed": "#e03131"}
    for name, vals in parts.items():
        axes[0].bar(xs, vals, bottom=bottom, label=name, color=colors[name])
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set(xlabel="turn of the main sessions", ylabel="share of prompt tokens",
                title="where prompt tokens came from", ylim=(0, 1.0))
    axes[0].set_xticks(xs[:: max(1, len(xs) // 10)])
    axes[0].legend(loc="lower right", fontsize=8)

    for field, label, style in (("ttft_no_l3_s", "without L3", "--"), ("ttft_s", "with L3", "-")):
        vals = sorted(r[field] * 1e3 for r in rows)
        axes[1].plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], style, label=label)
    axes[1].set(xlabel="modelled TTFT (ms)", ylabel="fraction of requests", xscale="log",
                title=f"TTFT: mean {summary['ttft_reduction_mean']:.0%} lower with L3")
    axes[1].legend()

    acc_base = acc_l3 = acc_need = 0
    run_base, run_l3 = [], []
    for r in rows:
        acc_need += r["pages_needed"]
        acc_base += r["l1_hits"] + r["l2_hits"]
        acc_l3 += r["l1_hits"] + r["l2_hits"] + r["l3_hits"]
        run_base.append(_ratio(acc_base, acc_need))
        run_l3.append(_ratio(acc_l3, acc_need))
    axes[2].plot(run_base, "--", label="without L3")
    axes[2].plot(run_l3, "-", label="with L3")
    axes[2].set(xlabel="request", ylabel="cumulative page hit rate", ylim=(0, 1.0),
                title=f"hit rate {summary['hit_rate_no_l3']:.0%} -> {summary['hit_rate_with_l3']:.0%}")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["HIT_FIELDS", "ReplayConfig", "Request", "add_arguments", "replay", "run", "summarize"]
