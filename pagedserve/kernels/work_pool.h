// A pool of worker threads that splits a kernel's rows into chunks which whoever is running claims,
// and returns when every chunk is done, not when every thread has shown up.
//
// Why not OpenMP (at::parallel_for): an OpenMP region forks every thread of the team and joins them
// all at its end, so it lasts as long as its latest thread. When other processes share the cores (an
// HTTP front end, a gateway, a load generator: a CPU server's normal day), a worker that is not
// running when the region starts makes the caller wait out a scheduler time slice at the join, and a
// decode step runs ~150 regions: the default model fell from 34 to 3.7 tokens/s with a compiler
// running beside it. Here the caller claims chunks too; a worker that is not on a core when work is
// posted simply finds nothing left when it wakes. Only a chunk a worker has claimed and not finished
// is waited for, and chunks are small (a few per thread).
//
// One pool belongs to one DecodeStack (decode_stack.cpp); kernels take it as an optional argument
// and fall back to at::parallel_for without one (pagedserve::parallel_for below).
//
// Placement: worker i runs where OpenMP's thread i runs. A new thread inherits its creator's CPUs,
// and where the step's OpenMP threads are pinned one per core (`serve` and `bench compare` do it:
// engine/process_placement.py) the creator is the master, pinned to one core: every worker would
// then share that core with the caller, and the default model decoded at 42 tok/s where it
// decodes at 95 unpinned. Copying each OpenMP thread's affinity keeps the pinning where it was
// chosen and changes nothing where it was not (every thread then has the whole mask).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/FunctionRef.h>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <x86intrin.h>
#else
#include <chrono>
#endif

namespace pagedserve {

// Where a pool's threads spent their time while it counted (WorkPool::count_times), in ticks of
// the CPU's time-stamp counter (x86; elsewhere steady_clock nanoseconds): a few reads a job, so
// off unless asked for. Why: a sampling profiler sees a worker only while it runs, so the time it
// sleeps between jobs, while the caller works alone (the step's Python, the code between kernels),
// shows nowhere; these counters show it (examples/native_decode_overhead.py). The caller's fields
// are written by the thread that runs jobs, `worker_busy` by the workers: read them between jobs.
struct alignas(64) PoolTimes {
  int64_t jobs = 0, chunks = 0, alone_jobs = 0;  // split jobs, their chunks; jobs of one chunk
  uint64_t job = 0;          // split jobs, from posting to the last chunk's end
  uint64_t caller_wait = 0;  // of which the caller waited for a worker's last chunks
  uint64_t alone = 0;        // jobs of one chunk, which the caller runs by itself
  uint64_t between = 0;      // from one job's end to the next one's start (the caller's own code)
  alignas(64) std::atomic<uint64_t> worker_busy{0};  // every worker's chunks, summed (a line of its own)
};

inline uint64_t pool_ticks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

class WorkPool {
 public:
  // `threads` counts the caller: threads - 1 workers are started.
  explicit WorkPool(int threads) {
    const std::vector<Place> places = openmp_places(threads);
    for (int i = 1; i < threads; ++i) {
      workers_->emplace_back([this, place = places[i]] {
        place.apply();
#if defined(__linux__)
        pthread_setname_np(pthread_self(), "pagedserve-pool");  // told apart from OpenMP's in /proc
#endif
        work();
      });
    }
  }
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;
  // In a forked child (a multiprocessing worker of a process that held a decode stack) the
  // workers are the parent's threads, not its own: joining them crashed the child when its garbage
  // collector dropped the copied stack. There the pool's threads are left alone (their handles
  // leak with the child's exit), and run() works on the caller alone, since no worker claims.
  ~WorkPool() {
    if (getpid() != owner_) {
      (void)workers_.release();
      return;
    }
    stop_.store(true, std::memory_order_seq_cst);
    state_.fetch_add(kGenUnit, std::memory_order_seq_cst);  // a new "generation" wakes sleepers
    state_.notify_all();
    for (auto& t : *workers_) t.join();
  }

  int threads() const { return static_cast<int>(workers_->size()) + 1; }
  const PoolTimes& times() const { return times_; }
  // Count from now on (PoolTimes), or stop; the counts so far are kept. Call between jobs.
  void count_times(bool on) {
    last_end_ = 0;  // the gap before the first job counted is not the caller's code alone
    counting_.store(on, std::memory_order_relaxed);
  }

  // body(b, e) over [begin, end) in chunks of at least `grain` items, at most `max_chunks` of them
  // (0: four per thread, enough to even out a descheduled worker for short kernels; a long one
  // asks for more, so that its last chunk does not hold the others up for long); returns when all ran.
  void run(int64_t begin, int64_t end, int64_t grain, c10::function_ref<void(int64_t, int64_t)> body,
           int64_t max_chunks = 0) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t most = std::min<int64_t>(kMaxChunks, max_chunks > 0 ? max_chunks : 4 * threads());
    const int64_t chunks = std::clamp<int64_t>((n + grain - 1) / std::max<int64_t>(grain, 1), 1, most);
    const bool counting = counting_.load(std::memory_order_relaxed);
    const uint64_t start = counting ? pool_ticks() : 0;
    if (counting && last_end_ != 0) times_.between += start - last_end_;
    if (chunks == 1 || workers_->empty()) {
      body(begin, end);
      if (counting) {
        last_end_ = pool_ticks();
        times_.alone_jobs += 1;
        times_.alone += last_end_ - start;
      }
      return;
    }
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> kGenShift) + 1;
    Job& job = jobs_[gen & 1];  // the other slot may still be read by a worker finishing the last job
    job.body = &body;  // lives until this call returns, after the last chunk
    job.begin = begin;
    job.end = end;
    job.size = (n + chunks - 1) / chunks;
    done_.store(0, std::memory_order_relaxed);
    state_.store((gen << kGenShift) | (static_cast<uint64_t>(chunks) << kCountShift), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) state_.notify_all();
    claim_all(gen);
    const uint64_t own_done = counting ? pool_ticks() : 0;
    while (done_.load(std::memory_order_acquire) < chunks) pause();  // chunks workers claimed, still running
    if (counting) {
      last_end_ = pool_ticks();
      times_.jobs += 1;
      times_.chunks += chunks;
      times_.job += last_end_ - start;
      times_.caller_wait += last_end_ - own_done;
    }
  }

 private:
  // A thread's CPU affinity, as read from one thread and applied to another (Linux; elsewhere none).
  struct Place {
#if defined(__linux__)
    cpu_set_t cpus;
    bool known = false;
    void read() { known = sched_getaffinity(0, sizeof(cpus), &cpus) == 0; }
    void apply() const {
      if (known) sched_setaffinity(0, sizeof(cpus), &cpus);  // 0: the calling thread
    }
#else
    void read() {}
    void apply() const {}
#endif
  };

  // The affinity of OpenMP's threads 0..n-1 (unknown where the team has fewer), each read by the
  // thread itself inside one parallel region.
  static std::vector<Place> openmp_places(int n) {
    std::vector<Place> places(std::max(n, 1));
    at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
      const int t = at::get_thread_num();
      if (t >= 0 && t < n) places[t].read();  // each thread writes its own slot only
    });
    return places;
  }

  struct Job {
    const c10::function_ref<void(int64_t, int64_t)>* body = nullptr;
    int64_t begin = 0, end = 0, size = 0;
  };
  // state_: generation (32 bits) | chunk count (16) | next chunk (16), one word so a claim can never
  // take a chunk of another job than the one it read.
  static constexpr int kGenShift = 32, kCountShift = 16;
  static constexpr uint64_t kGenUnit = uint64_t{1} << kGenShift;
  static constexpr int64_t kMaxChunks = 1 << 15;

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Claim and run chunks of generation `gen` until none is left; with `count_busy` (a worker while
  // the pool counts), the time in them added to PoolTimes::worker_busy.
  void claim_all(uint64_t gen, bool count_busy = false) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t count = (s >> kCountShift) & 0xFFFF, next = s & 0xFFFF;
      if ((s >> kGenShift) != gen || next >= count) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const Job& job = jobs_[gen & 1];
      const int64_t b = job.begin + static_cast<int64_t>(next) * job.size;
      const uint64_t chunk_start = count_busy ? pool_ticks() : 0;
      (*job.body)(b, std::min(job.end, b + job.size));
      // before the chunk counts as done: once the last one does, the caller may read the times
      if (count_busy) times_.worker_busy.fetch_add(pool_ticks() - chunk_start, std::memory_order_relaxed);
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
  }

  void work() {
    // Generation 0, the one before any job, not the current one: a worker that starts after the
    // first job was posted (a pool is made and used at once) takes its chunks instead of sleeping
    // through it and leaving it to the caller alone.
    uint64_t seen = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      uint64_t s = state_.load(std::memory_order_acquire);
      // Spin briefly (the next kernel of a step comes within microseconds), then yield the core to
      // whoever else wants it, then sleep until the next job.
      for (int i = 0; (s >> kGenShift) == seen && i < kSpins; ++i) {
        pause();
        s = state_.load(std::memory_order_acquire);
      }
      for (int i = 0; (s >> kGenShift) == seen && i < kYields; ++i) {
        std::this_thread::yield();
        s = state_.load(std::memory_order_acquire);
      }
      if ((s >> kGenShift) == seen) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        s = state_.load(std::memory_order_seq_cst);  // a job posted before we counted ourselves asleep
        if ((s >> kGenShift) == seen) state_.wait(s, std::memory_order_seq_cst);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      seen = s >> kGenShift;
      claim_all(seen, /*count_busy=*/counting_.load(std::memory_order_relaxed));
    }
  }

  static constexpr int kSpins = 20000, kYields = 200;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  Job jobs_[2];
  PoolTimes times_;
  std::atomic<bool> counting_{false};
  uint64_t last_end_ = 0;  // when the last counted job ended (0: none yet); the caller's
  const pid_t owner_ = getpid();  // the process whose threads the workers are
  std::unique_ptr<std::vector<std::thread>> workers_ = std::make_unique<std::vector<std::thread>>();
};

// body(b, e) over [begin, end): on `pool` when given (in at most `max_chunks` chunks, 0: the
// pool's default), else torch's at::parallel_for.
template <typename F>
void parallel_for(WorkPool* pool, int64_t begin, int64_t end, int64_t grain, const F& body, int64_t max_chunks = 0) {
  if (pool != nullptr) {
    pool->run(begin, end, grain, body, max_chunks);
  } else {
    at::parallel_for(begin, end, grain, body);
  }
}

// body(r0, r1) over rows [0, rows) of `row_values` values each, which are independent (norms,
// rotary embedding, SiLU, copies and conversions): tasks of about 2k values on `pool`, which hands
// a task over in well under a microsecond (a 16-row step's 576-wide rows go 6 ways, where as one
// task they ran while the pool's worker idled), and of 16k on torch's threads, whose OpenMP region
// costs more to open.
template <typename F>
void parallel_rows(WorkPool* pool, int64_t rows, int64_t row_values, const F& body) {
  const int64_t task_values = pool != nullptr ? 2048 : 16384;
  parallel_for(pool, 0, rows, std::max<int64_t>(1, task_values / std::max<int64_t>(1, row_values)), body);
}

}  // namespace pagedserve
