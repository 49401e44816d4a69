"""A second process for the conformance suite: opens a connector and runs one op on pages.

``python -m hicache_l3.conformance.worker '<json>' [--ready] [--hold]``, the JSON made by
:func:`command`; ops: ``set`` (pattern pages), ``get`` (per key: hit with the pattern's
bytes), ``exists``, ``verify`` (per key ``"hit"``, ``"miss"`` or ``"wrong"``: True with
other bytes). Prints ``{"results": [...]}``. ``--ready`` prints ``ready`` right before the
op (a test may kill it in the op); ``--hold`` prints the results, then ``held``, and waits
with the connector open, never closing it (a test kills it there). The functions other
than :func:`main` run in the test's process.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Any

from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector, register_connector, registration


def command(name: str, settings: dict[str, Any], namespace: Namespace, op: str, keys: list[str],
            page_bytes: int) -> list[str]:
    """argv running ``op`` on ``keys`` with connector ``name`` in a new process; a connector
    registered in this process is registered there the same way, with this ``sys.path``."""
    spec = {"name": name, "namespace": namespace.fields() | {"tp_rank": namespace.tp_rank},
            "settings": settings, "op": op, "keys": keys, "page_bytes": page_bytes,
            "registration": dataclasses.asdict(registration(name)), "path": sys.path}
    return [sys.executable, "-m", "hicache_l3.conformance.worker", json.dumps(spec)]


def run(argv: list[str], timeout: float = 120) -> list[Any]:
    """Run :func:`command`'s ``argv`` to its end; its per-key results (asserts it succeeded)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"worker failed:\n{proc.stderr[-3000:]}"
    results: list[Any] = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    return results


def start_ready(argv: list[str]) -> subprocess.Popen[str]:
    """Start ``argv`` with ``--ready``; return once it is about to run its op."""
    proc = subprocess.Popen([*argv, "--ready"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # engines may log to stdout before it
        if line.strip() == "ready":
            return proc
        seen.append(line)
    raise AssertionError(f"worker did not start: {''.join(seen[-20:])!r}")


def start_held(argv: list[str]) -> tuple[subprocess.Popen[str], list[Any]]:
    """Run ``argv`` with ``--hold``: the process, still running with its connector open,
    and its per-key results."""
    proc = subprocess.Popen([*argv, "--hold"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        if line.strip() == "held" and seen and seen[-1].startswith("{"):
            results: list[Any] = json.loads(seen[-1])["results"]
            return proc, results
        seen.append(line.strip())
    proc.wait(timeout=60)
    raise AssertionError(f"worker did not hold: {seen[-20:]!r}")


def main(argv: list[str]) -> int:
    """Run the op described by ``argv[0]`` (JSON) and print the results."""
    from hicache_l3.conformance.pages import Pages

    spec = json.loads(argv[0])
    ready, hold = "--ready" in argv[1:], "--hold" in argv[1:]
    sys.path.extend(entry for entry in spec.get("path", []) if entry not in sys.path)
    reg = spec.get("registration")
    if reg:
        register_connector(spec["name"], reg["target"], reg["extra"], config=reg["config"], clobber=True)
    keys, op = spec["keys"], spec["op"]
    with open_connector(spec["name"], spec["namespace"], spec["settings"]) as conn:
        if ready and op != "set":
            print("ready", flush=True)
        if op == "exists":
            results: list[Any] = conn.batch_exists(keys)
        else:
            pages = Pages(conn, spec["page_bytes"], len(keys))
            if op == "set":
                pages.fill(keys)
                if ready:
                    print("ready", flush=True)
                results = conn.batch_set(keys, pages.pages)
            else:
                got = conn.batch_get(keys, pages.pages)
                exact = [pages.matches(i, k) for i, k in enumerate(keys)]
                if op == "verify":
                    results = ["miss" if not ok else "hit" if same else "wrong"
                               for ok, same in zip(got, exact)]
                    print(json.dumps({"results": results}))
                    return 0
                results = [ok and same for ok, same in zip(got, exact)]
        if hold:
            print(json.dumps({"results": results}), flush=True)
            print("held", flush=True)
            while True:  # never closes: the test kills this process here
                time.sleep(3600)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
