// SpinTeam (adapters/host_kernels/spin_team.h) under stress, built and run by tests/adapters/test_spin_team.py: teams of
// 1-6 threads, calls of 0 to 131,071 jobs (several 0xFFFF-job batches), sleepy jobs, a throwing job in about one call
// in eight, gaps long enough for the workers to go idle, a team destroyed right after a call. Every call checks that
// each job ran exactly once (plain counters: a double run is also a data race under -fsanitize=thread), with this
// call's function (its tag), saw the inputs written before the call, and that the first exception came back and the
// batches after it did not run. Exit status 1 on any failure (the first 20 printed). Usage: spin_team_stress [ITERS].
#include "spin_team.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>
#include <cstdio>
#include <random>
#include <memory>
#include <string>
using namespace fluxtide;
static int fails = 0;
#define CHECK(c, ...) do { if (!(c)) { if (fails++ < 20) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); } } } while (0)

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 300;
  std::mt19937_64 rng(12345);
  const int64_t sizes[] = {0, 1, 2, 3, 7, 64, 0xFFFF, 0x10000, 0xFFFF + 3, 2 * 0xFFFF, 2 * 0xFFFF + 1};
  std::vector<int64_t> in, out;       // plain memory: TSan checks the happens-before edges
  std::vector<int> count;             // plain counters: a double run is both a race and a count of 2
  long runs = 0, throws = 0;
  for (int threads = 1; threads <= 6; ++threads) {
    for (int rep = 0; rep < 3; ++rep) {
      auto team = std::make_unique<SpinTeam>(threads);
      for (int it = 0; it < iters; ++it) {
        int64_t n = (rng() % 4 == 0) ? sizes[rng() % (sizeof sizes / sizeof *sizes)] : int64_t(rng() % 300);
        in.assign(n, 0); out.assign(n, -1); count.assign(n, 0);
        const int64_t tag = (int64_t(threads) << 40) | (int64_t(rep) << 32) | it;
        for (int64_t j = 0; j < n; ++j) in[j] = tag ^ j;  // inputs written before run
        const int mode = rng() % 8;   // 0: sleepy jobs; 1: a throwing job; else plain
        const int64_t bad = (mode == 1 && n > 0) ? int64_t(rng() % n) : -1;
        bool threw = false;
        try {
          // a fresh std::function temporary per call: fn_ dangles after run returns
          team->run(n, JobFn([&, tag, bad, mode](int64_t j) {
            if (j < 0 || j >= (int64_t)in.size()) { fprintf(stderr, "job out of range %ld\n", (long)j); abort(); }
            if (mode == 0 && (j % 17) == 0) std::this_thread::sleep_for(std::chrono::microseconds(j % 50));
            count[j] += 1;
            out[j] = in[j] ^ tag;  // == j; wrong fn (other tag) gives something else
            if (j == bad) throw std::runtime_error("job " + std::to_string(j));
          }));
        } catch (const std::runtime_error& e) {
          threw = true; ++throws;
          CHECK(std::string(e.what()) == "job " + std::to_string(bad), "wrong exception %s (bad %ld)", e.what(), (long)bad);
        }
        CHECK(threw == (bad >= 0), "threw=%d bad=%ld", threw, (long)bad);
        // jobs of batches before and including the failing one ran once; later batches: not at all
        const int64_t limit = bad >= 0 ? std::min<int64_t>(n, (bad / 0xFFFF + 1) * 0xFFFF) : n;
        for (int64_t j = 0; j < n; ++j) {
          const int want = j < limit ? 1 : 0;
          CHECK(count[j] == want, "threads=%d n=%ld job %ld ran %d times (want %d)", threads, (long)n, (long)j, count[j], want);
          if (want) CHECK(out[j] == j, "threads=%d n=%ld job %ld out %ld", threads, (long)n, (long)j, (long)out[j]);
        }
        ++runs;
        const int gap = rng() % 20;  // sometimes long enough for workers to go idle (5 ms)
        if (gap == 0) std::this_thread::sleep_for(std::chrono::milliseconds(6));
        else if (gap < 4) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
      }
      if (rep == 2) {  // destroy right after a run with work in flight for the workers
        team->run(5, [](int64_t) {});
      }
    }
  }
  fprintf(stderr, "runs=%ld throws=%ld fails=%d\n", runs, throws, fails);
  return fails != 0;
}
