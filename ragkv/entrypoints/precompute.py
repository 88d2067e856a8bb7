"""`ragkv precompute`: compute the KV of every document of a corpus ahead of traffic and write
it to the chunk store's shared tiers (TurboRAG's offline KV), so that replicas serving the
corpus start warm.

Each document becomes the one chunk of a request whose system part is the one the served
requests will have: `chat` format renders the model's chat template around a system message
and the document exactly as `/v1/chat/completions` with `documents` does (prompt.
split_chat_prompt); `text` format is the separator / RAGPrompt form (S, then the document's
tokens). A chunk's store key depends on the model, dtype, S, the chunk, the chunk attention
and the cache salt, so precompute must be given the same ones as the servers. Runs are
resumable: a document whose chunk key is in a shared tier is skipped.

With a chunk primer (`--chunk-primer`, isolated chunks), a document read after the first of
a prompt has other KV (computed after S and the primer): each document is then the request's
chunk twice, first as the first document, then primed (the primer's own KV is stored too).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from ..cache.store.tiered import MAX_PENDING_WRITES
from ..sampling.params import SamplingParams

logger = logging.getLogger("ragkv")

PROMPT_FORMATS = ("chat", "text")
_NOT_STORED = ("its KV did not reach every shared tier (a chunk larger than the chunk cache "
               "region, a tier full or failing: see the store errors)")
# The question of a precompute request: it only has to exist (one token is generated and
# thrown away); it is not part of any chunk's key.
_QUESTION = "?"


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    text: str


@dataclass
class PrecomputeSummary:
    documents: int = 0
    computed: int = 0
    skipped: int = 0  # already in every shared tier
    copied: int = 0  # in some shared tier: copied to the others
    failed: list[tuple[str, str]] = field(default_factory=list)  # (id, why)
    tokens: int = 0  # chunk tokens computed
    bytes_written: int = 0  # to the shared tiers, all of them together
    store_errors: int = 0  # failed writes or lookups (Redis down): those chunks may be missing
    seconds: float = 0.0

    def format(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        per_token = self.bytes_written / self.tokens if self.tokens else 0.0
        lines = [
            f"documents     {self.documents}",
            f"  computed    {self.computed}",
            f"  skipped     {self.skipped} (already stored)",
            f"  copied      {self.copied} (stored in one shared tier, copied to the others)",
            f"  failed      {len(self.failed)}",
            f"tokens        {self.tokens}",
            f"bytes written {self.bytes_written} ({per_token:.0f} bytes/token, all shared "
            "tiers)",
            f"time          {self.seconds:.1f} s ({rate:.0f} tokens/s)",
        ]
        if self.store_errors:
            lines.append(f"store errors  {self.store_errors} (some chunks may not be stored: "
                         "run precompute again once the store is reachable)")
        lines += [f"  failed {doc_id}: {why}" for doc_id, why in self.failed]
        return "\n".join(lines)


def read_documents(path: str) -> list[Document]:
    """The corpus: one JSON object {"id", "text"} per line (blank lines allowed); a missing
    id is the line number. Raises ValueError naming the line of the first bad one."""
    docs: list[Document] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text'")
            doc_id = str(obj.get("id", lineno))
            if doc_id in seen:
                raise ValueError(f"{path}:{lineno}: duplicate id {doc_id!r}")
            seen.add(doc_id)
            docs.append(Document(doc_id, obj["text"]))
    return docs


def precompute(llm, documents: list[Document], system: str, prompt_format: str = "chat",
               cache_salt: str | None = None, batch_size: int = 16,
               progress: bool = True) -> PrecomputeSummary:
    """Compute and store the chunk of every document `llm`'s store lacks."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got "
                         f"{prompt_format!r}")
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    engine = llm.engine
    store = engine.chunk_store
    if store is None or not store.has_shared_tier:
        raise ValueError("precompute writes to the chunk store's shared tiers: give a disk or "
                         "redis:// tier (--store disk:PATH:SIZE or --store redis://HOST:PORT/DB)")
    shared = store.shared_tiers()
    if batch_size * len(shared) > MAX_PENDING_WRITES:
        raise ValueError(f"batch size {batch_size} with {len(shared)} shared tiers exceeds the "
                         f"chunk store's write queue ({MAX_PENDING_WRITES} writes)")
    written_before = sum(t.stats().bytes_written for t in shared)
    errors_before = sum(t.stats().errors for t in shared)
    summary = PrecomputeSummary(documents=len(documents))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(documents), unit="doc", desc="precompute")
    for i in range(0, len(documents), batch_size):
        batch: list[tuple[Document, object, list[str]]] = []
        for doc in documents[i:i + batch_size]:
            try:
                prompt = _prompt(engine, doc, system, prompt_format, cache_salt)
                metas = engine.chunk_metas(prompt)
            except ValueError as e:
                summary.failed.append((doc.id, str(e)))
                continue
            keys = [m.key for m in metas]
            if not keys:
                summary.failed.append((doc.id, "the document has no tokens"))
            elif all(t.contains(k) for t in shared for k in keys):
                summary.skipped += 1
            elif all(store.copy_to_missing(m) for m in metas):
                summary.copied += 1  # in one shared tier, not all (a Redis emptied since)
            else:
                batch.append((doc, prompt, keys))
        if batch:
            llm.generate([p for _, p, _ in batch], params, use_tqdm=False)
            # Each batch lands before the next starts (the writer's queue is bounded), then
            # every document is checked in every shared tier: a chunk that did not get there
            # (larger than the chunk region, a full or failing tier) is reported, not counted.
            engine.flush_chunk_store()
            for doc, prompt, keys in batch:
                if all(t.contains(k) for t in shared for k in keys):
                    summary.computed += 1
                    summary.tokens += sum(len(c) for c in prompt.chunks)
                else:
                    summary.failed.append((doc.id, _NOT_STORED))
        if bar is not None:
            bar.update(min(batch_size, len(documents) - i))
    if bar is not None:
        bar.close()
    summary.seconds = time.perf_counter() - start
    summary.bytes_written = sum(t.stats().bytes_written for t in shared) - written_before
    summary.store_errors = sum(t.stats().errors for t in shared) - errors_before
    return summary


def _prompt(engine, doc: Document, system: str, prompt_format: str, cache_salt: str | None):
    """The prompt a served request with this system part and document would have, parsed;
    with a chunk primer, the document twice: first, then primed (once when twice is too long
    for max_model_len: the primed copy is then computed by the first request that reads it)."""
    if engine.inputs.primer and engine.config.chunk_attention == "isolated":
        try:
            return _parsed(engine, doc, system, prompt_format, cache_salt, copies=2)
        except ValueError:
            pass
    return _parsed(engine, doc, system, prompt_format, cache_salt, copies=1)


def _parsed(engine, doc: Document, system: str, prompt_format: str, cache_salt: str | None,
            copies: int):
    # Sequential positions for a primed copy; entries do not depend on the positions.
    layout = {"recompute": "none", "position_strategy": "sequential" if copies > 1 else None}
    if prompt_format == "chat":
        messages = [{"role": "user", "content": _QUESTION}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return engine.process_chat(messages, documents=[doc.text] * copies,
                                   cache_salt=cache_salt, **layout)
    from ..inputs.prompt import RAGPrompt

    # Only the documents' cache entries matter: no recompute (entries do not depend on it).
    # The parts trimmed as a separated prompt's are (split_at_separator), so `S ## doc ## Q`
    # and `S##doc##Q` both hit.
    return engine.process_prompt(RAGPrompt(system.rstrip(), [doc.text.strip()] * copies,
                                           _QUESTION, cache_salt=cache_salt, **layout))
