// Micro-kernels of the CPU kernel (skip_attn_cpu.cpp): S = Q K^T and O += P V, fp32 arithmetic.
//
// B operands (type B: float, bf16_t or f16_t, widened to fp32 as they are loaded): the cpu-packed
// page of an fp32 / bf16 / fp16 cache read in place (K dim-major: 16 positions per row of a panel;
// V token-major: one row per position), or the fp32 gather buffers every other cache type and
// layout is converted into.
#pragma once

#include <algorithm>
#include <cstddef>

#include "sa_simd.h"

namespace sa {

constexpr int TILE_K = 64;  // checked against _common.TILE_K at load (sa_layout)
constexpr int PANEL = 16;   // KV positions per Q.K^T column panel
constexpr int MR = 6;       // rows per micro-kernel block

// Register blocking: a block is R rows x NP panels of Q.K^T (R x NP V16 accumulators) or R rows x
// W16 V16 columns of P.V.  Every output element is still one FMA chain over d (Q.K^T) or over the
// tile's positions (P.V), in order, whatever the block shape, so the outputs do not depend on it
// (the AVX-512 build stays bit-identical to the AVX2 one).
//   AVX-512 (32 zmm): 6 x 4 = 24 accumulators, 4 B operands, 1 broadcast.  Per d (or position)
//   4 loads + 6 broadcasts feed 24 FMAs, so the FMA ports, not the loads, set the pace; with one
//   16-wide column per block (the AVX2 shape) the loads did, and 6 chains of a 4-cycle FMA
//   left half the FMA slots empty.  Decode (fewer than MR rows, the query heads of one KV head)
//   takes all its rows in one block over the whole 64-position tile: one pass over each K and V
//   row instead of one per query head.
//   AVX2 and the portable build (16 ymm): 6 rows x 1 V16 = 12 ymm; decode one row at a time over
//   the whole tile (4 V16 = 8 ymm), the first row streaming K / V from memory, the others from L1.
#if defined(SA_AVX512)
constexpr int QK_NP = 4, PV_W16 = 4;
constexpr bool DECODE_ROWS_TOGETHER = true;
#else
constexpr int QK_NP = 1, PV_W16 = 1;
constexpr bool DECODE_ROWS_TOGETHER = false;
#endif

// C[r][16p : 16p+16] = sum_d A[r][d] * B_p[d][0:16] for r < R, p < NP: NP column panels of 16 KV
// positions.  A: fp32 rows (lda).  kp[p]: panel p's first dim row; D rows of 16 positions, ldb
// apart (the dim-major K of the cpu-packed page read in place, or the gather buffer).
template <int R, int NP, typename B>
inline void qk_block(const float* A, int lda, const B* const* kp, int64_t ldb, int D, float* C, int ldc,
                     const B* pf = nullptr) {
  V16 c[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) c[r][p] = zero16();
  for (int d = 0; d < D; ++d) {
    V16 b[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) b[p] = load16(kp[p] + d * ldb);
    if (pf)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) __builtin_prefetch(pf + d * ldb + PANEL * p, 0, 2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V16 a = set16(A[r * lda + d]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) c[r][p] = fmadd(a, b[p], c[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) store16(C + r * ldc + PANEL * p, c[r][p]);
}

template <int R, typename B>
__attribute__((noinline)) static void qk_block_np(int NP, const float* A, int lda, const B* const* kp, int64_t ldb,
                                                  int D, float* C, int ldc, const B* pf) {
  switch (NP) {
    case 1: qk_block<R, 1, B>(A, lda, kp, ldb, D, C, ldc); break;
    case 2: qk_block<R, 2, B>(A, lda, kp, ldb, D, C, ldc); break;
    case 3: qk_block<R, 3, B>(A, lda, kp, ldb, D, C, ldc); break;
    default: qk_block<R, 4, B>(A, lda, kp, ldb, D, C, ldc, pf); break;
  }
}

// Not inlined: one copy serves every run_item variant (a quarter of the code, and of the
// compile time, of inlining them), and a call per block costs nothing.
template <typename B>
static void qk_rows(int R, int NP, const float* A, int lda, const B* const* kp, int64_t ldb, int D, float* C, int ldc,
                    const B* pf = nullptr) {
  switch (R) {
    case 1: qk_block_np<1, B>(NP, A, lda, kp, ldb, D, C, ldc, pf); break;
    case 2: qk_block_np<2, B>(NP, A, lda, kp, ldb, D, C, ldc, pf); break;
    case 3: qk_block_np<3, B>(NP, A, lda, kp, ldb, D, C, ldc, pf); break;
    case 4: qk_block_np<4, B>(NP, A, lda, kp, ldb, D, C, ldc, pf); break;
    case 5: qk_block_np<5, B>(NP, A, lda, kp, ldb, D, C, ldc, pf); break;
    default: qk_block_np<6, B>(NP, A, lda, kp, ldb, D, C, ldc, pf); break;
  }
}

// S[r][0 : 16 npanel] = (Q K^T)[r] for the M rows of Q (D apart) and the tile's npanel panels; S rows
// TILE_K apart.  Blocks of the ISA's shape (above).  pf (or null): where the next tile's K starts
// (same ldb); the block that covers the whole tile prefetches it into L2, one 64-byte panel row per
// panel and d, while this tile's rows stream.  Decode reads each K row once, and the hardware
// prefetcher follows neither the dim-major K of a page (a tile is 256 bytes of each 512-byte dim
// row of a 128-token page) nor the jump to the next block: raw decode calls, 1 thread, 9/3/64
// heads, fp32, AVX-512: 4 x 8k 3.05 -> 2.61 ms, 16 x 2k 2.92 -> 2.42 ms into L1; into L2 (more
// misses in flight) 8 x 16k (200 MB, from DRAM) 21.1 -> 19.8 ms.  Two tiles ahead gained nothing.
template <typename B>
inline void qk_tile(int M, const float* Q, int D, const B* const* kp, int npanel, int64_t ldb, float* S,
                    const B* pf = nullptr) {
  if (M < MR && !DECODE_ROWS_TOGETHER && npanel == TILE_K / PANEL) {  // decode, one row at a time
    for (int r = 0; r < M; ++r)
      qk_rows<B>(1, npanel, Q + size_t(r) * D, D, kp, ldb, D, S + size_t(r) * TILE_K, TILE_K, r ? nullptr : pf);
    return;
  }
  for (int rb = 0; rb < M; rb += MR) {
    const int R = std::min(MR, M - rb);
    for (int p = 0; p < npanel; p += QK_NP) {
      const int np = std::min(QK_NP, npanel - p);
      qk_rows<B>(R, np, Q + size_t(rb) * D, D, kp + p, ldb, D, S + size_t(rb) * TILE_K + p * PANEL, TILE_K,
              rb == 0 && np == TILE_K / PANEL ? pf : nullptr);
    }
  }
}

// O_r[col : col+16 W16] += sum_t P_r[t] * V[t][col : col+16 W16] for the R rows P_r / O_r (pointers:
// any subset of an item's rows), t < ntok; V rows by pointer (token-major V read in place through
// the block table, or the gather buffer).
template <int R, int W16, typename B>
inline void pv_block(const float* const* P, const B* const* vrows, int ntok, int col, float* const* O) {
  V16 acc[R][W16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int w = 0; w < W16; ++w) acc[r][w] = load16(O[r] + col + 16 * w);
  for (int t = 0; t < ntok; ++t) {
    const B* v = vrows[t] + col;
    V16 b[W16];
#pragma GCC unroll 4
    for (int w = 0; w < W16; ++w) b[w] = load16(v + 16 * w);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V16 a = set16(P[r][t]);
#pragma GCC unroll 4
      for (int w = 0; w < W16; ++w) acc[r][w] = fmadd(a, b[w], acc[r][w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int w = 0; w < W16; ++w) store16(O[r] + col + 16 * w, acc[r][w]);
}

// The last 8 columns of a head size that is a multiple of 8 but not of 16.
template <int R, typename B>
inline void pv_block8(const float* const* P, const B* const* vrows, int ntok, int col, float* const* O) {
  V8 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = load8(O[r] + col);
  for (int t = 0; t < ntok; ++t) {
    const V8 b = load8(vrows[t] + col);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = fmadd(set1(P[r][t]), b, acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store8(O[r] + col, acc[r]);
}

// Every column of the R rows: blocks of the widest W16 that fits (the ISA's PV_W16, else 1), then 8.
template <int R, typename B>
__attribute__((noinline)) static void pv_block_cols(int W16, const float* const* P, const B* const* vrows, int ntok,
                                                    int D, float* const* O) {
  int col = 0;
  if (W16 >= 4)
    for (; col + 64 <= D; col += 64) pv_block<R, 4, B>(P, vrows, ntok, col, O);
  for (; col + 16 <= D; col += 16) pv_block<R, 1, B>(P, vrows, ntok, col, O);
  if (col < D) pv_block8<R, B>(P, vrows, ntok, col, O);
}

template <typename B>
static void pv_rows(int R, int W16, const float* const* P, const B* const* vrows, int ntok, int D, float* const* O) {
  switch (R) {
    case 1: pv_block_cols<1, B>(W16, P, vrows, ntok, D, O); break;
    case 2: pv_block_cols<2, B>(W16, P, vrows, ntok, D, O); break;
    case 3: pv_block_cols<3, B>(W16, P, vrows, ntok, D, O); break;
    case 4: pv_block_cols<4, B>(W16, P, vrows, ntok, D, O); break;
    case 5: pv_block_cols<5, B>(W16, P, vrows, ntok, D, O); break;
    default: pv_block_cols<6, B>(W16, P, vrows, ntok, D, O); break;
  }
}

// O_r += P_r V for the n rows listed (P rows and O rows by pointer), in blocks of the ISA's shape.
template <typename B>
inline void pv_tile(int n, const float* const* P, const B* const* vrows, int ntok, int D, float* const* O) {
  if (n < MR && !DECODE_ROWS_TOGETHER) {  // decode, one row at a time over all D columns
    for (int r = 0; r < n; ++r) pv_rows<B>(1, 4, P + r, vrows, ntok, D, O + r);
    return;
  }
  for (int rb = 0; rb < n; rb += MR) pv_rows<B>(std::min(MR, n - rb), PV_W16, P + rb, vrows, ntok, D, O + rb);
}

}  // namespace sa
