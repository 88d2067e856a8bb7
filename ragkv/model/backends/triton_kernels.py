"""Triton attention kernels over token-slot KV lists, and their launchers (the backend that
plans them is triton_attention.py).

Two kernels implement the contract of base.py (per-sequence slot list, bottom-right causal,
positions separate, GQA):
- `extend`: a flash-attention pass per (sequence, block of queries, head) that gathers K/V
  rows by slot from a ragged index list. It serves prefill, chunk jobs (S + the chunk's own
  slots), the question over cached chunks and chunked prefill alike;
- `decode`: split-KV flash decoding for one query token per sequence. Each program takes one
  KV head and a slice of the sequence's KV for all query heads of its group (the group's rows
  form the tile, so K/V are read once per group), and a second kernel merges the slices by
  their log-sum-exp. Its KV list is a prefix of the sequence's row in the persistent slot
  table, read on the device: nothing about a decode step's KV is built on the host, which is
  what lets a CUDA graph replay it.

Both take the two RAG additions to the contract in their loads, so no sequence leaves the
kernels:
- turns (model/reposition.py: a cached chunk placed elsewhere than its keys were rotated
  for): each entry's key is turned forward by its turn's delta as it is loaded
  (`_turn_keys`), from a small table of cos/sin rows, one per distinct delta of the step. The
  pool is never written;
- query entries (`query_index`: selectively recomputed chunk tokens scattered among cached
  ones): the extend kernel takes each query's last visible entry from a per-token array
  instead of the bottom-right diagonal.

Sliding-window layers (`SlidingWindow`) add one test to the mask: a query at position p sees
an entry whose key sits at position > p - window, the key's position being its slot's
(`KVPool.pos`) plus its turn's delta. A block of entries that no row of the tile sees is
skipped after loading only its positions, so a long prompt's windowed layers read about
window + tile entries per query block, not the whole list.

Triton is imported lazily (it ships with CUDA builds of PyTorch). With TRITON_INTERPRET=1 the
kernels run on CPU tensors through Triton's interpreter, which is how CPU-only CI tests them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None


def _patch_interpreter() -> None:
    """Triton's interpreter turns a loaded scalar (a 1-element array there) into a loop bound
    with int(array), which NumPy >= 2.4 refuses for arrays of one dimension: give its tensors
    an __index__ that reads the one element. Applied where the interpreter runs (here, so that
    every process that imports the kernels has it: tensor parallelism's workers too)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "ragkv_index", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.ragkv_index = True
    interpreter._patch_lang_tensor = patched


if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()

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
    def _range_turns(offs_n, ranges, r_lo, r_hi):
        """Each entry's row of the turn tables: that of the range (rows r_lo .. r_hi of
        `ranges`, each (start, end, table row)) covering it, -1 where none does."""
        turn = tl.zeros_like(offs_n) - 1
        for r in range(r_lo, r_hi):
            a = tl.load(ranges + 3 * r)
            b = tl.load(ranges + 3 * r + 1)
            row = tl.load(ranges + 3 * r + 2)
            turn = tl.where((offs_n >= a) & (offs_n < b), row, turn)
        return turn

    @triton.jit
    def _turn_keys(k, turn, k_base, slots, n_valid, offs_d, d_valid, stride_kt, turn_cos,
                   turn_sin, HEAD_DIM: tl.constexpr):
        """K rows [BLOCK_N, BLOCK_D], each turned by row `turn` of the cos/sin tables (rows
        that turn a key forward by a delta); rows with turn -1 come back unchanged. In
        float32, rounded to the pool's dtype for the dot as the stored keys are."""
        mask = ((turn >= 0) & n_valid)[:, None] & d_valid[None, :]
        # rotate_half's partner of each element: x1 * c - x2 * s, x2 * c + x1 * s.
        first = offs_d < HEAD_DIM // 2
        pair = tl.where(first, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
        sign = tl.where(first, -1.0, 1.0)
        k_pair = tl.load(k_base + slots[:, None] * stride_kt + pair[None, :], mask=mask,
                         other=0.0)
        row_offs = turn.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
        c = tl.load(turn_cos + row_offs, mask=mask, other=1.0)
        s = tl.load(turn_sin + row_offs, mask=mask, other=0.0)
        turned = k.to(tl.float32) * c + k_pair.to(tl.float32) * (s * sign[None, :])
        return turned.to(k.dtype)

    @triton.jit
    def _window_positions(slots, n_valid, k_pos, turn, turn_deltas, TURN: tl.constexpr):
        """The position each entry's key is seen at: its slot's, turned by its turn's delta
        (`turn`: its row of the turn tables, -1 for none)."""
        kpos = tl.load(k_pos + slots, mask=n_valid, other=0).to(tl.int64)
        if TURN:
            kpos += tl.load(turn_deltas + tl.maximum(turn, 0), mask=n_valid & (turn >= 0),
                            other=0).to(tl.int64)
        return kpos

    @triton.jit
    def _extend_fold(acc, m_i, l_i, q, k, v_base, slots, n_valid, visible, offs_d, d_valid,
                     stride_kt, qk_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        """K rows `k` and their V folded into the running softmax (base-2 exponentials),
        row i seeing the entries `visible[i]` (MASKED)."""
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
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

    @triton.jit
    def _extend_block(acc, m_i, l_i, q, k_base, v_base, kv_index, kv_begin, start, hi, lim,
                      offs_d, d_valid, stride_kt, qk_scale, entry_turns, turn_cos, turn_sin,
                      qpos, k_pos, turn_deltas, window,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      PRECISION: tl.constexpr, TURN: tl.constexpr, HEAD_DIM: tl.constexpr,
                      WINDOW: tl.constexpr):
        """One block of KV entries folded into the running softmax. Row i sees the entries
        up to lim[i] of the list and, with WINDOW (always MASKED), only those whose keys sit
        within `window` positions of its query's `qpos[i]`."""
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        slots = tl.load(kv_index + kv_begin + offs_n, mask=n_valid, other=0).to(tl.int64)
        if TURN:
            # A load beside kv_index's, not a search of the ranges: the block's loads stay
            # pipelined.
            turn = tl.load(entry_turns + kv_begin + offs_n, mask=n_valid, other=-1)
        else:
            turn = offs_n * 0 - 1
        if MASKED:  # the block crosses the causal diagonal or the end of the list
            visible = (offs_n[None, :] <= lim[:, None]) & n_valid[None, :]
        else:
            visible = n_valid[None, :]
        if WINDOW:
            kpos = _window_positions(slots, n_valid, k_pos, turn, turn_deltas, TURN)
            visible = visible & (qpos[:, None] - kpos[None, :] < window)
            # Only the positions were loaded so far: a block out of every row's window is
            # skipped whole.
            if tl.max(tl.max(visible.to(tl.int32), 1), 0) > 0:
                k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                            mask=n_valid[:, None] & d_valid[None, :], other=0.0)
                if TURN:
                    k = _turn_keys(k, turn, k_base, slots, n_valid, offs_d, d_valid,
                                   stride_kt, turn_cos, turn_sin, HEAD_DIM)
                acc, m_i, l_i = _extend_fold(acc, m_i, l_i, q, k, v_base, slots, n_valid,
                                             visible, offs_d, d_valid, stride_kt, qk_scale,
                                             True, PRECISION)
        else:
            k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                        mask=n_valid[:, None] & d_valid[None, :], other=0.0)
            if TURN:
                k = _turn_keys(k, turn, k_base, slots, n_valid, offs_d, d_valid, stride_kt,
                               turn_cos, turn_sin, HEAD_DIM)
            acc, m_i, l_i = _extend_fold(acc, m_i, l_i, q, k, v_base, slots, n_valid, visible,
                                         offs_d, d_valid, stride_kt, qk_scale, MASKED,
                                         PRECISION)
        return acc, m_i, l_i

    # Lengths, offsets and counts are data, never specialised on, so no new length or batch
    # ever compiles a new kernel.
    #
    # With SPLIT (splits > 1) each (sequence, query block, head) is cut further along the KV
    # list into `splits` slices (a run-time count, so no split count compiles a variant) and
    # these go to mid_o / mid_lse (indexed by the token's place among the extend tokens,
    # `tok_starts`), merged afterwards: a few query tokens over a long cached context (the
    # question of a warm RAG request) would otherwise run on a handful of multiprocessors.
    # TURN: `entry_turns`, beside `kv_index`, holds each entry's row of the turn tables (-1:
    # the key as stored).
    # INDEXED: query t of a sequence sees entries 0 .. q_limit[tok_starts[i] + t].
    # WINDOW: row t of the step's queries is at position q_pos[t], the key of slot s at
    # k_pos[s] (plus turn_deltas[row] of its turn), and a query sees keys less than `window`
    # positions behind it; every block takes the masked path.
    # PACK: a tile's rows are (token, head) pairs of one KV head's group, token-major, so a
    # few query tokens still fill the tile and the group's K/V blocks are read once for all
    # its heads (as in the decode kernel); otherwise a tile is BLOCK_M tokens of one head.
    @triton.jit(do_not_specialize=["kv_index", "kv_indptr", "q_starts", "q_lens", "tok_starts",
                                   "entry_turns", "q_limit", "splits", "stride_mb", "stride_mh",
                                   "q_pos", "k_pos", "turn_deltas", "window"])
    def _extend_kernel(
        Q, K, V, Out, kv_index, kv_indptr, q_starts, q_lens, tok_starts, mid_o, mid_lse,
        entry_turns, turn_cos, turn_sin, q_limit, q_pos, k_pos, turn_deltas,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
        stride_mb, stride_mh,
        qk_scale, splits, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        SPLIT: tl.constexpr, TURN: tl.constexpr, INDEXED: tl.constexpr,
        PACK: tl.constexpr, WINDOW: tl.constexpr,
    ):
        seq = tl.program_id(0)
        block = tl.program_id(1)
        split = tl.program_id(2) % splits
        q_len = tl.load(q_lens + seq)
        offs_r = block * BLOCK_M + tl.arange(0, BLOCK_M)
        if PACK:
            if block * BLOCK_M >= q_len * GROUP:
                return
            kv_head = tl.program_id(2) // splits
            tok = offs_r // GROUP  # each row's query token and head
            head = kv_head * GROUP + offs_r % GROUP
        else:
            if block * BLOCK_M >= q_len:
                return
            head0 = tl.program_id(2) // splits
            kv_head = head0 // GROUP
            tok = offs_r
            head = head0 + offs_r * 0
        q_start = tl.load(q_starts + seq)
        kv_begin = tl.load(kv_indptr + seq)
        kv_len = tl.load(kv_indptr + seq + 1) - kv_begin
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = tok < q_len
        d_valid = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        # Row i sees entries 0 .. lim[i]; `hi` ends the entries any row of the block sees and
        # `edge` the ones every row sees.
        diag = kv_len - q_len  # bottom-right causal: token t sees entries 0 .. diag + t
        if INDEXED or PACK:
            if INDEXED:
                lim = tl.load(q_limit + tl.load(tok_starts + seq) + tok, mask=m_valid,
                              other=0)
            else:
                lim = diag + tok
            # Rows past the sequence's queries see entry 0 only: finite, never stored.
            lim = tl.where(m_valid, lim, 0)
            hi = tl.minimum(kv_len, tl.max(lim, 0) + 1)
            edge = tl.min(tl.where(m_valid, lim, kv_len), 0) + 1
        else:
            lim = diag + tok
            hi = tl.minimum(kv_len, diag + (block + 1) * BLOCK_M)
            edge = diag + block * BLOCK_M + 1
        # This program's slice [lo, end) of the entries the block attends to.
        per_split = tl.cdiv(tl.cdiv(hi, splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        end = tl.minimum(lo + per_split, hi)
        # Blocks wholly visible to every row of this query block need no mask (a window
        # may hide any block from any row).
        if WINDOW:
            full = lo
            qpos = tl.load(q_pos + q_start + tok, mask=m_valid, other=0).to(tl.int64)
        else:
            full = tl.minimum(tl.minimum(edge, hi) // BLOCK_N * BLOCK_N, end)
            qpos = tok
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_kh
        for start in range(lo, full, BLOCK_N):
            acc, m_i, l_i = _extend_block(acc, m_i, l_i, q, k_base, v_base, kv_index, kv_begin,
                                          start, hi, lim, offs_d, d_valid, stride_kt, qk_scale,
                                          entry_turns, turn_cos, turn_sin, qpos, k_pos,
                                          turn_deltas, window, BLOCK_N, False, PRECISION,
                                          TURN, HEAD_DIM, WINDOW)
        for start in range(tl.maximum(lo, full), end, BLOCK_N):
            acc, m_i, l_i = _extend_block(acc, m_i, l_i, q, k_base, v_base, kv_index, kv_begin,
                                          start, hi, lim, offs_d, d_valid, stride_kt, qk_scale,
                                          entry_turns, turn_cos, turn_sin, qpos, k_pos,
                                          turn_deltas, window, BLOCK_N, True, PRECISION,
                                          TURN, HEAD_DIM, WINDOW)
        if not SPLIT:  # a row sees its own entry at least, so l_i > 0
            out = acc / l_i[:, None]
            tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :], out.to(Out.dtype.element_ty),
                     mask=m_valid[:, None] & d_valid[None, :])
        else:  # a row may see nothing in this slice: lse -inf, skipped by the merge
            seen = l_i > 0
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            row = tl.load(tok_starts + seq) + tok
            base = row * stride_mb + head * stride_mh + split  # mid_lse [T, H, S]
            tl.store(mid_lse + base, lse, mask=m_valid)
            tl.store(mid_o + base[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=m_valid[:, None] & d_valid[None, :])

    # TURN: row b's turns are rows b * max_ranges .. + rot_counts[b] of
    # `ranges` (a row without any skips the turning at run time, so one compiled kernel, and
    # one captured graph, serves batches with and without them).
    # WINDOW: as in the extend kernel, the query at position q_pos[q_rows[b]].
    @triton.jit(do_not_specialize=["rows", "kv_lens", "q_rows", "num_splits", "rot_counts",
                                   "ranges", "max_ranges", "stride_mb", "stride_mh",
                                   "stride_ms", "q_pos", "k_pos", "turn_deltas", "window"])
    def _decode_kernel(
        Q, K, V, table, rows, kv_lens, q_rows, mid_o, mid_lse,
        rot_counts, ranges, turn_cos, turn_sin, max_ranges, q_pos, k_pos, turn_deltas,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
        stride_mb, stride_mh, stride_ms,
        qk_scale, num_splits, window,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        TURN: tl.constexpr, WINDOW: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(kv_lens + b)
        if TURN:
            r_lo = b * max_ranges
            r_hi = r_lo + tl.load(rot_counts + b)
        else:
            r_lo = 0
            r_hi = 0
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
        if WINDOW:
            qpos = tl.load(q_pos + q_row).to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            slots = tl.load(table + row * stride_table + offs_n, mask=n_valid,
                            other=0).to(tl.int64)
            if WINDOW:
                if TURN:  # noqa: SIM108 (compile time); -1 everywhere for a row without turns
                    turn = _range_turns(offs_n, ranges, r_lo, r_hi)
                else:
                    turn = offs_n * 0 - 1
                kpos = _window_positions(slots, n_valid, k_pos, turn, turn_deltas, TURN)
                visible = n_valid & (qpos - kpos < window)
                # Only the positions were loaded: a block out of the window is skipped whole.
                if tl.max(visible.to(tl.int32), 0) > 0:
                    k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                                mask=n_valid[:, None] & d_valid[None, :], other=0.0)
                    if TURN:
                        k = _turn_keys(k, turn, k_base, slots, n_valid, offs_d, d_valid,
                                       stride_kt, turn_cos, turn_sin, HEAD_DIM)
                    acc, m_i, l_i = _decode_fold(acc, m_i, l_i, q, k, v_base, slots,
                                                 n_valid, visible, offs_d, d_valid,
                                                 stride_kt, qk_scale, PRECISION)
            else:
                k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                            mask=n_valid[:, None] & d_valid[None, :], other=0.0)
                if TURN:  # noqa: SIM102 (compile time, then run time per sequence)
                    if r_hi > r_lo:
                        turn = _range_turns(offs_n, ranges, r_lo, r_hi)
                        k = _turn_keys(k, turn, k_base, slots, n_valid, offs_d, d_valid,
                                       stride_kt, turn_cos, turn_sin, HEAD_DIM)
                acc, m_i, l_i = _decode_fold(acc, m_i, l_i, q, k, v_base, slots, n_valid,
                                             n_valid, offs_d, d_valid, stride_kt, qk_scale,
                                             PRECISION)
        # A slice that saw nothing (past the end of a short sequence, or out of the window)
        # leaves lse = -inf and no output; the merge skips it.
        seen = l_i > 0
        # Base 2 throughout: the merge only compares and exponentiates these.
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        base = b * stride_mb + heads * stride_mh + split * stride_ms
        # mid_o is contiguous [B, H, S, D]: its offsets are mid_lse's times HEAD_DIM.
        tl.store(mid_lse + base, lse, mask=h_valid)
        tl.store(mid_o + base[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=(h_valid & seen)[:, None] & d_valid[None, :])

    @triton.jit
    def _decode_fold(acc, m_i, l_i, q, k, v_base, slots, n_valid, visible, offs_d, d_valid,
                     stride_kt, qk_scale, PRECISION: tl.constexpr):
        """A block of K rows and their V folded into the decode's running softmax; some
        entry of the block is `visible`, so every row's maximum is finite."""
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        qk = tl.where(visible[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_kt + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    # The strides of mid_o / mid_lse depend on the split count: never specialised on.
    @triton.jit(do_not_specialize=["q_rows", "num_splits", "stride_mb", "stride_mh"])
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


def _extend_tiles(device: torch.device, dtype: torch.dtype,
                  block_d: int) -> tuple[int, int, int, int]:
    """The extend kernel's BLOCK_M, BLOCK_N, warps and pipeline stages."""
    if device.type != "cuda":  # the interpreter: small tiles keep it quick
        return 16, 16, 1, 1
    if dtype == torch.float32:  # float32 tiles take twice the registers and shared memory
        return 64, 32, 4, 2
    return EXTEND_BLOCK_M, 64, (4 if block_d <= 64 else 8), 3


def extend_packs(max_q_len: int, group: int, block_m: int = EXTEND_BLOCK_M) -> bool:
    """Whether the extend kernel packs each KV head's group of query heads into its tiles'
    rows: when the queries are fewer than a tile's rows (a question over cached chunks, a
    short prompt), which would otherwise leave tiles partly empty and read each K/V block
    once per query head. Longer steps keep one head per tile (as many programs either way)."""
    return group > 1 and max_q_len < block_m


def extend_splits(q_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int,
                  device: torch.device, pack: bool | None = None) -> int:
    """KV slices per (sequence, query block, head): 1 when those already fill the GPU, else
    as many as one wave holds, no slice under 512 entries. One wave, not two: on the H100 the
    warm question (16 packed tiles over 4,288 entries) took 0.99 ms at 8 splits (128 programs
    on 132 SMs), 1.29 at 12 and 1.23 at 16 (bench_gpu.py's sweep), the extra partials' merge
    and a second wave's start costing more than the shorter slices save. `pack`: whether the
    launch packs heads (None: as `extend_packs` decides)."""
    if device.type != "cuda":
        return 1 if max(kv_lens) <= 64 else 2
    group = heads // kv_heads
    if pack is None:
        pack = extend_packs(max(q_lens), group)
    if pack:
        programs = sum(-(-q * group // EXTEND_BLOCK_M) for q in q_lens) * kv_heads
    else:
        programs = sum(-(-q // EXTEND_BLOCK_M) for q in q_lens) * heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, sms // programs, max(kv_lens) // 512))


@dataclass(slots=True)
class DecodeTurns:
    """The turns of a decode launch (model/reposition.py).

    `ranges`: int32 rows of (start, end, table row), entries start .. end-1 of a sequence's KV
    list seen turned by row `table row` of `cos` / `sin` ([rows, head_dim] float32, turning a
    key forward by its delta); `index`: how many rows each sequence has ([B]), its rows
    starting at b * `max_ranges`. (A decode row's turns are searched per KV block: its list is
    read on the device, as CUDA graphs need. Extend launches carry a turn row per entry
    instead, `entry_turns`.)"""

    ranges: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    index: torch.Tensor
    max_ranges: int = 0


@dataclass(slots=True)
class SlidingWindow:
    """What a launch needs to apply a sliding window: its width, each query row's position
    (by row of q, int64), each slot's key position (`KVPool.pos`, int32) and, where keys are
    turned, each turn-table row's delta (`TurnTable.deltas`)."""

    size: int
    query_positions: torch.Tensor
    slot_positions: torch.Tensor
    turn_deltas: torch.Tensor | None = None


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, kv_index: torch.Tensor, kv_indptr: torch.Tensor,
                     q_starts: torch.Tensor, q_lens: torch.Tensor, max_q_len: int,
                     scale: float, splits: int = 1, tok_starts: torch.Tensor | None = None,
                     merge_rows: torch.Tensor | None = None,
                     q_limit: torch.Tensor | None = None,
                     entry_turns: torch.Tensor | None = None,
                     turn_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                     pack: bool | None = None, window: SlidingWindow | None = None) -> None:
    """Attention of the sequences' query rows of `q` [T, H, D] over their ragged slot lists
    (`kv_index[kv_indptr[i]:kv_indptr[i+1]]`), bottom-right causal, written into `out`.

    `tok_starts` (int32 on the device): each sequence's first place among the launch's query
    tokens, needed with `splits` > 1 (with `merge_rows`, each such token's row of `q`) or
    `q_limit` (int32 per query token, by that place: the last entry of the list it sees,
    replacing the bottom-right diagonal). `entry_turns` (int32 beside `kv_index`): each entry's
    row of `turn_tables` (cos, sin turning a key forward by a delta), -1 for none. `pack`:
    the group's heads share tiles (see `extend_packs`, which decides when None). `window`:
    the sliding window of the layer (with `entry_turns`, its `turn_deltas` too)."""
    num_seqs = q_starts.numel()
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[1]
    block_d = max(16, _next_pow2(head_dim))
    # float32 stays float32 (exact); tf32 only matters for float32 inputs anyway.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_m, block_n, num_warps, num_stages = _extend_tiles(q.device, q.dtype, block_d)
    if pack is None:
        pack = extend_packs(max_q_len, group, block_m)
    if splits > 1:
        mid_o, mid_lse = decode_scratch(merge_rows.numel(), heads, head_dim, splits, q.device)
    else:
        mid_o, mid_lse = out, out  # unused
    unused = q_starts
    turning = entry_turns is not None
    if pack:
        grid = (num_seqs, triton.cdiv(max_q_len * group, block_m), heads // group * splits)
    else:
        grid = (num_seqs, triton.cdiv(max_q_len, block_m), heads * splits)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, kv_index, kv_indptr, q_starts, q_lens,
        unused if tok_starts is None else tok_starts, mid_o, mid_lse,
        entry_turns if turning else unused, turn_tables[0] if turning else out,
        turn_tables[1] if turning else out, unused if q_limit is None else q_limit,
        *_window_args(window, turning, unused),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), mid_lse.stride(0), mid_lse.stride(1), scale * _LOG2E,
        splits, 0 if window is None else window.size,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION=precision, SPLIT=splits > 1, TURN=turning,
        INDEXED=q_limit is not None, PACK=pack, WINDOW=window is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _merge_kernel[(merge_rows.numel(), heads)](
            mid_o, mid_lse, out, merge_rows, out.stride(0), out.stride(1),
            mid_lse.stride(0), mid_lse.stride(1), splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _next_pow2(splits)),
            num_warps=4 if q.device.type == "cuda" else 1,
        )


def _window_args(window: SlidingWindow | None, turning: bool,
                 unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' q_pos, k_pos, turn_deltas arguments (`unused` where there is none)."""
    if window is None:
        return unused, unused, unused
    if turning and window.turn_deltas is None:
        raise ValueError("a sliding window over turned keys needs the turns' deltas")
    return (window.query_positions, window.slot_positions,
            window.turn_deltas if turning else unused)


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
                     scale: float, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                     turns: DecodeTurns | None = None,
                     window: SlidingWindow | None = None) -> None:
    """One query row per sequence (`q[q_rows[b]]`) over the first `kv_lens[b]` slots of
    `table[rows[b]]`, written into `out[q_rows[b]]`. Reads lengths, rows, re-positioned
    ranges (`turns`) and positions (`window`) on the device only, so a captured graph
    replays it for any of them."""
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
    turning = turns is not None
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, table, rows, kv_lens, q_rows, mid_o, mid_lse,
        turns.index if turning else rows, turns.ranges if turning else rows,
        turns.cos if turning else mid_o, turns.sin if turning else mid_o,
        turns.max_ranges if turning else 0, *_window_args(window, turning, rows),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        scale * _LOG2E, num_splits, 0 if window is None else window.size,
        GROUP=group, BLOCK_H=max(16, _next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, PRECISION=precision, TURN=turning, WINDOW=window is not None,
        num_warps=4 if cuda else 1, num_stages=2 if cuda else 1,
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
