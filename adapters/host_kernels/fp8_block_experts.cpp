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
#include <stdexcept>
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

constexpr int MAX_VECTORS = 4;  // vectors a weight pass serves: 12 accumulators at 4, within AVX2's 16 registers

// y[j][yo + i] = sum over k-blocks of scale[(r + i) / 128, kb] * sum_k w[r + i, k] x[j][k], for ROWS rows from r
// of an e4m3 [rows, cols] matrix with fp32 scales [ceil(rows/128), ceil(cols/128)] and NT vectors x[j].
// NOTE: every (row, vector) pair runs the same operations in the same order whatever ROWS and NT are, so a
// pair's result never depends on which others share its expert (the tests compare bits; it needs the build's
// -ffp-contract=off, see fp8_block_experts.py's CFLAGS). The weights are
// converted once for all NT vectors: a conversion costs ~9 vector operations a 16 bytes, a vector's FMAs 2.
// ROWS rows share each load of x; a block's products stay in vector accumulators and its scale is applied as
// one vector FMA, so a row pays one horizontal sum, not one a block.
template <int ROWS, int NT>
inline void gemv_tile(const uint8_t* w, const float* scale, const float* const* x, int cols, int r,
                      float* const* y, int64_t yo) {
  const int kblocks = (cols + BLOCK - 1) / BLOCK;
  const uint8_t* row[ROWS];
  const float* srow[ROWS];
  float tail[ROWS][NT];
  for (int i = 0; i < ROWS; ++i) {
    row[i] = w + static_cast<int64_t>(r + i) * cols;
    srow[i] = scale + static_cast<int64_t>((r + i) / BLOCK) * kblocks;
    for (int j = 0; j < NT; ++j) tail[i][j] = 0.0f;
  }
#ifdef FT_SIMD
  __m256 total[ROWS][NT];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < NT; ++j) total[i][j] = _mm256_setzero_ps();
#endif
  for (int kb = 0; kb < kblocks; ++kb) {
    const int k0 = kb * BLOCK, n = std::min(BLOCK, cols - k0);
    int k = 0;
#ifdef FT_SIMD
    __m256 lo[ROWS][NT], hi[ROWS][NT];  // two chains a (row, vector): the FMA latency hidden
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NT; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    for (; k + 16 <= n; k += 16) {
      __m256 x0[NT], x1[NT];
      for (int j = 0; j < NT; ++j) {
        x0[j] = _mm256_loadu_ps(x[j] + k0 + k);
        x1[j] = _mm256_loadu_ps(x[j] + k0 + k + 8);
      }
      for (int i = 0; i < ROWS; ++i) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[i] + k0 + k));
        const __m256 wl = e4m3_half(b, false), wh = e4m3_half(b, true);
        for (int j = 0; j < NT; ++j) {
          lo[i][j] = _mm256_fmadd_ps(wl, x0[j], lo[i][j]);
          hi[i][j] = _mm256_fmadd_ps(wh, x1[j], hi[i][j]);
        }
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NT; ++j)
        total[i][j] = _mm256_fmadd_ps(_mm256_add_ps(lo[i][j], hi[i][j]), _mm256_set1_ps(srow[i][kb]), total[i][j]);
#endif
    for (; k < n; ++k)
      for (int i = 0; i < ROWS; ++i) {
        const float wk = srow[i][kb] * (e4m3_scalar(row[i][k0 + k]) / FP16_OFFSET);
        for (int j = 0; j < NT; ++j) tail[i][j] += wk * x[j][k0 + k];
      }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < NT; ++j) {
#ifdef FT_SIMD
      tail[i][j] += hsum(total[i][j]);
#endif
      y[j][yo + i] = tail[i][j] * FP16_OFFSET;
    }
}

template <int ROWS, int NT>
inline void gemv_span(const uint8_t* w, const float* scale, const float* const* x, int cols, int r0, int r1,
                      float* const* y) {
  int r = r0;
  for (; r + ROWS <= r1; r += ROWS) gemv_tile<ROWS, NT>(w, scale, x, cols, r, y, r - r0);
  for (; r < r1; ++r) gemv_tile<1, NT>(w, scale, x, cols, r, y, r - r0);
}

// y[j][r - r0] for rows [r0, r1) and nt vectors x[j] (pairs of one expert), nt in 1..MAX_VECTORS: the callers
// hand a group's pairs over MAX_VECTORS at a time (their pointer arrays are that long)
inline void gemv_rows(const uint8_t* w, const float* scale, const float* const* x, int nt, int cols, int r0,
                      int r1, float* const* y) {
  switch (nt) {
    case 1: gemv_span<2, 1>(w, scale, x, cols, r0, r1, y); break;
    case 2: gemv_span<2, 2>(w, scale, x, cols, r0, r1, y); break;
    case 3: gemv_span<1, 3>(w, scale, x, cols, r0, r1, y); break;
    case MAX_VECTORS: gemv_span<1, MAX_VECTORS>(w, scale, x, cols, r0, r1, y); break;
    default: throw std::logic_error("gemv_rows takes 1 to MAX_VECTORS vectors");
  }
}

// The pairs grouped by bank row: order [P] lists pair indices by (row, index), group g is
// order[start[g] .. start[g + 1]) (ascending pair order within a group). Sorts in place: no allocation once
// the vectors have grown to P (the host lane calls this for every request).
inline void group_by_row(const int64_t* rid, int64_t P, std::vector<int64_t>& order, std::vector<int64_t>& start) {
  order.resize(P);
  for (int64_t p = 0; p < P; ++p) order[p] = p;
  std::sort(order.begin(), order.end(), [rid](int64_t a, int64_t b) { return rid[a] != rid[b] ? rid[a] < rid[b] : a < b; });
  start.clear();
  for (int64_t i = 0; i < P; ++i)
    if (i == 0 || rid[order[i]] != rid[order[i - 1]]) start.push_back(i);
  start.push_back(P);
}

// The pairs of each token in pair order: token t's are pairs[first[t] .. first[t + 1]). O(T * P), a few thousand
// comparisons at a decode step's sizes; no allocation once the vectors have grown.
inline void pairs_by_token(const int64_t* tok, int64_t T, int64_t P, std::vector<int64_t>& pairs,
                           std::vector<int64_t>& first) {
  pairs.clear();
  first.clear();
  for (int64_t t = 0; t < T; ++t) {
    first.push_back(static_cast<int64_t>(pairs.size()));
    for (int64_t p = 0; p < P; ++p)
      if (tok[p] == t) pairs.push_back(p);
  }
  first.push_back(static_cast<int64_t>(pairs.size()));
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
  // NOTE: an expert shared by several pairs (the rows of a batch that route alike: the customer's benchmark sends
  // one prompt to every request) is read and converted once for up to MAX_VECTORS of them at a time
  // NOTE: the jobs read the grouping through plain pointers: a thread_local named inside a job would be the
  // running worker's own (empty) instance, not the caller's
  thread_local std::vector<int64_t> order_buf, start_buf, token_pairs_buf, token_first_buf, routed_buf;
  group_by_row(rid, P, order_buf, start_buf);
  pairs_by_token(tok, T, P, token_pairs_buf, token_first_buf);
  const int64_t *order = order_buf.data(), *start = start_buf.data();
  const int64_t *token_pairs = token_pairs_buf.data(), *token_first = token_first_buf.data();
  const int64_t groups = static_cast<int64_t>(start_buf.size()) - 1;
  // NOTE: the output rows of tokens without a pair are zeroed here, and the per-token phases below get jobs for
  // the routed tokens only: a job is one claim on the team's shared ticket, and with T rows handed over and one
  // routed the H100 machine's hand-off grew ~15-23 us a row at 15 threads (bench_host_experts --round-trip, "one";
  // docs/fast-decode.md, session 43), which these empty jobs are taken to be. The routed tokens' jobs and sums are
  // the same as before
  routed_buf.clear();
  for (int64_t t = 0; t < T; ++t) {
    if (token_first[t + 1] > token_first[t]) routed_buf.push_back(t);
    else std::fill(o + t * H, o + (t + 1) * H, 0.0f);
  }
  const int64_t* routed = routed_buf.data();
  const int64_t n_routed = static_cast<int64_t>(routed_buf.size());
  // phase 1: gate and up rows of every pair, jobs of grain_rows output rows of one expert
  const int64_t gate_chunks = (I + grain_rows - 1) / grain_rows;
  for_each_job(for_each, groups * gate_chunks, [&](int64_t job) {
    const int64_t g = job / gate_chunks, r0 = (job % gate_chunks) * grain_rows, r1 = std::min(I, r0 + grain_rows);
    const int n = static_cast<int>(r1 - r0);
    const uint8_t* row = rows + rid[order[start[g]]] * R;
    thread_local std::vector<float> gu;  // the running worker's: [MAX_VECTORS, n] gate rows, then as many up rows
    gu.resize(2 * MAX_VECTORS * static_cast<size_t>(n));
    for (int64_t j0 = start[g]; j0 < start[g + 1]; j0 += MAX_VECTORS) {
      const int nt = static_cast<int>(std::min<int64_t>(MAX_VECTORS, start[g + 1] - j0));
      const float* xv[MAX_VECTORS];
      float *gv[MAX_VECTORS], *uv[MAX_VECTORS];
      for (int j = 0; j < nt; ++j) {
        xv[j] = xs + tok[order[j0 + j]] * H;
        gv[j] = gu.data() + static_cast<int64_t>(j) * n;
        uv[j] = gu.data() + static_cast<int64_t>(MAX_VECTORS + j) * n;
      }
      gemv_rows(row + off[0], reinterpret_cast<const float*>(row + off[1]), xv, nt, H, r0, r1, gv);
      gemv_rows(row + off[2], reinterpret_cast<const float*>(row + off[3]), xv, nt, H, r0, r1, uv);
      for (int j = 0; j < nt; ++j)
        for (int i = 0; i < n; ++i) a[order[j0 + j] * I + r0 + i] = silu(gv[j][i]) * uv[j][i];
    }
  });
  const int64_t down_chunks = (H + grain_rows - 1) / grain_rows;
  if (groups == P) {
    // phase 2, no expert shared (a bs1 request, or rows that route apart): each token's down rows and the sum of
    // its pairs in pair order in one job, as two phases would give them, one team wake-up fewer
    for_each_job(for_each, n_routed * down_chunks, [&](int64_t job) {
      const int64_t t = routed[job / down_chunks], r0 = (job % down_chunks) * grain_rows;
      const int64_t r1 = std::min(H, r0 + grain_rows);
      thread_local std::vector<float> yt;
      yt.resize(r1 - r0);
      float* yv[1] = {yt.data()};
      float* ot = o + t * H;
      std::fill(ot + r0, ot + r1, 0.0f);
      for (int64_t i = token_first[t]; i < token_first[t + 1]; ++i) {
        const int64_t p = token_pairs[i];
        const uint8_t* row = rows + rid[p] * R;
        const float* av[1] = {a + p * I};
        gemv_rows(row + off[4], reinterpret_cast<const float*>(row + off[5]), av, 1, I, r0, r1, yv);
        for (int64_t r = r0; r < r1; ++r) ot[r] += pw[p] * yt[r - r0];
      }
    });
    return;
  }
  // phase 2: down rows of every pair, jobs of grain_rows output rows of one expert, into y [P, H] (act's tail)
  float* y = a + P * I;
  for_each_job(for_each, groups * down_chunks, [&](int64_t job) {
    const int64_t g = job / down_chunks, r0 = (job % down_chunks) * grain_rows, r1 = std::min(H, r0 + grain_rows);
    const uint8_t* row = rows + rid[order[start[g]]] * R;
    for (int64_t j0 = start[g]; j0 < start[g + 1]; j0 += MAX_VECTORS) {
      const int nt = static_cast<int>(std::min<int64_t>(MAX_VECTORS, start[g + 1] - j0));
      const float* av[MAX_VECTORS];
      float* yv[MAX_VECTORS];
      for (int j = 0; j < nt; ++j) {
        av[j] = a + order[j0 + j] * I;
        yv[j] = y + order[j0 + j] * H + r0;
      }
      gemv_rows(row + off[4], reinterpret_cast<const float*>(row + off[5]), av, nt, I, r0, r1, yv);
    }
  });
  // phase 3: each routed token's pairs summed in pair order, one job a token (the same sum whichever thread runs
  // it); the other rows of out were zeroed above
  for_each_job(for_each, n_routed, [&](int64_t job) {
    const int64_t t = routed[job];
    float* ot = o + t * H;
    std::fill(ot, ot + H, 0.0f);
    for (int64_t i = token_first[t]; i < token_first[t + 1]; ++i) {
      const int64_t p = token_pairs[i];
      const float* yp = y + p * H;
      for (int64_t r = 0; r < H; ++r) ot[r] += pw[p] * yp[r];
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
  auto act = torch::empty({P, inter + H}, x.options());  // activations, then down outputs
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
