"""Content digests of large files (GGUF checkpoints), computed once and remembered.

Hashing a multi-gigabyte checkpoint on every start would cost seconds, so the digest is kept in
a small JSON record keyed by the file's size and modification time (nanoseconds): a record
whose key no longer matches the file is ignored and rewritten. The record lives beside the file
(`<file>.ragkv-digest.json`); when that directory is not writable (a read-only model store,
site-packages of another user) it lives under `$RAGKV_CACHE_DIR/digests/` (default
`~/.cache/ragkv`). When neither can be written the digest is simply recomputed next time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger("ragkv")

ALGORITHM = "blake2b-256"
_READ_BYTES = 8 << 20


def cache_root() -> Path:
    """ragkv's cache directory: $RAGKV_CACHE_DIR, else ~/.cache/ragkv."""
    root = os.environ.get("RAGKV_CACHE_DIR") or os.path.join("~", ".cache", "ragkv")
    return Path(root).expanduser()


def file_digest(path: str) -> str:
    """Hex digest of the file's bytes (BLAKE2b, 256 bits), from a valid record when one exists."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    key = {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "algorithm": ALGORITHM}
    records = _record_paths(path)
    for record in records:
        digest = _read_record(record, key)
        if digest is not None:
            return digest
    digest = _hash_file(path)
    for record in records:
        if _write_record(record, {**key, "digest": digest}):
            break
    return digest


def _record_paths(path: str) -> list[Path]:
    name = hashlib.sha256(path.encode()).hexdigest()[:32]
    return [Path(f"{path}.ragkv-digest.json"), cache_root() / "digests" / f"{name}.json"]


def _hash_file(path: str) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _read_record(record: Path, key: dict) -> str | None:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in key.items()):
        return None
    digest = data.get("digest")
    return digest if isinstance(digest, str) else None


def _write_record(record: Path, data: dict) -> bool:
    """Write atomically (temp file + rename), so a reader never sees half a record."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{record.name}.", dir=record.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the record is not a secret
            os.replace(tmp, record)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except OSError as e:
        logger.debug("could not write digest record %s: %s", record, e)
        return False
