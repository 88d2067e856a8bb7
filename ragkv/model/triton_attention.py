"""Triton attention kernels over token-slot KV lists (the GPU backend of attention.py).

Two kernels implement the contract of `attention.py` (per-sequence slot list, bottom-right
causal, positions separate, GQA):
- `extend`: a flash-attention pass per (sequence, block of queries, head) that gathers K/V
  rows by slot from a ragged index list. It serves prefill, chunk jobs (S + the chunk's own
  slots), the question over cached chunks and chunked prefill alike;
- `decode`: split-KV flash decoding for one query token per sequence. Each program takes one
  KV head and a slice of the sequence's KV for all query heads of its group (the group's rows
  form the tile, so K/V are read once per group), and a second kernel merges the slices by
  their log-sum-exp. Its KV list is a prefix of the sequence's row in the persistent slot
  table, read on the device: nothing about a decode step's KV is built on the host, which is
  what lets a CUDA graph replay it.

Triton is imported lazily (it ships with CUDA builds of PyTorch). With TRITON_INTERPRET=1 the
kernels run on CPU tensors through Triton's interpreter, which is how CPU-only CI tests them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache.kv_pool import KVPool
from .attention import AttentionMetadata, attend_rotated

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None

# KV positions per program in the decode kernel's inner loop, and the most splits of one
# sequence's KV (the merge kernel reduces them in one tile).
DECODE_BLOCK_N = 64
MAX_SPLITS = 64
# Query rows per program of the extend kernel.
EXTEND_BLOCK_M = 128
# Softmax in base 2 (exp2 is the hardware instruction): scores are scaled by log2(e) once.
_LOG2E = 1.4426950408889634


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _extend_block(acc, m_i, l_i, q, k_base, v_base, kv_index, kv_begin, start, hi, diag,
                      offs_m, offs_d, d_valid, stride_kt, qk_scale,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        """One block of KV entries folded into the running softmax (base-2 exponentials)."""
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        slots = tl.load(kv_index + kv_begin + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:  # the block crosses the causal diagonal or the end of the list
            visible = (offs_n[None, :] <= diag + offs_m[:, None]) & n_valid[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet (a later KV split) keeps -inf safely.
        if MASKED:  # noqa: SIM108 (a compile-time branch of the kernel)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_kt + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    # Lengths, offsets and counts are data, never specialised on, so no new length or batch
    # ever compiles a new kernel.
    #
    # With SPLITS > 1 each (sequence, query block, head) is cut further along the KV list and
    # the slices go to mid_o / mid_lse (indexed by the token's place among the extend tokens,
    # `mid_starts`), merged afterwards: a few query tokens over a long cached context (the
    # question of a warm RAG request) would otherwise run on a handful of multiprocessors.
    @triton.jit(do_not_specialize=["kv_index", "kv_indptr", "q_starts", "q_lens", "mid_starts"])
    def _extend_kernel(
        Q, K, V, Out, kv_index, kv_indptr, q_starts, q_lens, mid_starts, mid_o, mid_lse,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
        stride_mb, stride_mh,
        qk_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        block = tl.program_id(1)
        head = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        q_len = tl.load(q_lens + seq)
        if block * BLOCK_M >= q_len:
            return
        q_start = tl.load(q_starts + seq)
        kv_begin = tl.load(kv_indptr + seq)
        kv_len = tl.load(kv_indptr + seq + 1) - kv_begin
        kv_head = head // GROUP
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < q_len
        d_valid = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                    + offs_d[None, :], mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        # Query t (of q_len) sees entries 0 .. kv_len - q_len + t of the list.
        diag = kv_len - q_len
        hi = tl.minimum(kv_len, diag + (block + 1) * BLOCK_M)
        # This program's slice [lo, end) of the entries the block attends to.
        per_split = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        end = tl.minimum(lo + per_split, hi)
        # Blocks wholly visible to every row of this query block need no mask.
        full = tl.minimum(tl.minimum(diag + block * BLOCK_M + 1, hi) // BLOCK_N * BLOCK_N, end)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_kh
        for start in range(lo, full, BLOCK_N):
            acc, m_i, l_i = _extend_block(acc, m_i, l_i, q, k_base, v_base, kv_index, kv_begin,
                                          start, hi, diag, offs_m, offs_d, d_valid, stride_kt,
                                          qk_scale, BLOCK_N, False, PRECISION)
        for start in range(tl.maximum(lo, full), end, BLOCK_N):
            acc, m_i, l_i = _extend_block(acc, m_i, l_i, q, k_base, v_base, kv_index, kv_begin,
                                          start, hi, diag, offs_m, offs_d, d_valid, stride_kt,
                                          qk_scale, BLOCK_N, True, PRECISION)
        if SPLITS == 1:  # entry 0 is in every row's view, so l_i > 0
            out = acc / l_i[:, None]
            tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
                     + offs_d[None, :], out.to(Out.dtype.element_ty),
                     mask=m_valid[:, None] & d_valid[None, :])
        else:  # a row may see nothing in this slice: lse -inf, skipped by the merge
            seen = l_i > 0
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            row = tl.load(mid_starts + seq) + offs_m
            base = row * stride_mb + head * stride_mh + split  # mid_lse [T, H, S]
            tl.store(mid_lse + base, lse, mask=m_valid)
            tl.store(mid_o + base[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=m_valid[:, None] & d_valid[None, :])

    @triton.jit(do_not_specialize=["rows", "kv_lens", "q_rows", "num_splits"])
    def _decode_kernel(
        Q, K, V, table, rows, kv_lens, q_rows, mid_o, mid_lse,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
        stride_mb, stride_mh, stride_ms,
        qk_scale, num_splits,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(kv_lens + b)
        row = tl.load(rows + b).to(tl.int64)
        q_row = tl.load(q_rows + b).to(tl.int64)
        per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_len)
        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        h_valid = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        q = tl.load(Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=h_valid[:, None] & d_valid[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_kh
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            slots = tl.load(table + row * stride_table + offs_n, mask=n_valid,
                            other=0).to(tl.int64)
            k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                        mask=n_valid[:, None] & d_valid[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            qk = tl.where(n_valid[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * stride_kt + offs_d[None, :],
                        mask=n_valid[:, None] & d_valid[None, :], other=0.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # An empty slice (past the end of a short sequence) leaves lse = -inf and no output;
        # the merge skips it.
        empty = hi <= lo
        # Base 2 throughout: the merge only compares and exponentiates these.
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        base = b * stride_mb + heads * stride_mh + split * stride_ms
        # mid_o is contiguous [B, H, S, D]: its offsets are mid_lse's times HEAD_DIM.
        tl.store(mid_lse + base, lse, mask=h_valid)
        # The emptiness test joins the mask as a vector: Triton's interpreter rejects a
        # mask broadcast from a scalar comparison.
        h_store = h_valid & (offs_h * 0 + hi > lo)
        tl.store(mid_o + base[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=h_store[:, None] & d_valid[None, :])

    @triton.jit(do_not_specialize=["q_rows", "num_splits"])
    def _merge_kernel(
        mid_o, mid_lse, Out, q_rows, stride_ot, stride_oh, stride_mb, stride_mh, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_valid = offs_s < num_splits
        base = b * stride_mb + head * stride_mh
        lse = tl.load(mid_lse + base + offs_s, mask=s_valid, other=float("-inf"))
        top = tl.max(lse, 0)
        weight = tl.exp2(lse - top)  # 0 for empty slices
        used = weight > 0
        o = tl.load(mid_o + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=used[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
        q_row = tl.load(q_rows + b).to(tl.int64)
        tl.store(Out + q_row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def extend_splits(q_lens: list[int], kv_lens: list[int], heads: int,
                  device: torch.device) -> int:
    """KV slices per (sequence, query block, head): 1 when those already fill the GPU, else
    enough for about two waves, no slice under 512 entries."""
    if device.type != "cuda":
        return 1 if max(kv_lens) <= 64 else 2
    programs = sum(-(-q // EXTEND_BLOCK_M) for q in q_lens) * heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // programs), max(kv_lens) // 512))


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, kv_index: torch.Tensor, kv_indptr: torch.Tensor,
                     q_starts: torch.Tensor, q_lens: torch.Tensor, max_q_len: int,
                     scale: float, splits: int = 1,
                     merge: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Attention of the sequences' query rows of `q` [T, H, D] over their ragged slot lists
    (`kv_index[kv_indptr[i]:kv_indptr[i+1]]`), bottom-right causal, written into `out`.
    With `splits` > 1, `merge` = (mid_starts: each sequence's first place among the extend
    tokens, rows: each extend token's row of `q`), both int32 on the device."""
    num_seqs = q_starts.numel()
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[1]
    block_d = max(16, _next_pow2(head_dim))
    # float32 stays float32 (exact); tf32 only matters for float32 inputs anyway.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_m = EXTEND_BLOCK_M
    if q.device.type == "cuda":
        if precision == "ieee":  # float32 tiles take twice the registers and shared memory
            block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
        else:
            block_n, num_warps, num_stages = 64, (4 if block_d <= 64 else 8), 3
    else:  # the interpreter: small tiles keep it quick
        block_m, block_n, num_warps, num_stages = 16, 16, 1, 1
    if splits > 1:
        mid_starts, rows = merge
        mid_o, mid_lse = decode_scratch(rows.numel(), heads, head_dim, splits, q.device)
    else:
        mid_starts, mid_o, mid_lse = q_starts, out, out  # unused
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), heads * splits)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, kv_index, kv_indptr, q_starts, q_lens, mid_starts, mid_o,
        mid_lse, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), mid_lse.stride(0), mid_lse.stride(1), scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=precision, SPLITS=splits, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _merge_kernel[(rows.numel(), heads)](
            mid_o, mid_lse, out, rows, out.stride(0), out.stride(1),
            mid_lse.stride(0), mid_lse.stride(1), splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _next_pow2(splits)),
            num_warps=4 if q.device.type == "cuda" else 1,
        )


def decode_splits(batch: int, num_kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """How many slices to cut each sequence's KV into: enough programs to fill the GPU
    (two waves of its multiprocessors), no slice shorter than one block."""
    if device.type != "cuda":
        return max(1, min(4, math.ceil(max_kv_len / DECODE_BLOCK_N)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / max(1, batch * num_kv_heads))
    return max(1, min(MAX_SPLITS, want, math.ceil(max_kv_len / DECODE_BLOCK_N)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                     kv_lens: torch.Tensor, q_rows: torch.Tensor, num_splits: int,
                     scale: float, scratch: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> None:
    """One query row per sequence (`q[q_rows[b]]`) over the first `kv_lens[b]` slots of
    `table[rows[b]]`, written into `out[q_rows[b]]`. Reads lengths and rows on the device
    only, so a captured graph replays it for any lengths."""
    batch = rows.numel()
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if scratch is None:
        scratch = decode_scratch(batch, heads, head_dim, num_splits, q.device)
    mid_o, mid_lse = scratch
    block_d = max(16, _next_pow2(head_dim))
    # float32 stays float32 (exact); tf32 only matters for float32 inputs anyway.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    cuda = q.device.type == "cuda"
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, table, rows, kv_lens, q_rows, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        scale * _LOG2E, num_splits,
        GROUP=group, BLOCK_H=max(16, _next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, PRECISION=precision, num_warps=4 if cuda else 1,
        num_stages=2 if cuda else 1,
    )
    _merge_kernel[(batch, heads)](
        mid_o, mid_lse, out, q_rows, out.stride(0), out.stride(1),
        mid_lse.stride(0), mid_lse.stride(1), num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _next_pow2(num_splits)),
        num_warps=4 if cuda else 1,
    )


def decode_scratch(batch: int, heads: int, head_dim: int, num_splits: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slice partial outputs [B, H, S, D] and their log-sum-exps [B, H, S] (float32)."""
    return (torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device))


@dataclass(slots=True)
class DecodeBatch:
    """Device inputs of the decode kernel; a CUDA graph keeps one per captured batch size and
    fills it in place before each replay."""

    rows: torch.Tensor  # [B] int32: each sequence's row of the slot table
    kv_lens: torch.Tensor  # [B] int32
    q_rows: torch.Tensor  # [B] int32: its query row in the step's tokens
    num_splits: int
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class _TritonState:
    decode: DecodeBatch | None = None
    extend: tuple[torch.Tensor, ...] | None = None  # kv_index, kv_indptr, q_starts, q_lens
    max_q_len: int = 0
    splits: int = 1
    merge: tuple[torch.Tensor, torch.Tensor] | None = None  # see extend_attention
    # Sequences with re-positioned keys: (index, its KV slots, its mask or None). They go
    # through the torch path of attention.py; a kernel that rotates in its K loads (or its
    # queries per range) is the GPU backend's next step.
    rotated: list[tuple[int, torch.Tensor, torch.Tensor | None]] | None = None


def indptr_of(lengths: list[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]: where each of a list of runs starts, and the total."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class TritonAttentionBackend:
    """Triton kernels for CUDA. Decode rows are sequences with one query token whose KV list
    is a prefix of their slot-table row; every other sequence goes through `extend`."""

    name = "triton"

    def __init__(self) -> None:
        if triton is None:
            raise ValueError("attention_backend='triton' needs Triton (it ships with CUDA "
                             "builds of PyTorch; `pip install triton`)")

    def prepare(self, meta: AttentionMetadata) -> None:
        state = _TritonState()
        device = meta.write_slots.device
        decode, extend, rotated = [], [], []
        for i in range(meta.num_seqs):
            if meta.rotated(i) or meta.indexed(i):
                rotated.append((i, meta.kv_indices[i].long(), meta.mask(i, device)))
            elif meta.q_lens[i] == 1 and meta.prefix[i]:
                decode.append(i)
            else:
                extend.append(i)
        state.rotated = rotated or None
        if decode:
            host = torch.tensor([[meta.rows[i] for i in decode],
                                 [meta.kv_lens[i] for i in decode],
                                 [meta.q_starts[i] for i in decode]], dtype=torch.int32)
            dev = host.to(device, non_blocking=True)
            max_kv = max(meta.kv_lens[i] for i in decode)
            state.decode = DecodeBatch(
                rows=dev[0], kv_lens=dev[1], q_rows=dev[2],
                num_splits=decode_splits(len(decode), meta.num_kv_heads, max_kv, device))
        if extend:
            kv_index = torch.cat([meta.kv_indices[i] for i in extend])
            indptr = indptr_of([meta.kv_lens[i] for i in extend])
            host = torch.tensor([indptr, [meta.q_starts[i] for i in extend] + [0],
                                 [meta.q_lens[i] for i in extend] + [0]], dtype=torch.int32)
            dev = host.to(device, non_blocking=True)
            state.extend = (kv_index, dev[0], dev[1, :-1], dev[2, :-1])
            q_lens = [meta.q_lens[i] for i in extend]
            state.max_q_len = max(q_lens)
            state.splits = extend_splits(q_lens, [meta.kv_lens[i] for i in extend],
                                         meta.num_heads, device)
            if state.splits > 1:
                rows = [t for i in extend
                        for t in range(meta.q_starts[i], meta.q_starts[i] + meta.q_lens[i])]
                host = torch.tensor(indptr_of(q_lens)[:-1] + rows, dtype=torch.int32)
                dev = host.to(device, non_blocking=True)
                state.merge = (dev[:len(extend)], dev[len(extend):])
        meta.backend_state = state

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        k_cache.index_copy_(0, meta.write_slots, k)
        v_cache.index_copy_(0, meta.write_slots, v)
        return self.attend(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        state: _TritonState = meta.backend_state
        out = torch.empty_like(q)
        for i, index, mask in state.rotated or ():
            attend_rotated(q, k_cache, v_cache, meta, i, index, mask, scale, out)
        if state.extend is not None:
            kv_index, indptr, q_starts, q_lens = state.extend
            extend_attention(q, k_cache, v_cache, out, kv_index, indptr, q_starts, q_lens,
                             state.max_q_len, scale, state.splits, state.merge)
        d = state.decode
        if d is not None:
            decode_attention(q, k_cache, v_cache, out, meta.table, d.rows, d.kv_lens, d.q_rows,
                             d.num_splits, scale, d.scratch)
        return out
