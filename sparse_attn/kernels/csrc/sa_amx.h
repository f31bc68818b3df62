// AMX-BF16 tile micro-kernels of the CPU kernel (skip_attn_cpu.cpp), built with -DSA_AMX only (which
// implies -DSA_BF16DP: the operands' packing and P's rounding are sa_bf16.h's, shared with the
// AVX512-BF16 micro-kernels that run where the OS refuses the tiles).
//
// What vLLM's own bf16 attention uses on such CPUs (its `amx` ISA): a TDPBF16PS multiplies a
// 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 accumulators in one instruction, about 16
// times the multiply-adds per cycle of 512-bit FMAs.  Used for a bf16 cache's items of 16 rows or more (prefill),
// in blocks of 16 rows; the rows left over, and decode, take the fp32 micro-kernels.
//   S = Q K^T:  A = the item's bf16 query rows as they came (16 rows x 32 of d), B = the tile's keys
//               repacked pairwise along d ("VNNI": row kk holds (K[2kk][j], K[2kk+1][j]) for 16
//               positions j), C = 16 rows x 16 positions; the softmax scale is applied to S after.
//   O += P V:   A = P rounded to bf16 (16 rows x 32 positions), B = V repacked pairwise along
//               positions, C = 16 rows x 16 columns of O, loaded from and stored back to O.
// Each product of two bf16 is exact in fp32; the sums are fp32 in the unit's own order, so these
// rows are not bit-identical to the fp32 micro-kernels' (the float64 tests hold them to the bf16
// tolerance).  P in bf16 is what vLLM's AMX kernel (and GPU flash attention) does too: the row
// sums l stay fp32, from the unrounded P.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "sa_bf16.h"

namespace sa {

// The process's permission to use the tile data state (Linux 5.16+: ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), asked once; without it a tile instruction faults, so the kernel then keeps
// to the fp32 micro-kernels.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Palette 1, tiles 0-7 all 16 rows x 64 bytes: C tiles 0-3, A tile 4, B tile 5.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The tile configuration is per thread and other code on the thread (oneDNN, vLLM's own kernel)
// may change it: set at the start of each item that uses tiles (released at its end).
inline void amx_tile_config() {
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
}

// S[16 rows][0:64] = Qb[16 rows] . K^T over D (D % 32 == 0).  Qb: bf16 rows, D apart.  kpack: the
// tile's keys, D / 2 rows of 64 positions x 2 bf16 (256 bytes a row).  S rows TILE_K (64) apart.
inline void amx_qk16(const uint16_t* Qb, int D, const uint16_t* kpack, float* S) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < D / 32; ++c) {
    _tile_loadd(4, Qb + c * 32, D * 2);
    const uint16_t* kb = kpack + size_t(c) * 16 * 128;
    _tile_loadd(5, kb, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, kb + 32, 256);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, kb + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, kb + 96, 256);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, S, 64 * 4);
  _tile_stored(1, S + 16, 64 * 4);
  _tile_stored(2, S + 32, 64 * 4);
  _tile_stored(3, S + 48, 64 * 4);
}

// O[16 rows][0:D] += Pb[16 rows] . V.  Pb: bf16 rows of 64 positions (128 bytes a row).  vpack:
// 32 rows (position pairs) of D columns x 2 bf16 (4 D bytes a row).  O rows D apart (D % 16 == 0).
inline void amx_pv16(const uint16_t* Pb, const uint16_t* vpack, int D, float* O) {
  int n = 0;
  for (; n + 64 <= D; n += 64) {  // four 16-column tiles at a time
    _tile_loadd(0, O + n, D * 4);
    _tile_loadd(1, O + n + 16, D * 4);
    _tile_loadd(2, O + n + 32, D * 4);
    _tile_loadd(3, O + n + 48, D * 4);
    for (int c = 0; c < 2; ++c) {
      _tile_loadd(4, Pb + c * 32, 128);
      const uint16_t* vb = vpack + size_t(c) * 16 * 2 * D + 2 * n;
      _tile_loadd(5, vb, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, vb + 32, D * 4);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, vb + 64, D * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, vb + 96, D * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, O + n, D * 4);
    _tile_stored(1, O + n + 16, D * 4);
    _tile_stored(2, O + n + 32, D * 4);
    _tile_stored(3, O + n + 48, D * 4);
  }
  for (; n < D; n += 16) {  // the rest, one tile at a time
    _tile_loadd(0, O + n, D * 4);
    for (int c = 0; c < 2; ++c) {
      _tile_loadd(4, Pb + c * 32, 128);
      _tile_loadd(5, vpack + size_t(c) * 16 * 2 * D + 2 * n, D * 4);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, O + n, D * 4);
  }
}

}  // namespace sa
