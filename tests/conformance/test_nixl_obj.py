"""The conformance suite on the nixl connector in obj mode: NIXL's real OBJ plugin
against a local S3 server (``moto_server``, started by the fixture; never skipped).

The backdoor reads and damages objects with boto3 on the same server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance.plugin import engine_launcher
from hicache_l3.engines import S3Engine


@pytest.fixture(scope="module")
def s3(request: pytest.FixtureRequest) -> Iterator[S3Engine]:
    """The S3 server for the module (a process or a container: --engines)."""
    with engine_launcher(request.config, "s3")() as engine:
        yield engine


def object_key(settings: dict[str, Any], namespace: Namespace, key: str) -> str:
    """Where the connector keeps page ``key`` (default prefix)."""
    return f"{settings.get('prefix', 'hicache-l3/')}{namespace.digest()}/d/{key}"


class TestNixlObj(ConnectorTests):
    stateful_kills = True
    connector_name = "nixl"
    # Every page is an object: 4096 of them are 16k round trips to moto (~100 s); 1024 are
    # still four transfer rounds of obj.CHUNK pages.
    large_batch = 1024

    @pytest.fixture
    def settings(self, s3: S3Engine) -> dict[str, Any]:
        return {**s3.settings, "capacity_bytes": "1GiB"}

    @pytest.fixture
    def client(self, s3: S3Engine) -> Any:
        return s3.client()

    def _client(self, settings: dict[str, Any]) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=settings["endpoint"], region_name="us-east-1",
                            aws_access_key_id=settings["access_key"],
                            aws_secret_access_key=settings["secret_key"])

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        client = self._client(settings)
        try:
            obj = client.get_object(Bucket=settings["bucket"], Key=object_key(settings, namespace, key))
        except client.exceptions.NoSuchKey:
            return None
        data: bytes = obj["Body"].read()
        return data

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str,
                         how: str) -> None:
        data = bytearray(self.backdoor_read(settings, namespace, key) or b"")
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) - 100]
        self._client(settings).put_object(Bucket=settings["bucket"],
                                          Key=object_key(settings, namespace, key), Body=bytes(data))

    def backdoor_write(self, settings: dict[str, Any], namespace: Namespace, key: str,
                       stored: bytes) -> None:
        from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
        from hicache_l3.slab.format import encode_start

        client, name = self._client(settings), object_key(settings, namespace, key)
        record = encode_start(0, len(stored), buffer_checksum([stored]), key_fingerprint(key))
        client.put_object(Bucket=settings["bucket"], Key=name, Body=stored)
        client.put_object(Bucket=settings["bucket"], Key=name.replace("/d/", "/h/"), Body=record)

    def eviction_settings(self, settings: dict[str, Any], capacity_pages: int) -> dict[str, Any]:
        return {**settings, "capacity_bytes": capacity_pages * self.page_bytes}


def test_compression_needs_the_commit_record() -> None:
    from hicache_l3.common.errors import ConfigError
    from hicache_l3.connectors.nixl.base import NixlConfig
    from hicache_l3.connectors.nixl.obj import NixlObjConnector

    config = NixlConfig.load("nixl", {"mode": "obj", "bucket": "b", "endpoint": "http://127.0.0.1:9",
                                      "compression": "zstd", "checksum": "none"})
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
    with pytest.raises(ConfigError, match="compression=zstd needs checksum"):
        NixlObjConnector(config, ns)
