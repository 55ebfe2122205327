// A team of spinning worker threads for the host lane's kernel calls (ADR 0030, "Session 39"): the alternative
// to the OpenMP team that ATen's parallel_for forks twice a request. A bs1 layer gives the host ~1.5 experts
// (~100-200 us of work) every ~250 us; OpenMP's workers (libgomp) spin only briefly when more threads exist
// than cores (torch's own team counts) and then sleep on a futex, so every parallel region may pay a wake-up
// per worker. These workers poll one word for SPIN_FOR after the last job (PAUSE first, then yielding the core
// between polls), then poll every IDLE_SLEEP, and every LONG_SLEEP once idle for LONG_IDLE.
//
// The calling thread is member 0 and works too: a job never waits for a sleeping worker to wake. Jobs are
// claimed one at a time from one ticket word, generation << 32 | jobs << 16 | next: a claim is a compare-and-swap
// on the whole word, so the bound travels with the generation, and a worker reads the batch's function only after
// its claim succeeded (a worker that wakes late never runs a job with another call's function). Every job runs
// exactly once whichever thread takes it (the results do not depend on which thread ran a job: each job writes its
// own outputs). Calls of more than MAX_JOBS jobs run as several batches.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_TEAM_PAUSE() _mm_pause()
#else
#define FT_TEAM_PAUSE() std::this_thread::yield()
#endif

namespace fluxtide {

// run(n, fn) calls fn(j) once for every job j in [0, n), spread over the team, and returns when all are done.
using JobFn = std::function<void(int64_t)>;

class SpinTeam {
 public:
  static constexpr auto SPIN_FOR = std::chrono::milliseconds(5);
  static constexpr auto IDLE_SLEEP = std::chrono::microseconds(100);
  // after LONG_IDLE without a job (an idle server) a worker polls every LONG_SLEEP: the first request after that
  // waits for no worker (the caller works), its workers join within LONG_SLEEP
  static constexpr auto LONG_IDLE = std::chrono::milliseconds(100);
  static constexpr auto LONG_SLEEP = std::chrono::milliseconds(2);
  static constexpr uint32_t PAUSE_POLLS = 4096;

  // threads: the team including the caller of run() (threads - 1 workers are started here); at least 1.
  explicit SpinTeam(int threads) {
    if (threads < 1) throw std::invalid_argument("a spin team needs at least one thread");
    workers_.reserve(threads - 1);
    try {
      for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
    } catch (...) {  // NOTE: a thread that did not start: end the ones that did (joinable threads must not be dropped)
      stop_.store(true, std::memory_order_relaxed);
      for (auto& w : workers_) w.join();
      throw;
    }
  }

  ~SpinTeam() {
    stop_.store(true, std::memory_order_relaxed);
    for (auto& w : workers_) w.join();
  }

  SpinTeam(const SpinTeam&) = delete;
  SpinTeam& operator=(const SpinTeam&) = delete;

  // One call at a time (the lane serves one request at a time). Rethrows, on the caller, the first exception a
  // job raised, after every job of its batch has finished.
  void run(int64_t n, const JobFn& fn) {
    fn_.store(&fn, std::memory_order_relaxed);
    for (int64_t base = 0; base < n; base += MAX_JOBS) {
      const uint64_t jobs = static_cast<uint64_t>(std::min<int64_t>(MAX_JOBS, n - base));
      base_.store(base, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
      error_ = nullptr;
      failed_.store(false, std::memory_order_relaxed);
      generation_ = (generation_ + 1) & 0xFFFFFFFFu;
      // release: a worker that acquires this ticket sees fn_, base_ and the caller's inputs
      ticket_.store(generation_ << 32 | jobs << 16, std::memory_order_release);
      work_on(generation_);
      // acquire: the jobs' outputs. A worker holding the last job may be descheduled: yield after a while
      for (uint32_t polls = 0; done_.load(std::memory_order_acquire) < static_cast<int64_t>(jobs); ++polls)
        backoff(polls);
      if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }

 private:
  static constexpr int64_t MAX_JOBS = 0xFFFF;

  // one poll's wait: PAUSE for the first PAUSE_POLLS polls, then the core yielded to whoever is runnable
  static void backoff(uint32_t polls) {
    if (polls < PAUSE_POLLS) FT_TEAM_PAUSE(); else std::this_thread::yield();
  }

  // Claims and runs jobs of generation gen until none is left or the generation moved on.
  // NOTE: fn_ and base_ are read only after a claim succeeded: the claim reads from the release sequence of this
  // batch's ticket store, so they are this batch's (the caller replaces them only after every job is done, and this
  // job is not). Read before a claim they could belong to a finished call (a dangling fn_) or, after the 32-bit
  // generation wrapped, pair a stale function with a recycled ticket.
  void work_on(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && (t & 0xFFFFu) < ((t >> 16) & 0xFFFFu)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const JobFn& fn = *fn_.load(std::memory_order_relaxed);
      const int64_t base = base_.load(std::memory_order_relaxed);
      try {
        fn(base + static_cast<int64_t>(t & 0xFFFFu));
      } catch (...) {  // NOTE: nothing may leave a worker thread: keep the first, the caller rethrows it
        if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void work() {
    uint64_t seen = 0;
    auto last_job = std::chrono::steady_clock::now();
    uint32_t polls = 0;
    bool idle = false;
    while (!stop_.load(std::memory_order_relaxed)) {
      const uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) {
        seen = gen;
        work_on(gen);
        last_job = std::chrono::steady_clock::now();
        idle = false;
        polls = 0;
        continue;
      }
      if (idle) {
        std::this_thread::sleep_for(std::chrono::steady_clock::now() - last_job > LONG_IDLE ? LONG_SLEEP : IDLE_SLEEP);
      } else {
        // NOTE: PAUSE for the first PAUSE_POLLS polls (~100-300 us: the gap between a request's two calls and
        // most gaps between a bs1 step's layers), then yield between polls: a team that outnumbers the free
        // cores hands them to the runnable threads it would otherwise starve (the engine's thread, the driver's)
        backoff(polls);
        idle = (++polls & 1023) == 0 && std::chrono::steady_clock::now() - last_job > SPIN_FOR;
      }
    }
  }

  // NOTE: the polled ticket and the counter every job bumps on cache lines of their own
  alignas(64) std::atomic<uint64_t> ticket_{0};  // generation << 32 | jobs << 16 | next job
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<const JobFn*> fn_{nullptr};
  std::atomic<int64_t> base_{0};
  std::atomic<bool> failed_{false}, stop_{false};
  std::exception_ptr error_;
  uint64_t generation_ = 0;  // the caller's alone
  std::vector<std::thread> workers_;
};

}  // namespace fluxtide
