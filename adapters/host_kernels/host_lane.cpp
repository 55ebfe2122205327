// The host lane: one C++ thread that serves a decode step's host expert requests through a mailbox in pinned
// memory, inside the one captured graph (ADR 0030, "a flag handshake inside the one graph"). The GPU side is
// adapters/kernels/host_lane_publish.py and host_lane_wait.py; host_lane.py owns the mailbox and documents it.
//
// Shape legend: M mailbox rows (the largest T), T rows of one request, K top-k, H hidden, I intermediate,
// N bank rows, R row bytes, L*E keys.
//
// One request at a time (a step runs its layers in order): the GPU stores x, pairs, weights and T, then the
// request's sequence number into ctrl[REQUEST] with a system-scope release; this thread acquires it, computes
// the host pairs' experts into partial [T, H] and answers ctrl[DONE] = seq (or -seq when the request was bad)
// with a release store. The GPU acquires DONE and adds partial. The thread never touches Python (no GIL).
#include "fp8_block_experts.h"
#include "spin_team.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_PAUSE() _mm_pause()
#else
#define FT_PAUSE() std::this_thread::yield()
#endif

namespace {

// NOTE: word indices of ctrl int64 [CTRL_WORDS]; host_lane.py's constants must match. Each group sits on its
// own 128-byte line (the GPU's line; two of the host's) so the GPU's writes and the host's never share one.
constexpr int64_t REQUEST = 0, ROWS = 1;                                      // written by the GPU
constexpr int64_t DONE = 16;                                                   // written by this thread
constexpr int64_t ERROR = 32, ERROR_SEQ = 33, ERROR_DETAIL = 34, SERVED = 35;  // this thread, read by Python
constexpr int64_t CTRL_WORDS = 48;
// host error codes (ctrl[ERROR]); host_lane.py's HostError
constexpr int64_t BAD_KEY = 1, NO_ROW = 2, BAD_ROWS = 3, KERNEL_FAILED = 4;
// pure spinning for this long after the last request (a decode step's layers and the gap between steps), then
// a poll every IDLE_SLEEP: an idle server does not burn a core, and the first layer after an idle spell waits
// at most one sleep
constexpr auto SPIN_FOR = std::chrono::milliseconds(5);
constexpr auto IDLE_SLEEP = std::chrono::microseconds(200);

inline int64_t load_acquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline int64_t load_relaxed(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void check(const torch::Tensor& t, at::ScalarType dtype, std::initializer_list<int64_t> shape, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes().equals(shape),
              name, " must be contiguous ", dtype, " ", at::IntArrayRef(shape), " in host memory, got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

class HostLane {
 public:
  // ctrl int64 [CTRL_WORDS]; x fp32 [M, H]; pairs int64 [M*K]; weights fp32 [M*K]; partial fp32 [M, H]
  // (the mailbox, pinned on CUDA hosts); bank uint8 [N, R]; offsets int64 [6]; row_of_key int64 [L*E] (bank
  // row of a key, -1 where the bank has none); threads: the team of this thread's kernel calls, itself included;
  // spin: that team is a SpinTeam started with the thread (spin_team.h), else this thread's OpenMP team.
  HostLane(torch::Tensor ctrl, torch::Tensor x, torch::Tensor pairs, torch::Tensor weights, torch::Tensor partial,
           torch::Tensor bank, torch::Tensor offsets, torch::Tensor row_of_key, int64_t top_k, int64_t inter,
           int64_t grain_rows, int64_t threads, bool spin)
      : ctrl_(ctrl), x_(x), pairs_(pairs), weights_(weights), partial_(partial), bank_(bank), offsets_(offsets),
        row_of_key_(row_of_key), k_(top_k), inter_(inter), grain_(grain_rows), threads_(threads), spin_(spin) {
    TORCH_CHECK(top_k > 0 && inter > 0 && grain_rows > 0 && threads > 0, "top_k, inter, grain_rows and threads "
                "must be positive");
    TORCH_CHECK(x.dim() == 2 && bank.dim() == 2, "x and bank must be 2-D");
    m_ = x.size(0);
    h_ = x.size(1);
    check(ctrl, at::kLong, {CTRL_WORDS}, "ctrl");
    check(x, at::kFloat, {m_, h_}, "x");
    check(pairs, at::kLong, {m_ * k_}, "pairs");
    check(weights, at::kFloat, {m_ * k_}, "weights");
    check(partial, at::kFloat, {m_, h_}, "partial");
    check(bank, at::kByte, {bank.size(0), bank.size(1)}, "bank");
    check(offsets, at::kLong, {6}, "offsets");
    check(row_of_key, at::kLong, {row_of_key.size(0)}, "row_of_key");
    tok_.resize(m_ * k_);
    row_.resize(m_ * k_);
    w_.resize(m_ * k_);
    act_.resize(m_ * k_ * (inter_ + h_));
  }

  ~HostLane() { stop(); }

  // Starts the serving thread; a no-op while it runs. A request published before the start is served.
  // Returns once the thread has its kernel team, so team() names the one it serves with.
  void start() {
    std::lock_guard<std::mutex> lock(lifecycle_);
    if (thread_.joinable()) return;
    stop_.store(false, std::memory_order_relaxed);
    std::promise<void> settled;
    std::future<void> ready = settled.get_future();
    thread_ = std::thread([this, &settled] { run(settled); });
    ready.wait();
  }

  // The team the thread serves with (or last served with): "spin", or "openmp" when OpenMP was asked for or a
  // spin team could not start its workers; "" before the first start.
  std::string team() const {
    switch (team_.load(std::memory_order_acquire)) {
      case SPIN: return "spin";
      case OPENMP: return "openmp";
      default: return "";
    }
  }

  // Ends the thread after the request it is serving, if any (a kernel call: milliseconds); idempotent.
  void stop() {
    std::lock_guard<std::mutex> lock(lifecycle_);
    if (!thread_.joinable()) return;
    stop_.store(true, std::memory_order_relaxed);
    thread_.join();
  }

  bool running() {
    std::lock_guard<std::mutex> lock(lifecycle_);
    return thread_.joinable();
  }

 private:
  void run(std::promise<void>& settled) {
#ifdef _OPENMP
    // NOTE: torch sizes a thread's OpenMP team lazily, once per thread, from its global count; settle that
    // first, then size this thread's team alone (omp_set_num_threads is per thread: Python's is untouched)
    at::internal::lazy_init_num_threads();
    omp_set_num_threads(static_cast<int>(threads_));
#endif
    // the spin team lives as long as this thread: stop() ends its workers too
    std::unique_ptr<fluxtide::SpinTeam> team;
    if (spin_) {
      try {
        team = std::make_unique<fluxtide::SpinTeam>(static_cast<int>(threads_));
        for_each_ = [&team](int64_t n, const std::function<void(int64_t)>& job) { team->run(n, job); };
      } catch (...) {  // NOTE: nothing may leave the thread; without its workers (no threads left) it serves on
        team.reset();  // OpenMP's team, as FLUXTIDE_HOST_LANE_TEAM=openmp would; team() says so
      }
    }
    team_.store(team ? SPIN : OPENMP, std::memory_order_release);
    settled.set_value();  // NOTE: last use of settled: start() returns and its promise ends
    int64_t* ctrl = ctrl_.data_ptr<int64_t>();
    const int64_t answered = load_acquire(ctrl + DONE);
    int64_t last = answered < 0 ? -answered : answered;
    auto last_request = std::chrono::steady_clock::now();
    uint32_t polls = 0;
    bool idle = false;
    while (!stop_.load(std::memory_order_relaxed)) {
      const int64_t seq = load_acquire(ctrl + REQUEST);  // pairs with the GPU's system-scope release
      if (seq > last) {
        // NOTE: the latest request only: one the GPU gave up on (its wait timed out) is skipped, never served late
        serve(ctrl, seq);
        last = seq;
        last_request = std::chrono::steady_clock::now();
        idle = false;
        continue;
      }
      if (idle) {
        std::this_thread::sleep_for(IDLE_SLEEP);
      } else {
        FT_PAUSE();
        idle = (++polls & 1023) == 0 && std::chrono::steady_clock::now() - last_request > SPIN_FOR;
      }
    }
    for_each_ = nullptr;  // before the team it calls ends
  }

  // Computes one request into partial and answers it: DONE = seq, or DONE = -seq with the first error kept in
  // ERROR / ERROR_SEQ / ERROR_DETAIL. Keeps serving after a bad request: the GPU fails that step, not the lane.
  void serve(int64_t* ctrl, int64_t seq) {
    const int64_t t = load_relaxed(ctrl + ROWS);  // ordered after REQUEST's acquire
    int64_t code = 0, detail = 0, n = 0;
    if (t < 0 || t > m_) {
      code = BAD_ROWS;
      detail = t;
    } else {
      const int64_t* pairs = pairs_.data_ptr<int64_t>();
      const float* weights = weights_.data_ptr<float>();
      const int64_t* row_of_key = row_of_key_.data_ptr<int64_t>();
      const int64_t keys = row_of_key_.size(0), rows = bank_.size(0);
      // lane order: a token's pairs are summed in k order, the order the GPU's moe_sum uses for its own
      for (int64_t lane = 0; lane < t * k_; ++lane) {
        const int64_t key = pairs[lane];
        if (key < 0) continue;
        const int64_t row = key < keys ? row_of_key[key] : -1;
        if (row < 0 || row >= rows) {
          code = key < keys ? NO_ROW : BAD_KEY;
          detail = key;
          break;
        }
        tok_[n] = lane / k_;
        row_[n] = row;
        w_[n] = weights[lane];
        ++n;
      }
    }
    if (code == 0) {
      try {
        fluxtide::fp8_block_experts_into(x_.data_ptr<float>(), t, h_, bank_.data_ptr<uint8_t>(), bank_.size(1),
                                         tok_.data(), row_.data(), w_.data(), n, offsets_.data_ptr<int64_t>(),
                                         inter_, grain_, act_.data(), partial_.data_ptr<float>(), for_each_);
      } catch (...) {  // NOTE: nothing may leave the thread: an escaping exception would end the process
        code = KERNEL_FAILED;
      }
    }
    if (code != 0 && load_relaxed(ctrl + ERROR) == 0) {
      ctrl[ERROR_DETAIL] = detail;
      ctrl[ERROR_SEQ] = seq;
      store_release(ctrl + ERROR, code);
    }
    store_release(ctrl + SERVED, load_relaxed(ctrl + SERVED) + 1);
    store_release(ctrl + DONE, code == 0 ? seq : -seq);  // last: the GPU reads partial only after this
  }

  torch::Tensor ctrl_, x_, pairs_, weights_, partial_, bank_, offsets_, row_of_key_;  // held: kept alive
  int64_t k_, inter_, grain_, threads_, m_ = 0, h_ = 0;
  bool spin_;
  static constexpr int SPIN = 1, OPENMP = 2;
  std::atomic<int> team_{0};    // the running thread's team (SPIN or OPENMP), 0 before the first start
  fluxtide::ForEach for_each_;  // the spin team's run while the thread runs with one; empty: OpenMP
  std::vector<int64_t> tok_, row_;  // [M*K] the request's pairs, built without allocating
  std::vector<float> w_, act_;      // [M*K], [M*K, I + H] (the kernel's scratch)
  std::atomic<bool> stop_{false};
  std::mutex lifecycle_;
  std::thread thread_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // start/stop release the GIL: stop joins a thread that never takes it, but Python threads may run meanwhile
  pybind11::class_<HostLane>(m, "HostLane")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t, bool>())
      .def("start", &HostLane::start, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("stop", &HostLane::stop, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("running", &HostLane::running)
      .def("team", &HostLane::team);
}
