"""Hosts as containers: hicache-l3 in two runner containers (docker/runner.Dockerfile),
each in its own mount, PID and user namespaces, on host networking (loopback only).

* Mooncake: the two share pages through a ``mooncake_master`` in a third container; the
  writer holds the only segment, so its pages live in its process. A page it writes is a
  byte-exact hit in the reader; SIGKILLing the writer's container turns those pages into
  misses (never errors, never other bytes) within a bound of the master's client TTL.
* file and hf3fs (POSIX mode): the two share one bind-mounted directory (the stand-in for
  a shared 3FS/NFS mount) and see each other's pages, and a reader running while the
  other writes never sees a torn page (every hit is byte-exact).

Needs Docker (DOCKER_HOST; ``scripts/test-containers.sh`` starts a private dockerd):
these tests fail with that hint instead of skipping.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.engines import free_port
from hicache_l3.engines.containers import (
    LoopbackHttpWait,
    ManagedContainer,
    MooncakeContainers,
    build_image,
)

HERE = Path(__file__).resolve().parent
NAMESPACE = {"model": "containers-test", "kv_dtype": "bf16", "layout": "page_first", "page_size": 64}
PAGE = 16 << 10
CLIENT_TTL_S = 4  # the master's client_ttl for this module (default 10 s)
MISS_BOUND_S = 2 * CLIENT_TTL_S  # kill -> misses: the TTL, with at most 2x margin


class Host:
    """A runner container serving tests/containers/host_worker.py on a loopback port,
    in a user namespace of its own (``unshare``; Docker's default seccomp profile refuses
    that, hence ``seccomp=unconfined`` for these containers only)."""

    def __init__(self, name: str, shared: Path | None = None) -> None:
        self.port = free_port()
        volumes = [(str(HERE), "/tests", "ro")]
        if shared is not None:
            volumes.append((str(shared), "/shared", "rw"))
        self.container = ManagedContainer(
            build_image("runner"), name,
            ["unshare", "--user", "--map-root-user", "--fork",
             "python", "/tests/host_worker.py", str(self.port)],
            wait=LoopbackHttpWait(f"http://127.0.0.1:{self.port}/ready", 60.0),
            volumes=volumes, security_opt=["seccomp=unconfined"])

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> Any:
        """One request to the worker; raises AssertionError carrying its error."""
        data = json.dumps({"op": op, **kw}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/", data=data, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{self.container.name} {op}: {exc.read().decode()}") from None

    def stop(self) -> None:
        """Remove the container."""
        self.container.stop()


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def loopback_only(hex_addrs: list[str]) -> list[str]:
    """The listening addresses (as /proc/net/tcp* writes them) that are not loopback."""
    return [a for a in hex_addrs if a.rsplit(":", 1)[0] not in LOOPBACK_HEX]


def host_namespaces() -> dict[str, str]:
    return {n: os.readlink(f"/proc/self/ns/{n}") for n in ("mnt", "pid", "user")}


@pytest.fixture
def hosts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Factory of runner containers; every one is removed after the test."""
    made: list[Host] = []

    def make(name: str, shared: Path | None = None) -> Host:
        host = Host(name, shared)
        made.append(host)
        return host

    yield make
    for host in made:
        host.stop()


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeContainers]:
    """A master (with its metadata server) in a container; no segment holder."""
    with MooncakeContainers(holder=False, master_flags={"client_ttl": str(CLIENT_TTL_S)}) as eng:
        yield eng


def test_runners_are_separate_hosts(hosts: Any) -> None:
    a, b = hosts("runner-a"), hosts("runner-b")
    na, nb, mine = a.call("namespaces"), b.call("namespaces"), host_namespaces()
    for ns in ("mnt", "pid", "user"):
        assert len({na[ns], nb[ns], mine[ns]}) == 3, (ns, na, nb, mine)


def test_mooncake_pages_cross_containers_and_vanish_with_their_holder(
        hosts: Any, master: MooncakeContainers) -> None:
    writer, reader = hosts("writer"), hosts("reader")
    writer.call("open", connector="mooncake", namespace=NAMESPACE,
                settings={**master.settings, "global_segment_size": 64 << 20})
    reader.call("open", connector="mooncake", namespace=NAMESPACE,
                settings={**master.settings, "global_segment_size": 0})
    # The connectors' transfer engines (0.0.0.0/[::] in Mooncake) listen on loopback only:
    # the runner image preloads the loopback shim.
    for host in (writer, reader):
        listening = host.call("listeners")
        assert listening and not loopback_only(listening), listening
    keys = [f"page-{i:03d}" for i in range(16)]
    assert writer.call("set", keys=keys, page_bytes=PAGE)["results"] == [True] * 16
    assert reader.call("exists", keys=keys)["results"] == [True] * 16
    assert reader.call("get", keys=keys, page_bytes=PAGE)["results"] == [True] * 16
    # Pages that were never written stay misses next to the hits.
    assert reader.call("get", keys=[*keys[:2], "absent"], page_bytes=PAGE)["results"] == [True, True, False]

    writer.container.kill()
    killed = time.monotonic()
    while True:
        got = reader.call("get", keys=keys, page_bytes=PAGE)["results"]
        exists = reader.call("exists", keys=keys)["results"]
        assert None not in got, "a page read after its holder died had other bytes"
        assert all(isinstance(r, bool) for r in got + exists) and len(got) == len(exists) == 16
        if not any(got) and not any(exists):
            break
        assert time.monotonic() - killed < MISS_BOUND_S, (
            f"pages of a killed holder still there after {MISS_BOUND_S}s: get {got} exists {exists}")
        time.sleep(0.2)
    print(f"[containers] killed holder's pages were misses after {time.monotonic() - killed:.1f}s")


@pytest.mark.parametrize("connector", ["file", "hf3fs"])
def test_shared_directory_between_containers(hosts: Any, tmp_path: Path, connector: str) -> None:
    shared = tmp_path / "mount"
    shared.mkdir(mode=0o700)
    a, b = hosts("host-a", shared), hosts("host-b", shared)
    for n, host in enumerate((a, b)):
        settings: dict[str, Any] = {"root": "/shared/store"}
        if connector == "hf3fs":
            settings.update({"usrbio": "off", "capacity_bytes": "256MiB", "max_writers": 2,
                             "node_id": f"node-{n}", "node_locks": False, "rescan_s": 0.05})
        host.call("open", connector=connector, namespace=NAMESPACE, settings=settings)

    first = [f"a-{i:03d}" for i in range(16)]
    assert a.call("set", keys=first, page_bytes=PAGE)["results"] == [True] * 16
    assert b.call("get", keys=first, page_bytes=PAGE)["results"] == [True] * 16
    back = [f"b-{i:03d}" for i in range(16)]
    assert b.call("set", keys=back, page_bytes=PAGE)["results"] == [True] * 16
    assert a.call("get", keys=back, page_bytes=PAGE)["results"] == [True] * 16

    # b reads a's pages while a writes them: every hit exact, no torn page.
    racing = [f"r-{i:04d}" for i in range(256)]
    seen: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: seen.update(
        b.call("read_loop", keys=racing[-64:], page_bytes=PAGE, seconds=3.0)))
    reader.start()
    for lo in range(0, len(racing), 16):
        assert a.call("set", keys=racing[lo : lo + 16], page_bytes=PAGE)["results"] == [True] * 16
    reader.join(60)
    assert seen and seen["wrong"] == 0, seen
    assert b.call("get", keys=racing, page_bytes=PAGE)["results"] == [True] * 256
