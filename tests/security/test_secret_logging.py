"""With the root logger at DEBUG, botocore prints the access key id and the session token
of every signed request; the bench, the replay and the test suite raise botocore's logger
to INFO so that nothing of them reaches a log."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import pytest

from hicache_l3.common.logs import quiet_credential_loggers
from hicache_l3.engines import S3Engine

KEY_ID = "AKIDHICACHETESTKEY01"
TOKEN = "SESSIONTOKEN-hicache-l3-do-not-log"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Engine]:
    with S3Engine() as engine:
        yield engine


def logged_secrets(s3: S3Engine, caplog: pytest.LogCaptureFixture) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                          aws_access_key_id=KEY_ID, aws_secret_access_key="secret",
                          aws_session_token=TOKEN)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        client.list_objects_v2(Bucket=s3.bucket)
    return [f"{r.name}: {r.getMessage()[:120]}" for r in caplog.records
            if KEY_ID in r.getMessage() or TOKEN in r.getMessage()]


def test_botocore_quieted_logs_no_credentials(s3: S3Engine, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    botocore_log = logging.getLogger("botocore")
    monkeypatch.setattr(botocore_log, "level", logging.NOTSET)  # as an application leaves it
    assert logged_secrets(s3, caplog), "botocore no longer logs credentials: the guard is moot"
    quiet_credential_loggers()
    assert botocore_log.level == logging.INFO
    assert logged_secrets(s3, caplog) == []


def test_quieting_never_lowers_a_level(monkeypatch: pytest.MonkeyPatch) -> None:
    botocore_log = logging.getLogger("botocore")
    monkeypatch.setattr(botocore_log, "level", logging.ERROR)
    quiet_credential_loggers()
    assert botocore_log.level == logging.ERROR


def test_bench_quiets_botocore_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_l3.bench import cli

    botocore_log = logging.getLogger("botocore")
    monkeypatch.setattr(botocore_log, "level", logging.NOTSET)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--reps", "0"])) == 2  # refused, after quieting
    assert botocore_log.level == logging.INFO


def test_the_test_suite_runs_with_botocore_quiet() -> None:
    """The conformance plugin (pytest11 entry point) quiets botocore at configure time."""
    assert logging.getLogger("botocore").level >= logging.INFO
