"""Block-sparse FlashAttention-2 in Triton: forward, and a backward without atomics.

Scores are kept in the log2 domain (``qk * scale * log2 e``), the forward saves the log-sum-exp per row
(``+inf`` for a row with nothing to attend to, so its probabilities are 0 in the backward). Each program
visits only its tile's non-empty key blocks: first the partial ones, with their element mask loaded from
``MASKS``, then the full ones, with no mask but the sequence bounds. The backward recomputes the scores:
one kernel per key tile accumulates dK and dV over the query blocks of the transposed view (and over the
query heads that share the key head, for GQA), one kernel per query tile accumulates dQ: every output is
written by exactly one program, so the result is deterministic.

Imported only when Triton is; ``TRITON_INTERPRET=1`` must be set before this module is imported to run the
kernels on the CPU. The interpreter's bf16 ``tl.dot`` is unreliable, so under it bf16 tiles are widened to
fp32 before each dot (``UPCAST``).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634


def _patch_interpreter() -> None:
    """Triton's interpreter (3.6) turns a loaded scalar into a loop bound with ``int(array)``, which NumPy 2.4
    refuses for the 1-element arrays it holds ("only 0-dimensional arrays can be converted"); the block lists'
    lengths are such bounds. Read the one element instead. Interpreter only; compiled kernels are untouched."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_gpuwise", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._gpuwise = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _patch_interpreter()


def _configs(names: tuple[str, ...], values: list[tuple[int, ...]]) -> list[triton.Config]:
    out = []
    for *blocks, warps, stages in values:
        out.append(triton.Config(dict(zip(names, blocks, strict=True)), num_warps=warps, num_stages=stages))
    return out


# Hopper-oriented search spaces (FlexAttention's H100 defaults are among them); the key makes each shape
# and dtype tune once. Under the interpreter one config: autotuning several fails there.
_FWD = _configs(("BLOCK_M", "BLOCK_N"), [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                                         (128, 128, 4, 2), (128, 32, 4, 3), (64, 128, 4, 3), (128, 64, 8, 2)])
_BWD = _configs(("BLOCK_M", "BLOCK_N"), [(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 4, 2),
                                         (128, 64, 8, 2), (32, 64, 4, 2), (128, 128, 8, 2)])


def _prune(configs, named_args, **kwargs):
    """Tiles that divide the mask's blocks; big tiles at head_dim 128 only with 8 warps; fp32 (IEEE dots, slow
    to compile at large tiles and no tensor-core speed to tune for) one small tile."""
    bs = named_args["BS"] if "BS" in named_args else kwargs["BS"]
    d = named_args["D"] if "D" in named_args else kwargs["D"]
    q = named_args.get("Q")
    fallback = triton.Config({"BLOCK_M": min(64, bs), "BLOCK_N": min(64, bs)}, num_warps=4, num_stages=2)
    if q is not None and q.dtype == torch.float32:  # about a minute of one-time compilation at head_dim 128
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    kept = [c for c in configs if bs % c.kwargs["BLOCK_M"] == 0 and bs % c.kwargs["BLOCK_N"] == 0
            and not (d == 128 and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 128 * 64 and c.num_warps < 8)]
    return kept or [fallback]


def _tuned(configs, key):
    if INTERPRET:
        return lambda fn: fn  # the launcher passes the interpreter's one config itself
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": _prune})


@triton.jit
def _rows(base, stride, offs, offs_d, n):
    """Rows ``offs`` (those below ``n``; zeros past it) of a (seq, head_dim) matrix with row stride ``stride``."""
    return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=(offs < n)[:, None], other=0.0)


@triton.jit
def _query_tile(H, GROUP, BS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's (batch x head) index, batch, head, key head, query block, query rows and head dims. The
    grid is (query tiles, heads, batch): neighbouring programs share a head's K and V in L2, and neither
    heads nor batch meets CUDA's 65,535 limit on the second and third grid axes at real sizes."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)  # batch offsets past 2^31 elements stay exact
    return b * H + h, b, h, h // GROUP, (pid_m * BLOCK_M) // BS, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), \
        tl.arange(0, D)


@triton.jit
def _attn_bwd_delta(OUT, DO, DELTA, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos, H, SEQ_Q,
                    D: tl.constexpr, BLOCK_M: tl.constexpr):
    """rowsum(O * dO) in fp32 per query row, a tile at a time (no full-size fp32 copies of O and dO)."""
    pid_bh, b, h, _, _, offs_m, offs_d = _query_tile(H, 1, BLOCK_M, D, BLOCK_M)
    o = _rows(OUT + b * stride_ob + h * stride_oh, stride_os, offs_m, offs_d, SEQ_Q).to(tl.float32)
    do = _rows(DO + b * stride_dob + h * stride_doh, stride_dos, offs_m, offs_d, SEQ_Q).to(tl.float32)
    tl.store(DELTA + pid_bh * SEQ_Q + offs_m, tl.sum(o * do, 1), mask=offs_m < SEQ_Q)


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, start_n, offs_m, offs_d, seq_k,
              mask_base, q_local, k_local0, qk_scale,
              BS: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
              PREC: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_k = offs_n < seq_k
    k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=in_k[None, :], other=0.0)
    v = _rows(v_base, stride_vs, offs_n, offs_d, seq_k)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, k, input_precision=PREC) * qk_scale
    keep = in_k[None, :]
    if PARTIAL:
        k_local = k_local0 + tl.arange(0, BLOCK_N)
        em = tl.load(mask_base + q_local[:, None] * BS + k_local[None, :])
        keep = keep & (em != 0)
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no NaN from -inf - -inf
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd(Q, K, V, OUT, LSE, KV_NUM, KV_FULL, KV_IDX, KV_MID, MASKS, qk_scale,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_ob, stride_oh, stride_os, H, GROUP, SEQ_Q, SEQ_K, N_QB, N_KB, MASK_BATCH, TUNE_KEY,
              BS: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh, b, h, hk, qb, offs_m, offs_d = _query_tile(H, GROUP, BS, D, BLOCK_M)
    in_q = offs_m < SEQ_Q
    q = _rows(Q + b * stride_qb + h * stride_qh, stride_qs, offs_m, offs_d, SEQ_Q)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    row = (b % MASK_BATCH) * N_QB + qb
    n_part = tl.load(KV_NUM + row)
    n_full = tl.load(KV_FULL + row)
    q_local = offs_m - qb * BS
    for j in range(0, n_part):
        kb = tl.load(KV_IDX + row * N_KB + j)
        mask_base = MASKS + tl.load(KV_MID + row * N_KB + j).to(tl.int64) * BS * BS
        for sub in tl.static_range(BS // BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs,
                                      kb * BS + sub * BLOCK_N, offs_m, offs_d, SEQ_K, mask_base, q_local,
                                      sub * BLOCK_N, qk_scale, BS, BLOCK_N, True, UPCAST, PREC)
    for j in range(n_part, n_part + n_full):
        kb = tl.load(KV_IDX + row * N_KB + j)
        for sub in tl.static_range(BS // BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs,
                                      kb * BS + sub * BLOCK_N, offs_m, offs_d, SEQ_K, MASKS, q_local,
                                      sub * BLOCK_N, qk_scale, BS, BLOCK_N, False, UPCAST, PREC)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             o.to(OUT.dtype.element_ty), mask=in_q[:, None])
    tl.store(LSE + pid_bh * SEQ_Q + offs_m, lse, mask=in_q)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, start_m, offs_n,
               offs_d, seq_q, seq_k, mask_base, k_local, q_local0, qk_scale,
               BS: tl.constexpr, BLOCK_M: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
               PREC: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_q = offs_m < seq_q
    q = _rows(q_base, stride_qs, offs_m, offs_d, seq_q)
    do = _rows(do_base, stride_dos, offs_m, offs_d, seq_q)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_base + offs_m, mask=in_q, other=float("inf"))
    delta = tl.load(delta_base + offs_m, mask=in_q, other=0.0)
    qkT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M)
    pT = tl.math.exp2(qkT - lse[None, :])
    keep = in_q[None, :] & (offs_n < seq_k)[:, None]
    if PARTIAL:
        q_local = q_local0 + tl.arange(0, BLOCK_M)
        em = tl.load(mask_base + q_local[None, :] * BS + k_local[:, None])
        keep = keep & (em != 0)
    pT = tl.where(keep, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
    dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, Q_NUM, Q_FULL, Q_IDX, Q_MID, MASKS, qk_scale, sm_scale,
                   stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                   stride_vs, stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks,
                   H, HK, GROUP, SEQ_Q, SEQ_K, N_QB, N_KB, MASK_BATCH, TUNE_KEY,
                   BS: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)  # batch offsets past 2^31 elements stay exact
    kb = (pid_n * BLOCK_N) // BS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    in_k = offs_n < SEQ_K
    k = _rows(K + b * stride_kb + hk * stride_kh, stride_ks, offs_n, offs_d, SEQ_K)
    v = _rows(V + b * stride_vb + hk * stride_vh, stride_vs, offs_n, offs_d, SEQ_K)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    row = (b % MASK_BATCH) * N_KB + kb
    n_part = tl.load(Q_NUM + row)
    n_full = tl.load(Q_FULL + row)
    k_local = offs_n - kb * BS
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + (b * H + h) * SEQ_Q
        delta_base = DELTA + (b * H + h) * SEQ_Q
        for j in range(0, n_part):
            qb = tl.load(Q_IDX + row * N_QB + j)
            mask_base = MASKS + tl.load(Q_MID + row * N_QB + j).to(tl.int64) * BS * BS
            for sub in tl.static_range(BS // BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                    qb * BS + sub * BLOCK_M, offs_n, offs_d, SEQ_Q, SEQ_K, mask_base, k_local,
                                    sub * BLOCK_M, qk_scale, BS, BLOCK_M, True, UPCAST, PREC)
        for j in range(n_part, n_part + n_full):
            qb = tl.load(Q_IDX + row * N_QB + j)
            for sub in tl.static_range(BS // BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                    qb * BS + sub * BLOCK_M, offs_n, offs_d, SEQ_Q, SEQ_K, MASKS, k_local,
                                    sub * BLOCK_M, qk_scale, BS, BLOCK_M, False, UPCAST, PREC)
    dk = dk * sm_scale
    out = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]  # DK and DV alike
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=in_k[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=in_k[:, None])


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, start_n, offs_m, offs_d, seq_k,
             mask_base, q_local, k_local0, qk_scale,
             BS: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
             PREC: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_k = offs_n < seq_k
    k = _rows(k_base, stride_ks, offs_n, offs_d, seq_k)
    v = _rows(v_base, stride_vs, offs_n, offs_d, seq_k)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    p = tl.math.exp2(qk - lse[:, None])
    keep = in_k[None, :]
    if PARTIAL:
        k_local = k_local0 + tl.arange(0, BLOCK_N)
        em = tl.load(mask_base + q_local[:, None] * BS + k_local[None, :])
        keep = keep & (em != 0)
    p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, KV_NUM, KV_FULL, KV_IDX, KV_MID, MASKS, qk_scale, sm_scale,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                 stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
                 H, GROUP, SEQ_Q, SEQ_K, N_QB, N_KB, MASK_BATCH, TUNE_KEY,
                 BS: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh, b, h, hk, qb, offs_m, offs_d = _query_tile(H, GROUP, BS, D, BLOCK_M)
    in_q = offs_m < SEQ_Q
    q = _rows(Q + b * stride_qb + h * stride_qh, stride_qs, offs_m, offs_d, SEQ_Q)
    do = _rows(DO + b * stride_dob + h * stride_doh, stride_dos, offs_m, offs_d, SEQ_Q)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * SEQ_Q + offs_m, mask=in_q, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * SEQ_Q + offs_m, mask=in_q, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    row = (b % MASK_BATCH) * N_QB + qb
    n_part = tl.load(KV_NUM + row)
    n_full = tl.load(KV_FULL + row)
    q_local = offs_m - qb * BS
    for j in range(0, n_part):
        kb = tl.load(KV_IDX + row * N_KB + j)
        mask_base = MASKS + tl.load(KV_MID + row * N_KB + j).to(tl.int64) * BS * BS
        for sub in tl.static_range(BS // BLOCK_N):
            dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, kb * BS + sub * BLOCK_N,
                          offs_m, offs_d, SEQ_K, mask_base, q_local, sub * BLOCK_N, qk_scale, BS, BLOCK_N, True,
                          UPCAST, PREC)
    for j in range(n_part, n_part + n_full):
        kb = tl.load(KV_IDX + row * N_KB + j)
        for sub in tl.static_range(BS // BLOCK_N):
            dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, kb * BS + sub * BLOCK_N,
                          offs_m, offs_d, SEQ_K, MASKS, q_local, sub * BLOCK_N, qk_scale, BS, BLOCK_N, False,
                          UPCAST, PREC)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=in_q[:, None])


# Tuned once per power-of-two length (TUNE_KEY, unused in the kernels), not once per length: a run whose
# sequences vary would otherwise re-tune at every new length.
_KEY = ["TUNE_KEY", "D", "BS", "PREC", "GROUP"]
_fwd_kernel = _tuned(_FWD, _KEY)(_attn_fwd)
_dkdv_kernel = _tuned(_BWD, _KEY)(_attn_bwd_dkdv)
_dq_kernel = _tuned(_BWD, _KEY)(_attn_bwd_dq)


def _tune_key(sq: int, sk: int) -> int:
    return triton.next_power_of_2(max(sq, sk))


def _fixed(bs: int) -> dict[str, int]:
    return {"BLOCK_M": bs, "BLOCK_N": bs} if INTERPRET else {}


def _common(q: torch.Tensor) -> dict:
    upcast = INTERPRET and q.dtype == torch.bfloat16
    return {"UPCAST": upcast, "PREC": "ieee" if q.dtype == torch.float32 or upcast else "tf32"}


def forward(q, k, v, tables, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log2-sum-exp per row (B, H, Sq) of block-sparse attention."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)
    bs = mask.block_size
    n_qb, n_kb = tables.kv_indices.shape[1], tables.kv_indices.shape[2]

    def grid(meta):
        return (triton.cdiv(sq, meta["BLOCK_M"]), h, b)

    _fwd_kernel[grid](q, k, v, o, lse, tables.kv_num_blocks, tables.full_kv_num_blocks, tables.kv_indices,
                      tables.kv_mask_ids, tables.masks, scale * LOG2E,
                      *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                      h, h // hk, sq, sk, n_qb, n_kb, tables.kv_num_blocks.shape[0], _tune_key(sq, sk),
                      BS=bs, D=d, **_common(q), **_fixed(bs))
    return o, lse


def backward(do, q, k, v, o, lse, tables, mask, scale: float) -> tuple[torch.Tensor, ...]:
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty((b, h, sq), device=q.device, dtype=torch.float32)  # rowsum(O * dO)
    _attn_bwd_delta[(triton.cdiv(sq, 64), h, b)](o, do, delta, *o.stride()[:3], *do.stride()[:3], h, sq, D=d,
                                                 BLOCK_M=64)
    # dK and dV in one layout (k and v may differ: a view and a copy), which the kernel writes both with
    dq = torch.empty_like(q)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    bs = mask.block_size
    n_qb, n_kb = tables.kv_indices.shape[1], tables.kv_indices.shape[2]
    mask_batch = tables.kv_num_blocks.shape[0]
    common = {**_common(q), **_fixed(bs)}

    def grid_k(meta):
        return (triton.cdiv(sk, meta["BLOCK_N"]), hk, b)

    _dkdv_kernel[grid_k](q, k, v, do, lse, delta, dk, dv, tables.q_num_blocks, tables.full_q_num_blocks,
                         tables.q_indices, tables.q_mask_ids, tables.masks, scale * LOG2E, scale,
                         *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
                         h, hk, h // hk, sq, sk, n_qb, n_kb, mask_batch, _tune_key(sq, sk), BS=bs, D=d,
                         **common)

    def grid_q(meta):
        return (triton.cdiv(sq, meta["BLOCK_M"]), h, b)

    _dq_kernel[grid_q](q, k, v, do, lse, delta, dq, tables.kv_num_blocks, tables.full_kv_num_blocks,
                       tables.kv_indices, tables.kv_mask_ids, tables.masks, scale * LOG2E, scale,
                       *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
                       h, h // hk, sq, sk, n_qb, n_kb, mask_batch, _tune_key(sq, sk), BS=bs, D=d, **common)
    return dq, dk, dv


assert math.isclose(LOG2E, 1 / math.log(2))
