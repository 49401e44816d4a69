"""The engines as containers: the same launchers as :mod:`hicache_l3.engines`,
with every engine process started from an image of ``docker/`` by testcontainers.

Images are built locally (no registry can be reached): ``docker/base.sh`` makes the
Debian base, then each image of :data:`IMAGES` is built ``--network host`` and tagged
``hicache-l3/NAME:HASH``, HASH covering its Dockerfile, its parent's tag and the checkout
files it copies, so an image is built once per content and reused by every later call of
the run. Needs a checkout (``docker/`` beside ``hicache_l3/``): from an installed wheel
every launcher here raises EngineUnavailableError saying so (:func:`docker_dir`).
Containers use host networking and the same 127.0.0.1 ports as the local launchers, so
connector settings and tests' backdoors are unchanged.

Needs ``DOCKER_HOST`` (``scripts/dockerd.sh start``), the ``testcontainers`` package (test
extra) and ``TESTCONTAINERS_RYUK_DISABLED=true`` (set here: Ryuk's image cannot be pulled);
every container started here is removed by its engine's ``stop`` and, as a last resort, by
:func:`remove_all` (label ``hicache-l3.session``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines import ENGINES, Engine, MooncakeEngine, S3Engine

# The checkout's root when this package runs from one (``docker/`` is looked for there).
REPO = Path(__file__).resolve().parents[2]
LABEL = "hicache-l3.session"
SESSION = f"{os.getpid()}-{int(time.time())}"


@dataclass(frozen=True)
class Image:
    """One image of ``docker/``: its Dockerfile, the build argument naming its parent
    (``BASE`` for the debootstrap base) and the checkout files it copies (the build
    context is then the repository root, and they are part of the image's hash)."""

    dockerfile: str
    parent_arg: str
    parent: str | None  # None: the base made by docker/base.sh
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
    """The checkout's ``docker/`` directory; EngineUnavailableError when this package does
    not run from a checkout (an installed wheel has no ``docker/``, and the ``docker`` next to
    an installed package is the Docker SDK's, hence the check for ``docker/base.sh``)."""
    path = REPO / "docker"
    if not (path / "base.sh").is_file():
        raise EngineUnavailableError(
            f"container engines need a checkout of hicache-l3 ({path / 'base.sh'} not found next "
            "to the package); run from the repository or use --engines=local")
    return path


def _docker() -> Any:
    """The docker SDK client on ``DOCKER_HOST`` (testcontainers'; one per process);
    EngineUnavailableError naming what is missing."""
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
    """The wait strategy for a host-networked container: poll a fixed loopback URL (the
    stock HttpWaitStrategy asks Docker for a published port, which host networking has
    not), failing fast with the container's logs when it exits."""

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
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    container.reload()
                    if container.status not in ("created", "running"):
                        raise EngineUnavailableError(f"container exited before {url} answered")
                    with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=1.0):
                        return
                    time.sleep(0.1)
                raise EngineUnavailableError(f"{url} did not answer within {timeout:.0f}s")

        return _Wait(0)


# Every container started and not yet removed (for logs on test failure and the last sweep).
LIVE: list[ManagedContainer] = []
# (name, image, short id) of every container started by this process, for the run's log.
STARTED: list[tuple[str, str, str]] = []


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
            logs = self.logs()
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

    def logs(self, n: int = 60) -> str:
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
    """Remove every container of this session still present (the sweep after a run);
    returns how many there were."""
    for managed in list(LIVE):
        managed.stop()
    if not os.environ.get("DOCKER_HOST"):
        return 0
    leftovers = _docker().containers.list(all=True, filters={"label": f"{LABEL}={SESSION}"})
    for container in leftovers:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    return len(leftovers)


class MooncakeContainers(MooncakeEngine):
    """:class:`MooncakeEngine` with its processes in containers: the loopback metadata
    server and ``mooncake_master`` (image ``mooncake-master``) and the ``mooncake_client``
    segment holder (image ``mooncake-client``, the loopback shim preloaded), on the same
    loopback ports; the fault helpers kill and restart containers."""

    name = "mooncake"

    def __init__(self, holder: bool = True, segment_size: str = "1 GB",
                 master_flags: dict[str, str] | None = None) -> None:
        super().__init__(holder=holder, segment_size=segment_size, master_flags=master_flags)
        self.metadata_container: ManagedContainer | None = None
        self.master_container: ManagedContainer | None = None
        self.holder_container: ManagedContainer | None = None

    def start(self) -> MooncakeContainers:
        """Build the images if needed, start the metadata server, the master (and the
        holder), wait for each to answer (the holder: its segment mounted)."""
        self.metadata_container = ManagedContainer(
            build_image("mooncake-master"), "metadata_server",
            ["/opt/hicache-l3/mooncake_metadata.py", "--host=127.0.0.1", f"--port={self.http_port}"],
            wait=LoopbackHttpWait(f"http://127.0.0.1:{self.http_port}/health", 30.0),
            entrypoint=["python3"])
        self.start_master()
        if self.holder:
            self.holder_container = ManagedContainer(
                build_image("mooncake-client"), "mooncake_client", [
                    f"--global_segment_size={self.segment_size}",
                    f"--master_server_address={self.master_address}",
                    f"--metadata_server={self.metadata_server}",
                    f"--port={self.holder_port}",
                ])
            try:
                self.wait_capacity(1, timeout=30.0)
            except EngineUnavailableError as exc:
                raise EngineUnavailableError(
                    f"{exc}\n--- mooncake_client logs ---\n{self.holder_container.logs()}") from None
        return self

    def start_master(self) -> None:
        """Start the master container on this engine's ports and wait for ``/health``."""
        self.master_container = ManagedContainer(
            build_image("mooncake-master"), "mooncake_master", [
                f"--rpc_port={self.rpc_port}", f"--metrics_port={self.metrics_port}",
                *(f"--{k}={v}" for k, v in self.master_flags.items()),
            ], wait=LoopbackHttpWait(self.metrics_url + "/health", 30.0))

    def kill_master(self) -> None:
        """SIGKILL the master's container and remove it."""
        if self.master_container is not None:
            self.master_container.kill()
            self.master_container.stop()
            self.master_container = None

    def restart_master(self) -> None:
        """Start a new master container on the same ports (its index starts empty)."""
        if self.master_container is None:
            self.start_master()

    def kill_holder(self) -> None:
        """SIGKILL the holder's container."""
        if self.holder_container is not None:
            self.holder_container.kill()

    def containers(self) -> list[ManagedContainer]:
        """This engine's containers that are not removed yet."""
        return [c for c in (self.metadata_container, self.master_container, self.holder_container)
                if c is not None]

    def stop(self) -> None:
        """Remove the holder, master and metadata containers, then the work directory."""
        for managed in reversed(self.containers()):
            managed.stop()
        self.metadata_container = self.master_container = self.holder_container = None
        super().stop()


class S3Containers(S3Engine):
    """:class:`S3Engine` with ``moto_server`` in a container (image ``s3``) on the same
    loopback port; the bucket is created from here through boto3."""

    name = "s3"

    def __init__(self, bucket: str = "hicache-l3") -> None:
        super().__init__(bucket=bucket)
        self.server: ManagedContainer | None = None

    def start(self) -> S3Containers:
        """Build the image if needed, start moto_server, wait until it answers, create the bucket."""
        self.server = ManagedContainer(build_image("s3"), "moto_server", ["-p", str(self.port)],
                                       wait=LoopbackHttpWait(f"{self.endpoint}/moto-api/", 60.0))
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        """Remove the server's container, then the work directory."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        super().stop()


# name -> container launcher; same names and constructor arguments as ENGINES.
CONTAINER_ENGINES: dict[str, type[Engine]] = {
    "mooncake": MooncakeContainers,
    "s3": S3Containers,
}


def engine_class(name: str, mode: str) -> type[Engine]:
    """The launcher of engine ``name`` in ``mode`` (``local``: processes, ``containers``).
    Containers from an installed wheel: EngineUnavailableError (:func:`docker_dir`)."""
    if mode not in ("local", "containers"):
        raise ValueError(f"engines mode must be 'local' or 'containers', not {mode!r}")
    table = ENGINES if mode == "local" else CONTAINER_ENGINES
    if name not in table:
        raise ValueError(f"no {mode} launcher for engine {name!r}; choose one of {sorted(table)}")
    if mode == "containers":
        docker_dir()
    return table[name]


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache_l3.engines.containers build [NAME...]``: build the images (all by
    default) and print their tags, so a run's log shows what it built and how long it took."""
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
        print(f"[containers] {build_image(name)} ready ({time.monotonic() - started:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
