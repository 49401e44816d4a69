"""The engines as containers: the launchers of :mod:`hicache_l3.engines` with every engine
process in a container (testcontainers), built from a checkout's ``docker/``; from an
installed wheel every launcher here raises EngineUnavailableError saying so.

Images are built locally, tagged by a hash of their Dockerfile, parent and copied files,
and reused. Containers use host networking and the local launchers' 127.0.0.1 ports.
Needs ``DOCKER_HOST`` (``scripts/dockerd.sh start``) and ``testcontainers``; every
container is removed by its engine's ``stop`` or, at the latest, by :func:`remove_all`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines import ENGINES, Engine, MooncakeEngine, S3Engine
from hicache_l3.engines.base import answers, wait_until

# The checkout's root when this package runs from one (``docker/`` is looked for there).
REPO = Path(__file__).resolve().parents[2]
LABEL = "hicache-l3.session"
SESSION = f"{os.getpid()}-{int(time.time())}"


@dataclass(frozen=True)
class Image:
    """One image of ``docker/``: its Dockerfile, the build argument naming its parent image,
    the parent (None: the base of docker/base.sh) and the checkout files it copies (then
    the build context is the repository root)."""

    dockerfile: str
    parent_arg: str
    parent: str | None
    sources: tuple[str, ...] = ()


IMAGES: dict[str, Image] = {
    "mooncake-master": Image("mooncake-master.Dockerfile", "BASE", None,
                             ("hicache_l3/engines/mooncake_metadata.py",
                              "hicache_l3/engines/loopback_bind.c")),
    "mooncake-client": Image("mooncake-client.Dockerfile", "MOONCAKE_MASTER", "mooncake-master"),
    "s3": Image("s3.Dockerfile", "BASE", None),
    "runner": Image("runner.Dockerfile", "MOONCAKE_MASTER", "mooncake-master",
                    ("pyproject.toml", "README.md", "hicache_l3")),
}
_built: dict[str, str] = {}
_clients: dict[str, Any] = {}


def docker_dir() -> Path:
    """The checkout's ``docker/`` directory; EngineUnavailableError outside a checkout (in
    site-packages, ``docker/`` is the Docker SDK's: hence the check for ``base.sh``)."""
    path = REPO / "docker"
    if not (path / "base.sh").is_file():
        raise EngineUnavailableError(
            f"container engines need a checkout of hicache-l3 ({path / 'base.sh'} not found next "
            "to the package); run from the repository or use --engines=local")
    return path


def _docker() -> Any:
    """The docker SDK client on ``DOCKER_HOST`` (one per process); EngineUnavailableError
    naming what is missing. Disables Ryuk, whose image cannot be pulled."""
    if "client" in _clients:
        return _clients["client"]
    if not os.environ.get("DOCKER_HOST"):
        raise EngineUnavailableError(
            "container engines need DOCKER_HOST (start one with scripts/dockerd.sh start DIR)")
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    try:
        from testcontainers.core.docker_client import DockerClient
    except ImportError as exc:
        raise EngineUnavailableError("container engines need testcontainers: pip install "
                                     "'hicache-l3[test]'") from exc
    _clients["client"] = DockerClient().client
    return _clients["client"]


def _sources_digest(sources: tuple[str, ...]) -> bytes:
    """Digest of checkout files and directories (as .dockerignore lets them through)."""
    h = hashlib.sha256()
    for source in sources:
        top = REPO / source
        for path in [top, *sorted(top.rglob("*"))] if top.is_dir() else [top]:
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".so":
                continue
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.digest()


def base_image() -> str:
    """The debootstrap base (``docker/base.sh``, cached by its own hash)."""
    if "base" not in _built:
        done = subprocess.run(["bash", str(docker_dir() / "base.sh")], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise EngineUnavailableError(f"docker/base.sh failed:\n{done.stderr[-3000:]}")
        _built["base"] = done.stdout.strip().splitlines()[-1]
    return _built["base"]


def build_image(name: str) -> str:
    """Tag of image ``name`` of :data:`IMAGES`, built (with its parents) unless an image of
    the same content hash exists already."""
    if name in _built:
        return _built[name]
    spec = IMAGES[name]
    dockerfile = docker_dir() / spec.dockerfile
    if not dockerfile.is_file():
        raise EngineUnavailableError(f"{dockerfile} not found: the checkout lacks image {name!r}")
    parent = base_image() if spec.parent is None else build_image(spec.parent)
    h = hashlib.sha256(dockerfile.read_bytes() + parent.encode())
    h.update(_sources_digest(spec.sources))
    tag = f"hicache-l3/{name}:{h.hexdigest()[:16]}"
    client = _docker()
    try:
        client.images.get(tag)
    except Exception:
        started = time.monotonic()
        context = REPO if spec.sources else dockerfile.parent
        try:
            client.images.build(path=str(context), dockerfile=str(dockerfile), tag=tag,
                                buildargs={spec.parent_arg: parent}, network_mode="host",
                                rm=True, forcerm=True)
        except Exception as exc:
            raise EngineUnavailableError(f"building {tag} from docker/{spec.dockerfile} failed: "
                                         f"{exc}") from exc
        print(f"[containers] built {tag} in {time.monotonic() - started:.0f}s", flush=True)
    _built[name] = tag
    return tag


class LoopbackHttpWait:
    """Wait for a host-networked container by polling a loopback URL (HttpWaitStrategy wants a
    published port); fails at once when the container exits."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout

    def strategy(self) -> Any:
        """A testcontainers ``WaitStrategy`` for this URL."""
        from testcontainers.core.wait_strategies import HttpWaitStrategy

        url, timeout = self.url, self.timeout

        class _Wait(HttpWaitStrategy):
            def _build_url(self, container: Any) -> str:
                return url

            def wait_until_ready(self, container: Any) -> None:
                def ready() -> bool:
                    container.reload()
                    if container.status not in ("created", "running"):
                        raise EngineUnavailableError(f"container exited before {url} answered")
                    return answers(url)

                wait_until(ready, timeout, f"{url} to answer", interval=0.1)

        return _Wait(0)


LIVE: list[ManagedContainer] = []  # started, not yet removed
STARTED: list[tuple[str, str, str]] = []  # (name, image, short id) of every container started


class ManagedContainer:
    """One container of an engine, started by testcontainers with host networking and the
    session label; :meth:`stop` removes it (idempotent)."""

    def __init__(self, image: str, name: str, command: list[str],
                 wait: LoopbackHttpWait | None = None, env: dict[str, str] | None = None,
                 volumes: list[tuple[str, str, str]] | None = None, **kwargs: Any) -> None:
        _docker()  # first: DOCKER_HOST check, and Ryuk disabled before testcontainers loads
        from testcontainers.core.container import DockerContainer

        self.name = name
        self.container = DockerContainer(image, env=env, volumes=volumes, network_mode="host",
                                         labels={LABEL: SESSION, "hicache-l3.engine": name},
                                         **kwargs).with_command(command)
        if wait is not None:
            self.container.waiting_for(wait.strategy())
        LIVE.append(self)
        try:
            self.container.start()
            STARTED.append((name, image, self.container.get_wrapped_container().short_id))
        except Exception as exc:
            logs = self.tail()
            self.stop()
            raise EngineUnavailableError(f"container {name} ({image}) did not start: {exc}\n"
                                         f"--- {name} logs ---\n{logs}") from None

    def alive(self) -> bool:
        """True while the container runs."""
        try:
            self.container.reload()
            return bool(self.container.status == "running")
        except Exception:
            return False

    def kill(self) -> None:
        """SIGKILL the container's processes (the container stays, stopped, until :meth:`stop`)."""
        with contextlib.suppress(Exception):
            self.container.get_wrapped_container().kill()
            self.container.get_wrapped_container().wait(timeout=20)

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the container's output."""
        try:
            out, err = self.container.get_logs()
        except Exception as exc:
            return f"(no logs: {exc})"
        lines = (out + err).decode(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Remove the container (forced)."""
        with contextlib.suppress(Exception):
            self.container.stop()
        if self in LIVE:
            LIVE.remove(self)


def remove_all() -> int:
    """Remove every container of this session still present; how many there were."""
    for managed in list(LIVE):
        managed.stop()
    if not os.environ.get("DOCKER_HOST"):
        return 0
    leftovers = _docker().containers.list(all=True, filters={"label": f"{LABEL}={SESSION}"})
    for container in leftovers:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    return len(leftovers)


def _start(engine: Engine, image: str, name: str, command: list[str], health: str | None = None,
           timeout: float = 30.0, **kwargs: Any) -> ManagedContainer:
    """Start a container of ``engine`` (waiting for URL ``health`` to answer) and track it."""
    wait = None if health is None else LoopbackHttpWait(health, timeout)
    managed = ManagedContainer(build_image(image), name, command, wait=wait, **kwargs)
    engine.processes.append(managed)
    return managed


class MooncakeContainers(MooncakeEngine):
    """:class:`MooncakeEngine` with metadata server, master and holder in containers, on the
    same loopback ports; the fault helpers kill and restart containers."""

    start_timeout = 30.0

    def __init__(self, holder: bool = True, segment_size: str = "1 GB",
                 master_flags: dict[str, str] | None = None) -> None:
        super().__init__(holder=holder, segment_size=segment_size, master_flags=master_flags)
        self._own_metadata = True  # the image's; its master's is off

    def _run_metadata(self) -> ManagedContainer:
        command = ["/opt/hicache-l3/mooncake_metadata.py", "--host=127.0.0.1", f"--port={self.http_port}"]
        return _start(self, "mooncake-master", "metadata_server", command,
                      f"http://127.0.0.1:{self.http_port}/health", entrypoint=["python3"])

    def _run_master(self) -> ManagedContainer:
        return _start(self, "mooncake-master", "mooncake_master",
                      [f"--rpc_port={self.rpc_port}", f"--metrics_port={self.metrics_port}",
                       *(f"--{k}={v}" for k, v in self.master_flags.items())], self.metrics_url + "/health")

    def _run_holder(self) -> ManagedContainer:
        return _start(self, "mooncake-client", "mooncake_client", self._holder_args())


class S3Containers(S3Engine):
    """:class:`S3Engine` with ``moto_server`` in a container, on the same loopback port."""

    def _run_server(self) -> None:
        _start(self, "s3", "moto_server", ["-p", str(self.port)], f"{self.endpoint}/moto-api/", 60.0)


# same names and constructor arguments as ENGINES
CONTAINER_ENGINES: dict[str, type[Engine]] = {
    "mooncake": MooncakeContainers,
    "s3": S3Containers,
}


def engine_class(name: str, mode: str) -> type[Engine]:
    """The launcher of engine ``name`` in ``mode`` (``local`` or ``containers``); ValueError
    for an unknown one, EngineUnavailableError for containers outside a checkout."""
    if mode not in ("local", "containers"):
        raise ValueError(f"engines mode must be 'local' or 'containers', not {mode!r}")
    table = ENGINES if mode == "local" else CONTAINER_ENGINES
    if name not in table:
        raise ValueError(f"no {mode} launcher for engine {name!r}; choose one of {sorted(table)}")
    if mode == "containers":
        docker_dir()
    return table[name]


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache_l3.engines.containers build [NAME...]``: build the images (default
    all) and print their tags; exit 2 with the reason when they cannot be built."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("action", choices=["build"])
    parser.add_argument("names", nargs="*", help="images to build: " + ", ".join(IMAGES))
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in IMAGES]
    if unknown:
        parser.error(f"unknown image(s) {', '.join(unknown)}; choose from {', '.join(IMAGES)}")
    for name in args.names or list(IMAGES):
        started = time.monotonic()
        try:
            tag = build_image(name)
        except EngineUnavailableError as exc:
            print(f"[containers] {exc}", file=sys.stderr)
            return 2
        print(f"[containers] {tag} ready ({time.monotonic() - started:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
