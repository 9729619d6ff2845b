"""An S3-compatible server for the tests: moto's, in a process of its own on 127.0.0.1, on a port the system picks.

It runs through a :class:`~potluck.procs.ProcessGroup`, so it is reaped whatever the test does; :meth:`S3Server.kill`
is a crash (SIGKILL), and :meth:`S3Server.start` again comes back on the same port with an empty store. The tests
look at the store with boto3, not fsspec: fsspec runs every store's calls on one event-loop thread, which an
uploader's progress callback may be holding. Tests skip (with the reason) where moto's server cannot start.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from potluck.local import wait_for
from potluck.procs import ProcessGroup

KEYS = {"AWS_ACCESS_KEY_ID": "potluck-test", "AWS_SECRET_ACCESS_KEY": "potluck-test", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    def __init__(self, procs: ProcessGroup, log: Path) -> None:
        pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
        pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'potluck[s3]')")
        self.procs, self.log, self.port = procs, log, 0
        self.proc: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment a process reaches this store with (what an operator sets for their own)."""
        return {**KEYS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc = self.procs.spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     self.log)

        def listening() -> int | None:
            if self.proc.poll() is not None:
                pytest.skip(f"moto's server did not start: {self.log.read_text()[offset:][-500:]}")
            found = re.search(r"Running on http://127\.0\.0\.1:(\d+)", self.log.read_text()[offset:])
            return int(found.group(1)) if found else None

        self.port = wait_for(listening, 60, "moto's server listening")
        wait_for(lambda: self._answers(), 30, "moto's server answering")

    def _answers(self) -> bool:
        try:
            self.client().list_buckets()
            return True
        except Exception:
            return False

    def kill(self) -> None:
        self.procs.kill(self.proc)

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix``: its name after the prefix, and its bytes."""
        c = self.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                try:
                    data = c.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                except c.exceptions.NoSuchKey:  # (removed since the listing: an uploader pruning)
                    continue
                out[obj["Key"][len(prefix):].lstrip("/")] = data
        return out

    def names(self, bucket: str, prefix: str = "") -> set[str]:
        c = self.client()
        out = set()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out |= {obj["Key"][len(prefix):].lstrip("/") for obj in page.get("Contents", [])}
        return out

