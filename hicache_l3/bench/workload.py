"""The agentic workload behind ``hicache-l3 replay``: a deterministic stream of prefill
requests from agent sessions (think / act / observe turns over a growing context, shared
profiles, pauses, migrations, forked sub-agents; every number a :class:`WorkloadParams`
field, sources in docs/replay.md), ordered by simulated time independent of cache state.
Page ``i``'s key is ``blake2b(key[i-1] || tokens of page i)``, as SGLang chains them; only
full pages have keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import random
from collections.abc import Iterator

TOKEN_BYTES = 4


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """A log-normal length or duration: ``median`` and ``sigma`` (of the log), clipped
    to ``[low, high]``. Heavy right tail, as tool outputs and tool latencies are."""

    median: float
    sigma: float
    low: float
    high: float

    def draw(self, rng: random.Random) -> float:
        """One value."""
        value = self.median * math.exp(rng.gauss(0.0, self.sigma))
        return min(self.high, max(self.low, value))

    def tokens(self, rng: random.Random) -> int:
        """One value rounded to a whole number of tokens (at least 1)."""
        return max(1, round(self.draw(rng)))


@dataclasses.dataclass(frozen=True)
class WorkloadParams:
    """What the agents do. Defaults and their sources: ``docs/replay.md``."""

    sessions: int = 64
    turns: int = 20
    instances: int = 4
    profiles: int = 4
    profile_zipf: float = 1.0
    system_tokens: LogNormal = LogNormal(3000, 0.4, 1000, 8000)
    tool_schema_tokens: LogNormal = LogNormal(6000, 0.6, 1000, 20000)
    task_tokens: LogNormal = LogNormal(300, 0.8, 30, 4000)
    think_tokens: LogNormal = LogNormal(120, 0.6, 10, 1500)
    act_tokens: LogNormal = LogNormal(60, 0.5, 10, 600)
    observe_tokens: LogNormal = LogNormal(250, 1.0, 5, 4000)
    decode_tps: float = 50.0
    tool_s: LogNormal = LogNormal(3.0, 1.0, 0.1, 120.0)
    pause_p: float = 0.1
    pause_s: LogNormal = LogNormal(600.0, 0.7, 120.0, 3600.0)
    migrate_p: float = 0.2
    fork_p: float = 0.05
    subagents: tuple[int, int] = (2, 4)
    subagent_turns: tuple[int, int] = (2, 6)
    subagent_task_tokens: LogNormal = LogNormal(150, 0.5, 20, 1000)
    subagent_summary_tokens: LogNormal = LogNormal(400, 0.5, 50, 2000)
    arrival_s: float = 2.0

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        for name in ("sessions", "turns", "instances", "profiles"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("pause_p", "migrate_p", "fork_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"workload: {name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("subagents", "subagent_turns"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"workload: {name} must be (lo, hi) with 1 <= lo <= hi")
        if self.decode_tps <= 0 or self.arrival_s < 0:
            raise ValueError("workload: decode_tps must be > 0 and arrival_s >= 0")


@dataclasses.dataclass(frozen=True)
class Request:
    """One prefill request: ``keys`` of the prompt's full pages, ``out_keys`` of the pages
    the output fills (the instance caches both after the request)."""

    index: int
    time: float
    instance: int
    session: int
    agent: str
    kind: str  # "main" or "sub"
    turn: int
    event: str  # "start", "turn", "resume", "fork" (a sub-agent's first request), "join"
    prompt_tokens: int
    keys: tuple[str, ...]
    out_keys: tuple[str, ...]


@dataclasses.dataclass
class Workload:
    """The generated requests (in time order) and what was generated."""

    params: WorkloadParams
    page_tokens: int
    seed: int
    requests: list[Request]
    profile_tokens: list[int]
    counts: dict[str, int]


def page_key(prev: str, tokens: bytes | memoryview) -> str:
    """The chained key of one page: depends on ``prev`` (the previous page's key, ``""``
    for the first page) and on this page's tokens."""
    h = hashlib.blake2b(prev.encode(), digest_size=16)
    h.update(tokens)
    return h.hexdigest()


class Context:
    """A growing token sequence and the chained keys of its full pages."""

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self.tokens = bytearray()
        self.keys: list[str] = []

    @property
    def n_tokens(self) -> int:
        """Tokens in the context."""
        return len(self.tokens) // TOKEN_BYTES

    def append(self, data: bytes) -> None:
        """Append tokens (``TOKEN_BYTES`` bytes each) and key every page now full."""
        self.tokens += data
        step = self.page_tokens * TOKEN_BYTES
        view = memoryview(self.tokens)
        try:
            while (len(self.keys) + 1) * step <= len(self.tokens):
                i = len(self.keys)
                prev = self.keys[-1] if self.keys else ""
                self.keys.append(page_key(prev, view[i * step : (i + 1) * step]))
        finally:
            view.release()

    def fork(self) -> Context:
        """An independent copy (a sub-agent starts from its parent's context)."""
        other = Context(self.page_tokens)
        other.tokens = bytearray(self.tokens)
        other.keys = list(self.keys)
        return other


@dataclasses.dataclass
class _Agent:
    name: str
    session: int
    kind: str
    rng: random.Random
    ctx: Context
    instance: int
    turns: int
    turn: int = 0
    event: str = "start"
    parent: _Agent | None = None
    waiting: int = 0  # sub-agents still running (parent only)
    join_at: float = 0.0
    summaries: bytes = b""


def _tokens(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n * TOKEN_BYTES)


class _Generator:
    def __init__(self, params: WorkloadParams, page_tokens: int, seed: int) -> None:
        params.validate()
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        self.p = params
        self.page_tokens = page_tokens
        self.seed = seed
        self.requests: list[Request] = []
        self.heap: list[tuple[float, int, _Agent]] = []
        self.seq = 0
        self.load = [0] * params.instances  # active agents per instance
        self.counts = {"sessions": params.sessions, "subagents": 0, "forks": 0, "pauses": 0,
                       "migrations": 0}
        rng = random.Random(f"{seed}:profiles")
        self.profiles: list[Context] = []
        for _ in range(params.profiles):
            ctx = Context(page_tokens)
            ctx.append(_tokens(rng, params.system_tokens.tokens(rng)))
            ctx.append(_tokens(rng, params.tool_schema_tokens.tokens(rng)))
            self.profiles.append(ctx)
        weights = [1.0 / (i + 1) ** params.profile_zipf for i in range(params.profiles)]
        self.profile_cdf = [sum(weights[: i + 1]) / sum(weights) for i in range(params.profiles)]

    def _push(self, when: float, agent: _Agent) -> None:
        heapq.heappush(self.heap, (when, self.seq, agent))
        self.seq += 1

    def _least_loaded(self) -> int:
        return min(range(len(self.load)), key=lambda i: (self.load[i], i))

    def run(self) -> Workload:
        p = self.p
        arrivals = random.Random(f"{self.seed}:arrivals")
        t = 0.0
        for s in range(p.sessions):
            rng = random.Random(f"{self.seed}:session:{s}")
            u = rng.random()
            profile = next(i for i, c in enumerate(self.profile_cdf) if u <= c or i == p.profiles - 1)
            ctx = self.profiles[profile].fork()
            ctx.append(_tokens(rng, p.task_tokens.tokens(rng)))
            agent = _Agent(f"s{s}", s, "main", rng, ctx, s % p.instances, p.turns)
            self._push(t, agent)
            t += arrivals.expovariate(1.0 / p.arrival_s) if p.arrival_s > 0 else 0.0
        while self.heap:
            now, _, agent = heapq.heappop(self.heap)
            self._step(now, agent)
        return Workload(p, self.page_tokens, self.seed, self.requests,
                        [c.n_tokens for c in self.profiles], self.counts)

    def _step(self, now: float, agent: _Agent) -> None:
        p, rng, ctx = self.p, agent.rng, agent.ctx
        if agent.event == "start":
            self.load[agent.instance] += 1
        elif agent.event == "resume":
            if agent.instance < 0:
                agent.instance = self._least_loaded()
            self.load[agent.instance] += 1
        n_prompt_pages, prompt_tokens = len(ctx.keys), ctx.n_tokens
        out = _tokens(rng, p.think_tokens.tokens(rng) + p.act_tokens.tokens(rng))
        ctx.append(out)
        self.requests.append(Request(
            len(self.requests), now, agent.instance, agent.session, agent.name, agent.kind,
            agent.turn, agent.event, prompt_tokens, tuple(ctx.keys[:n_prompt_pages]),
            tuple(ctx.keys[n_prompt_pages:]),
        ))
        done = now + (len(out) // TOKEN_BYTES) / p.decode_tps
        agent.turn += 1
        if agent.turn >= agent.turns:
            self._finish(done, agent)
            return
        if agent.kind == "main" and rng.random() < p.fork_p:
            self._fork(done, agent)
            return
        if agent.kind == "main" and rng.random() < p.pause_p:
            self.counts["pauses"] += 1
            wait = p.pause_s.draw(rng)
            agent.event = "resume"
            self.load[agent.instance] -= 1
            if rng.random() < p.migrate_p:
                self.counts["migrations"] += 1
                agent.instance = -1  # the least loaded instance when it comes back
        else:
            wait = p.tool_s.draw(rng)
            agent.event = "turn"
        ctx.append(_tokens(rng, p.observe_tokens.tokens(rng)))
        self._push(done + wait, agent)

    def _fork(self, now: float, parent: _Agent) -> None:
        p, rng = self.p, parent.rng
        self.counts["forks"] += 1
        n = rng.randint(*p.subagents)
        parent.waiting = n
        parent.join_at = now
        parent.summaries = b""
        for j in range(n):
            sub_rng = random.Random(f"{self.seed}:{parent.name}:{parent.turn}:{j}")
            ctx = parent.ctx.fork()
            ctx.append(_tokens(sub_rng, p.subagent_task_tokens.tokens(sub_rng)))
            sub = _Agent(f"{parent.name}.t{parent.turn}.{j}", parent.session, "sub", sub_rng, ctx,
                         self._least_loaded(), sub_rng.randint(*p.subagent_turns), event="fork",
                         parent=parent)
            self.counts["subagents"] += 1
            self.load[sub.instance] += 1  # counted now, so that siblings spread out
            self._push(now, sub)

    def _finish(self, now: float, agent: _Agent) -> None:
        self.load[agent.instance] -= 1
        parent = agent.parent
        if parent is None:
            return
        parent.summaries += _tokens(agent.rng, self.p.subagent_summary_tokens.tokens(agent.rng))
        parent.waiting -= 1
        parent.join_at = max(parent.join_at, now)
        if parent.waiting == 0:
            parent.ctx.append(parent.summaries)
            parent.event = "join"
            self._push(parent.join_at, parent)


def generate(params: WorkloadParams, page_tokens: int = 64, seed: int = 1) -> Workload:
    """The request stream for ``params``; identical for identical arguments."""
    return _Generator(params, page_tokens, seed).run()


def iter_agents(workload: Workload) -> Iterator[tuple[str, list[Request]]]:
    """Requests grouped by agent, in agent order of first appearance."""
    groups: dict[str, list[Request]] = {}
    for r in workload.requests:
        groups.setdefault(r.agent, []).append(r)
    yield from groups.items()
