// Block-FP8 experts computed on the host CPU, reading packed bank rows in place (ADR 0030).
//
// Shape legend: T tokens, P (token, expert) pairs, H hidden, I expert intermediate, R row bytes.
// For every pair p: act[p] = silu(gate_e x_t) * up_e x_t (fp32 [I]), then
// out[t] = sum over t's pairs, in pair order, of weight[p] * down_e act[p] (fp32 [H]).
// Weights stay e4m3 with fp32 128x128 block scales (w = data * scale, adapters/checkpoint/quant.py);
// nothing dequantized is stored: each 16-byte run of e4m3 becomes fp16 bits and then fp32 in registers.
//
// e4m3 -> fp16 bits: sign << 15 | (byte & 0x7F) << 7 puts e4m3's 4 exponent and 3 mantissa bits
// where fp16 keeps its low exponent and top mantissa bits; the fp16 value is then the e4m3 value
// times 2^-8, for normals and subnormals alike (fp16's bias is 15, e4m3's 7), and the hardware
// converts fp16 subnormals to fp32 exactly. The 2^8 is applied once per block with the scale.
#include "fp8_block_experts.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define FT_SIMD 1
#endif

namespace {

constexpr int BLOCK = 128;
constexpr float FP16_OFFSET = 256.0f;  // 2^8: e4m3 value = fp16(bits) * 2^8

inline float e4m3_scalar(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 0x7;
  const float v = exp ? std::ldexp(1.0f + man / 8.0f, exp - 7) : std::ldexp(man / 8.0f, -6);
  return sign ? -v : v;
}

#ifdef FT_SIMD
// 16 bytes of e4m3 -> 16 fp32 (two halves) times 2^-8.
// NOTE: byte b in a 16-bit lane's high half, shifted right by one with sign extension, is
// s s eeee mmm 0000000: clearing bit 14 leaves sign << 15 | (b & 0x7F) << 7 in three operations
inline __m256 e4m3_half(__m128i b, bool high) {
  const __m128i zero = _mm_setzero_si128(), clear14 = _mm_set1_epi16(static_cast<int16_t>(0xBFFF));
  const __m128i u = high ? _mm_unpackhi_epi8(zero, b) : _mm_unpacklo_epi8(zero, b);
  return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(u, 1), clear14));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

// y[r - r0] = sum over k-blocks of scale[r / 128, kb] * sum_k w[r, k] x[k] for rows [r0, r1) of an e4m3
// [rows, cols] matrix with fp32 scales [ceil(rows/128), ceil(cols/128)].
// NOTE: ROWS rows at a time share each load of x; a block's products stay in vector accumulators and its scale
// is applied as one vector FMA, so a row pays one horizontal sum, not one a block (1.3x on the dev box's cores,
// where the conversions' shuffles are the bound; the sum's order is fixed by the code, not by threads)
template <int ROWS>
inline void gemv_rows_by(const uint8_t* w, const float* scale, const float* x, int cols, int r, float* y) {
  const int kblocks = (cols + BLOCK - 1) / BLOCK;
  const uint8_t* row[ROWS];
  const float* srow[ROWS];
  float tail[ROWS];
  for (int i = 0; i < ROWS; ++i) {
    row[i] = w + static_cast<int64_t>(r + i) * cols;
    srow[i] = scale + static_cast<int64_t>((r + i) / BLOCK) * kblocks;
    tail[i] = 0.0f;
  }
#ifdef FT_SIMD
  __m256 total[ROWS];
  for (int i = 0; i < ROWS; ++i) total[i] = _mm256_setzero_ps();
#endif
  for (int kb = 0; kb < kblocks; ++kb) {
    const int k0 = kb * BLOCK, n = std::min(BLOCK, cols - k0);
    int k = 0;
#ifdef FT_SIMD
    __m256 lo[ROWS], hi[ROWS];  // two chains a row: the FMA latency hidden
    for (int i = 0; i < ROWS; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (; k + 16 <= n; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k0 + k), x1 = _mm256_loadu_ps(x + k0 + k + 8);
      for (int i = 0; i < ROWS; ++i) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[i] + k0 + k));
        lo[i] = _mm256_fmadd_ps(e4m3_half(b, false), x0, lo[i]);
        hi[i] = _mm256_fmadd_ps(e4m3_half(b, true), x1, hi[i]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      total[i] = _mm256_fmadd_ps(_mm256_add_ps(lo[i], hi[i]), _mm256_set1_ps(srow[i][kb]), total[i]);
#endif
    for (; k < n; ++k)
      for (int i = 0; i < ROWS; ++i) tail[i] += srow[i][kb] * (e4m3_scalar(row[i][k0 + k]) / FP16_OFFSET) * x[k0 + k];
  }
  for (int i = 0; i < ROWS; ++i) {
#ifdef FT_SIMD
    tail[i] += hsum(total[i]);
#endif
    y[i] = tail[i] * FP16_OFFSET;
  }
}

inline void gemv_rows(const uint8_t* w, const float* scale, const float* x, int cols, int r0, int r1, float* y) {
  int r = r0;
  for (; r + 2 <= r1; r += 2) gemv_rows_by<2>(w, scale, x, cols, r, y + (r - r0));
  if (r < r1) gemv_rows_by<1>(w, scale, x, cols, r, y + (r - r0));
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

inline void for_each_job(const fluxtide::ForEach& for_each, int64_t n, const std::function<void(int64_t)>& job) {
  if (for_each) {
    for_each(n, job);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) job(j);
  });
}

}  // namespace

void fluxtide::fp8_block_experts_into(const float* xs, int64_t T, int64_t H, const uint8_t* rows, int64_t R,
                                     const int64_t* tok, const int64_t* rid, const float* pw, int64_t P,
                                     const int64_t* off, int64_t I, int64_t grain_rows, float* a, float* o,
                                     const ForEach& for_each) {
  // phase 1: gate and up rows of every pair, split into jobs of grain_rows output rows
  const int64_t gate_chunks = (I + grain_rows - 1) / grain_rows;
  for_each_job(for_each, P * gate_chunks, [&](int64_t job) {
    const int64_t p = job / gate_chunks, r0 = (job % gate_chunks) * grain_rows, r1 = std::min(I, r0 + grain_rows);
    std::vector<float> g(r1 - r0), u(r1 - r0);
    const uint8_t* row = rows + rid[p] * R;
    const float* xt = xs + tok[p] * H;
    gemv_rows(row + off[0], reinterpret_cast<const float*>(row + off[1]), xt, H, r0, r1, g.data());
    gemv_rows(row + off[2], reinterpret_cast<const float*>(row + off[3]), xt, H, r0, r1, u.data());
    for (int64_t r = r0; r < r1; ++r) a[p * I + r] = silu(g[r - r0]) * u[r - r0];
  });
  // phase 2: down rows per token, the token's pairs summed in pair order (the same sum whichever thread runs a
  // job); each job zeroes its rows first, so out needs no clearing and a token without pairs gets zeros
  const int64_t down_chunks = (H + grain_rows - 1) / grain_rows;
  for_each_job(for_each, T * down_chunks, [&](int64_t job) {
    const int64_t t = job / down_chunks, r0 = (job % down_chunks) * grain_rows, r1 = std::min(H, r0 + grain_rows);
    std::vector<float> y(r1 - r0);
    std::fill(o + t * H + r0, o + t * H + r1, 0.0f);
    for (int64_t p = 0; p < P; ++p) {
      if (tok[p] != t) continue;
      const uint8_t* row = rows + rid[p] * R;
      gemv_rows(row + off[4], reinterpret_cast<const float*>(row + off[5]), a + p * I, I, r0, r1, y.data());
      for (int64_t r = r0; r < r1; ++r) o[t * H + r] += pw[p] * y[r - r0];
    }
  });
}

// x fp32 [T, H]; bank uint8 [N, R] (rows packed by ExpertLayout); pair_token / pair_row int64 [P];
// pair_weight fp32 [P]; offsets int64 [6]: gate data, gate scale, up data, up scale, down data, down scale
// (bytes into a row). Returns fp32 [T, H].
torch::Tensor fp8_block_experts(torch::Tensor x, torch::Tensor bank, torch::Tensor pair_token,
                                torch::Tensor pair_row, torch::Tensor pair_weight, torch::Tensor offsets,
                                int64_t inter, int64_t grain_rows) {
  const int64_t T = x.size(0), H = x.size(1), P = pair_token.size(0);
  auto out = torch::empty({T, H}, x.options());
  auto act = torch::empty({P, inter}, x.options());
  fluxtide::fp8_block_experts_into(x.data_ptr<float>(), T, H, bank.data_ptr<uint8_t>(), bank.size(1),
                                   pair_token.data_ptr<int64_t>(), pair_row.data_ptr<int64_t>(),
                                   pair_weight.data_ptr<float>(), P, offsets.data_ptr<int64_t>(), inter,
                                   grain_rows, act.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

bool simd_build() {
#ifdef FT_SIMD
  return true;
#else
  return false;
#endif
}

// NOTE: host_lane.cpp compiles this file into its own module (-DFLUXTIDE_FP8_EMBEDDED), which binds what it needs
#ifndef FLUXTIDE_FP8_EMBEDDED
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_block_experts", &fp8_block_experts, "block-FP8 experts on the host (ADR 0030)");
  m.def("simd_build", &simd_build, "whether the AVX2/F16C/FMA path was compiled in");
}
#endif
