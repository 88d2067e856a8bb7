"""The binary format of a chunk's KV outside the pool (disk files, Redis values).

An entry is self-describing and never pickled, so a replica can safely read what another wrote:

    magic      8 bytes   b"RAGKVKV\\0"
    length     4 bytes   little-endian length of the header
    header     JSON      format version, key, model fingerprint, dtype, namespace hash,
                         system and chunk token hashes, shape, payload size
    payload    raw bytes the KV tensor [2, layers, tokens, kv_heads, head_dim], C order,
                         little-endian
    checksum   4 bytes   CRC-32 of everything before it

`decode` checks every field against what the reader expects (`ChunkMeta`) and raises
`CorruptChunkError` naming the first mismatch: a truncated, bit-flipped or foreign entry (another
model, dtype, tenant or chunk under the same key) is never served. CRC-32 catches corruption,
not forgery; the namespace in the key keeps tenants and models apart.
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings
import zlib
from dataclasses import dataclass, field

import torch

from ...host_ints import int64_bytes

FORMAT_VERSION = 1
MAGIC = b"RAGKVKV\0"
_LENGTH = struct.Struct("<I")
_CHECKSUM = struct.Struct("<I")
# A header is a few hundred bytes; anything far larger is garbage, not a header.
_MAX_HEADER = 1 << 16
_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float32, torch.bfloat16, torch.float16)}


class CorruptChunkError(ValueError):
    """A stored entry that must not be served; the message says why."""


def token_hash(tokens: tuple[int, ...]) -> str:
    return hashlib.sha256(int64_bytes(tokens)).hexdigest()


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a chunk's stored KV must describe to be served: hashes, not secrets (the
    namespace, which holds the cache salt, is stored hashed)."""

    key: str  # hex of the chunk-cache key
    model: str  # fingerprint of the weights' content
    dtype: str
    namespace: str  # sha256 of the chunk-cache namespace
    system: str  # token_hash of S (empty tuple for standalone chunks)
    tokens: str  # token_hash of the chunk
    shape: tuple[int, ...]  # (2, layers, tokens, kv_heads, head_dim)

    @classmethod
    def describe(cls, key: bytes, model: str, dtype: torch.dtype, namespace: str,
                 system: tuple[int, ...], tokens: tuple[int, ...],
                 layer_shape: tuple[int, int, int]) -> ChunkMeta:
        """`layer_shape` is (layers, kv_heads, head_dim) of the pool."""
        layers, heads, dim = layer_shape
        return cls(key=key.hex(), model=model, dtype=str(dtype).removeprefix("torch."),
                   namespace=hashlib.sha256(namespace.encode()).hexdigest(),
                   system=token_hash(system), tokens=token_hash(tokens),
                   shape=(2, layers, len(tokens), heads, dim))

    @property
    def payload_bytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """A chunk's KV off the pool: `kv` is a CPU tensor of `meta.shape` and `meta.dtype`.
    `ready` (a CUDA event, or None) marks the end of the asynchronous copy that fills `kv`
    (KVPool.read): CPU readers call `wait()` first; GPU work on the copy's stream need not."""

    meta: ChunkMeta
    kv: torch.Tensor
    ready: object | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def wait(self) -> torch.Tensor:
        """`kv`, once its copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.kv


def encode(record: ChunkRecord) -> bytes:
    meta = record.meta
    header = json.dumps({"version": FORMAT_VERSION, "key": meta.key, "model": meta.model,
                         "dtype": meta.dtype, "namespace": meta.namespace,
                         "system": meta.system, "tokens": meta.tokens,
                         "shape": list(meta.shape), "payload_bytes": meta.payload_bytes,
                         "checksum": "crc32"}, separators=(",", ":")).encode()
    kv = record.wait().detach().to("cpu").contiguous()
    if tuple(kv.shape) != meta.shape or kv.dtype != _DTYPES[meta.dtype]:
        raise ValueError(f"chunk record: tensor {tuple(kv.shape)} {kv.dtype} does not match "
                         f"its header {meta.shape} {meta.dtype}")
    body = MAGIC + _LENGTH.pack(len(header)) + header + kv.view(torch.uint8).numpy().tobytes()
    return body + _CHECKSUM.pack(zlib.crc32(body))


def decode(data: bytes | bytearray | memoryview, expect: ChunkMeta) -> ChunkRecord:
    """The record in `data` if it is intact and is exactly the chunk `expect` describes."""
    view = memoryview(data)
    fixed = len(MAGIC) + _LENGTH.size
    if len(view) < fixed + _CHECKSUM.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise CorruptChunkError("not a ragkv chunk entry (bad magic or too short)")
    (header_len,) = _LENGTH.unpack_from(view, len(MAGIC))
    if header_len > _MAX_HEADER or fixed + header_len + _CHECKSUM.size > len(view):
        raise CorruptChunkError(f"truncated entry: header of {header_len} bytes in "
                                f"{len(view)} bytes")
    try:
        header = json.loads(bytes(view[fixed:fixed + header_len]))
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise CorruptChunkError(f"unreadable header: {type(e).__name__}") from e
    if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
        raise CorruptChunkError(f"format version {header.get('version')!r} (this reader: "
                                f"{FORMAT_VERSION})" if isinstance(header, dict)
                                else "header is not an object")
    for name in ("key", "model", "dtype", "namespace", "system", "tokens"):
        if header.get(name) != getattr(expect, name):
            raise CorruptChunkError(f"{name} mismatch: entry has {header.get(name)!r}, "
                                    f"expected {getattr(expect, name)!r}")
    shape = header.get("shape")
    if not isinstance(shape, list) or tuple(shape) != expect.shape:
        raise CorruptChunkError(f"shape mismatch: entry has {header.get('shape')}, expected "
                                f"{list(expect.shape)}")
    payload = expect.payload_bytes
    start = fixed + header_len
    if header.get("payload_bytes") != payload or len(view) != start + payload + _CHECKSUM.size:
        raise CorruptChunkError(f"truncated or padded entry: {len(view)} bytes, expected "
                                f"{start + payload + _CHECKSUM.size}")
    (stored,) = _CHECKSUM.unpack_from(view, start + payload)
    if zlib.crc32(view[:start + payload]) != stored:
        raise CorruptChunkError("checksum mismatch")
    with warnings.catch_warnings():
        # The buffer may be read-only (bytes); the tensor is only read, then copied.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8, count=payload, offset=start)
    kv = raw.view(_DTYPES[expect.dtype]).view(expect.shape)
    return ChunkRecord(expect, kv)
