"""Where a run's shards come from: a local folder, a ``file://`` URL, or an ``http(s)://`` base URL.

    >>> root = resolve("https://example.org/corpus/", expect_index_sha256=manifest_sha)
    >>> shards = ShardSet.open(root)

A base URL serves the prepared folder as is (``index.json``, ``train/00000.bin``, ...). Its files are
downloaded into a cache folder, each one resumable: bytes go to ``FILE.<sha>.part``, a dropped
connection or a later run resumes with an HTTP ``Range`` request, and only a file whose sha256 equals
the index's is renamed into place, so a file present under its own name is a verified one. Nothing
is ever served from a file that failed its check, and nothing falls back silently: a missing file,
a corrupt one or another data set is a :class:`DataError` saying which.

With ``expect_index_sha256`` (the run's manifest has it) a complete cache answers without touching
the network; without it, the index is fetched again (one small request) and only changed files move.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse
from urllib.request import Request, url2pathname, urlopen

from potluck.data import DataError
from potluck.data.shards import DOCS_DTYPE, INDEX, ShardSet, parse_index, sha256_file

RETRIES = 5  # attempts in a row that bring no new byte; one that does resets the count
BACKOFF_S = 0.5  # then 1, 2, 4, 8 s
TIMEOUT_S = 30.0
BLOCK = 1 << 20
VERIFIED = ".verified.json"  # file -> sha256 of what was checked and renamed into place


def default_cache(url: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return base / "potluck" / "shards" / hashlib.sha256(url.encode()).hexdigest()[:16]


def resolve(location: str, cache_dir: Path | None = None, *, expect_index_sha256: str = "") -> Path:
    """The local folder holding the shards at ``location``, downloading them first for an http(s) URL.

    Every split's files are checked for presence and size; ``expect_index_sha256``, when given, must be
    the sha256 of the index found there.
    """
    parsed = urlparse(location)
    if parsed.scheme in ("http", "https"):
        base = location.removesuffix(INDEX).rstrip("/") + "/"
        root = _download(base, Path(cache_dir) if cache_dir else default_cache(base), expect_index_sha256)
    elif parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise DataError(f"{location}: a file:// URL names a folder on this machine (file:///path/to/shards)")
        root = Path(url2pathname(parsed.path))
    elif parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive
        raise DataError(f"{location}: shards come from a folder, a file:// URL or an http(s):// URL, not "
                        f"{parsed.scheme}://")
    else:
        root = Path(location).expanduser()
    _check(root, location, expect_index_sha256)
    return root


def _check(root: Path, location: str, expect: str) -> None:
    try:
        raw = (root / INDEX).read_bytes()
    except FileNotFoundError:
        raise DataError(f"no {INDEX} in {root}: {location} is not a prepared shard folder (potluck data "
                        "prepare writes one)") from None
    _expect(raw, location, expect)
    for split in parse_index(raw, str(root / INDEX))["splits"]:
        ShardSet.open(root, split, verify="size")


def _expect(raw: bytes, location: str, expect: str) -> None:
    digest = hashlib.sha256(raw).hexdigest()
    if expect and digest != expect:
        raise DataError(f"the shards at {location} are not this run's data: index sha256 {digest}, the run's is "
                        f"{expect}")


def _download(base: str, cache: Path, expect: str) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    cached = cache / INDEX
    if expect and cached.is_file() and sha256_file(cached) == expect:
        raw = cached.read_bytes()
    else:
        raw = _get(base + INDEX)
        _expect(raw, base, expect)
    index = parse_index(raw, base + INDEX)
    itemsize = 2 if index["dtype"] == "uint16" else 4
    verified = _read_verified(cache)
    wanted = set()
    for split in index["splits"].values():
        for s in split["shards"]:
            for name, size, sha in ((s["file"], int(s["tokens"]) * itemsize, s["sha256"]),
                                    (s["docs_file"], int(s["documents"]) * DOCS_DTYPE.itemsize, s["docs_sha256"])):
                wanted.add(name)
                dest = cache / name
                if verified.get(name) == sha and dest.is_file() and dest.stat().st_size == size:
                    continue
                download_file(base + name, dest, size, sha)
                verified[name] = sha
                _write(cache / VERIFIED, json.dumps(verified, sort_keys=True).encode())
    for path in [p for d in ("train", "eval") if (cache / d).is_dir() for p in (cache / d).iterdir()]:
        if f"{path.parent.name}/{path.name}" not in wanted and not path.name.endswith(".part"):
            path.unlink()  # a file of an older index of this URL
    if not cached.is_file() or cached.read_bytes() != raw:
        _write(cached, raw)  # last: an index in the cache means its files were all in place once
    return cache


def _read_verified(cache: Path) -> dict[str, str]:
    try:
        data = json.loads((cache / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write(path: Path, raw: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)


def _get(url: str) -> bytes:
    """A small file (the index), whole, with the same retries as a shard."""
    failures = 0
    while True:
        try:
            with urlopen(Request(url), timeout=TIMEOUT_S) as resp:
                return bytes(resp.read())
        except HTTPError as err:
            if err.code < 500:
                raise DataError(f"{url}: HTTP {err.code} {err.reason}; is this the base URL of a prepared shard "
                                "folder?") from None
            failures = _failed(url, failures, err)
        except (URLError, OSError, http.client.HTTPException) as err:
            failures = _failed(url, failures, err)


def _failed(url: str, failures: int, err: BaseException) -> int:
    failures += 1
    if failures > RETRIES:
        raise DataError(f"cannot download {url}: {err} ({failures} tries); check the address and the network, then "
                        "run again (finished files are kept)")
    time.sleep(BACKOFF_S * 2 ** (failures - 1))
    return failures


def download_file(url: str, dest: Path, size: int, sha256: str) -> None:
    """Fetch ``url`` to ``dest`` (``size`` bytes, ``sha256``): resumed by ``Range`` requests, checked, renamed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f"{dest.name}.{sha256[:16]}.part")  # another index's partial file never mixes in
    failures = 0
    while (have := part.stat().st_size if part.exists() else 0) < size:
        try:
            with urlopen(Request(url, headers={"Range": f"bytes={have}-"} if have else {}), timeout=TIMEOUT_S) as resp:
                resumed = have and resp.status == 206 and resp.headers.get("Content-Range", "").startswith(
                    f"bytes {have}-")
                with open(part, "ab" if resumed else "wb") as f:  # a server that ignored the range: start over
                    while block := resp.read(BLOCK):
                        f.write(block)
        except HTTPError as err:
            if err.code == 404:
                raise DataError(f"{url} is missing on the server (404): the shard folder there is incomplete; "
                                "ask its operator, or prepare the data yourself") from None
            if err.code == 416:  # our partial file is no prefix of theirs
                part.unlink(missing_ok=True)
            elif err.code < 500:
                raise DataError(f"{url}: HTTP {err.code} {err.reason}") from None
            failures = _failed(url, failures, err)
            continue
        except (URLError, OSError, http.client.HTTPException) as err:  # a dropped connection: resume below
            grew = part.exists() and part.stat().st_size > have
            failures = 0 if grew else _failed(url, failures, err)
            continue
        now = part.stat().st_size if part.exists() else 0
        if now > size:
            part.unlink()
            raise DataError(f"{url} is larger than the index says ({now} > {size} bytes): the server's copy is not "
                            "this preparation's")
        failures = 0 if now > have else _failed(url, failures, ConnectionError("the connection closed early"))
    digest = sha256_file(part) if size else hashlib.sha256(b"").hexdigest()
    if digest != sha256:
        part.unlink(missing_ok=True)
        raise DataError(f"sha256 of {dest.name} downloaded from {url} is {digest}, the index says {sha256}: the "
                        "server's copy is corrupt (the download was deleted); tell the server's operator")
    if size:
        os.replace(part, dest)
    else:
        dest.write_bytes(b"")
