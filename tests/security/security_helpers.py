"""Helpers of the security tests: run a function as another uid in a forked child
(needs root, as CI runs the tests)."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

NOBODY = 65534  # throwaway uids: no files of theirs exist on a CI runner
STRANGER = 65533


def run_as(uid: int, fn: Callable[[], Any], umask: int = 0o022, timeout: float = 60.0) -> Any:
    """Run ``fn`` in a forked child as ``uid`` (gid the same, no supplementary groups) under
    ``umask``; return what it returns (JSON-able), or raise AssertionError with the child's
    traceback when it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_end)
            os.umask(umask)
            if os.geteuid() != uid:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            code = 1
        try:
            with os.fdopen(write_end, "w") as f:
                json.dump(out, f)
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    os.waitpid(pid, 0)
    result = json.loads(text) if text else {"error": "child died without a word", "trace": ""}
    if "error" in result:
        raise ChildError(result["error"], result["trace"])
    return result["ok"]


class ChildError(AssertionError):
    """What the child raised: ``kind_and_message`` and its traceback."""

    def __init__(self, kind_and_message: str, trace: str) -> None:
        super().__init__(f"{kind_and_message}\n{trace}")
        self.message = kind_and_message
