"""The local S3 launcher: ``moto_server`` on loopback with one bucket."""

from __future__ import annotations

from typing import Any

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines.base import Engine, find_executable, free_port, wait_http


class S3Engine(Engine):
    """A local S3 server: ``moto_server`` (``moto[server]``) on a free loopback port with one
    bucket; :attr:`settings` open the nixl connector in OBJ mode on it, :meth:`client` is a
    boto3 client on it (tests' backdoors)."""

    name = "s3"

    def __init__(self, bucket: str = "hicache-l3") -> None:
        super().__init__()
        self.bucket = bucket
        self.port = free_port()
        self.access_key = "hicache-test-key"
        self.secret_key = "hicache-test-secret"

    @property
    def endpoint(self) -> str:
        """The server's URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> dict[str, Any]:
        """nixl connector settings (OBJ mode) reaching this server's bucket."""
        return {
            "mode": "obj", "endpoint": self.endpoint, "bucket": self.bucket,
            "region": "us-east-1", "scheme": "http", "virtual_addressing": False,
            "access_key": self.access_key, "secret_key": self.secret_key,
        }

    def client(self) -> Any:
        """A boto3 S3 client on this server (boto3 comes with ``moto[server]``)."""
        try:
            import boto3
        except ImportError as exc:
            raise EngineUnavailableError("the s3 engine needs boto3: pip install 'moto[server]'") from exc
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        )

    def start(self) -> S3Engine:
        """Start moto_server, wait until it answers, create the bucket."""
        self._run_server()
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def _run_server(self) -> None:
        proc = self.spawn([find_executable("moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                          "moto_server")
        wait_http(f"{self.endpoint}/moto-api/", timeout=30.0, proc=proc)

