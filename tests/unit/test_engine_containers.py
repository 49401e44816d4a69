"""The container launchers outside a checkout (an installed wheel: no ``docker/`` beside the
package) fail with an EngineUnavailableError that names what is missing and what to do,
before any Docker call; local engines need no checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines import MooncakeEngine, containers

NO_CHECKOUT = (r"container engines need a checkout of hicache-l3 \(.*docker/base\.sh not found next "
               r"to the package\); run from the repository or use --engines=local")


@pytest.fixture
def wheel_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``containers`` as it runs from site-packages, whose ``docker/`` is the Docker SDK's."""
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "__init__.py").write_text("")
    monkeypatch.setattr(containers, "REPO", tmp_path)
    monkeypatch.setattr(containers, "_built", {})
    monkeypatch.delenv("DOCKER_HOST", raising=False)  # a Docker call would fail otherwise
    return tmp_path


@pytest.mark.parametrize("engine", sorted(containers.CONTAINER_ENGINES))
def test_choosing_a_container_engine_says_a_checkout_is_needed(wheel_install: Path, engine: str) -> None:
    with pytest.raises(EngineUnavailableError, match=NO_CHECKOUT):
        containers.engine_class(engine, "containers")


@pytest.mark.parametrize("image", sorted(containers.IMAGES))
def test_building_an_image_says_so_too(wheel_install: Path, image: str) -> None:
    with pytest.raises(EngineUnavailableError, match=NO_CHECKOUT):
        containers.build_image(image)


def test_starting_a_container_engine_says_so_and_leaves_nothing(wheel_install: Path) -> None:
    engine = containers.MooncakeContainers(holder=False)
    with pytest.raises(EngineUnavailableError, match=NO_CHECKOUT), engine:
        pass
    assert not engine.workdir.exists()


def test_local_engines_need_no_checkout(wheel_install: Path) -> None:
    assert containers.engine_class("mooncake", "local") is MooncakeEngine


def test_a_checkout_has_its_docker_dir() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert repo == containers.REPO
    assert containers.docker_dir() == repo / "docker"


def test_the_build_command_says_so_and_exits_2(wheel_install: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert containers.main(["build"]) == 2
    assert "container engines need a checkout" in capsys.readouterr().err
