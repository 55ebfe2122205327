// The block-FP8 host expert kernel on raw pointers, for C++ callers inside another extension module
// (host_lane.cpp builds fp8_block_experts.cpp into its own module with -DFLUXTIDE_FP8_EMBEDDED).
//
// Shape legend: T tokens, P (token, expert) pairs, H hidden, I expert intermediate, R row bytes.
#pragma once

#include <cstdint>
#include <functional>

namespace fluxtide {

// out fp32 [T, H] = for each token the router-weighted sum, over its pairs in pair order, of
// down(silu(gate x) * up x) with the expert read from bank row pair_row[p] (fp8_block_experts.py's contract).
// Every row of out is written, zero where a token has no pair; act is fp32 [P, I + H] scratch. bank is uint8
// [N, R]; offsets int64 [6] (gate/up/down data and scale byte offsets in a row). Inputs are trusted: the
// caller checks tokens < T and rows < N. for_each(n, job) must call job(j) once for every j in [0, n), in any
// order, from any threads, and return when all are done (the host lane passes its SpinTeam's run); empty: ATen's
// parallel_for on the calling thread's OpenMP team. Jobs write disjoint outputs: the result does not depend on it.
using ForEach = std::function<void(int64_t, const std::function<void(int64_t)>&)>;
void fp8_block_experts_into(const float* x, int64_t T, int64_t H, const uint8_t* bank, int64_t R,
                            const int64_t* pair_token, const int64_t* pair_row, const float* pair_weight,
                            int64_t P, const int64_t* offsets, int64_t I, int64_t grain_rows, float* act,
                            float* out, const ForEach& for_each = {});

}  // namespace fluxtide
