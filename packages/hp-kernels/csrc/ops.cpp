// Flags, copies, conversions and reductions on raw addresses, plus the MoE counting sort.
// Callers release the GIL around these (module.cpp), so they run beside Python work.
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "common.h"

namespace hpk {

size_t dtype_size(int dtype) {
  switch (dtype) {
    case F32: return 4;
    case BF16: return 2;
    case F16: return 2;
    case F64: return 8;
    case I64: return 8;
    case I32: return 4;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(dtype));
}

// ---------------------------------------------------------------------------------------------
// Waiting on a flag
// ---------------------------------------------------------------------------------------------

static bool process_gone(int64_t pid) {
  // A killed child stays a zombie until reaped, and kill(pid, 0) still succeeds on a zombie:
  // read its state from /proc instead.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close_paren = std::strrchr(buf, ')');  // the command name may hold spaces
  if (!close_paren || close_paren[1] == '\0' || close_paren[2] == '\0') return false;
  char state = close_paren[2];
  return state == 'Z' || state == 'X';
}

// Flags are 64-bit counters in shared memory; their low 32 bits double as a futex word (not
// private: the waiters are other processes), so a waiter sleeps in the kernel instead of taking
// the CPU from the ranks still working (ranks may outnumber cores).
static inline uint32_t* futex_word(uintptr_t addr) {
  return reinterpret_cast<uint32_t*>(addr);  // little-endian: the low half of the counter
}

void wake_all(uintptr_t addr) {
  ::syscall(SYS_futex, futex_word(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

int wait_geq(uintptr_t addr, uint64_t value, double timeout_s, int64_t pid) {
  auto* flag = reinterpret_cast<std::atomic<uint64_t>*>(addr);
  for (int spin = 0; spin < 2000; ++spin) {  // a few microseconds: the peer is often that close
    if (flag->load(std::memory_order_acquire) >= value) return 0;
  }
  using clock = std::chrono::steady_clock;
  timeout_s = std::min(std::max(timeout_s, 0.0), 1e7);  // an "infinite" timeout must not overflow
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
  auto next_check = start + std::chrono::milliseconds(50);
  for (;;) {
    uint64_t seen = flag->load(std::memory_order_acquire);
    if (seen >= value) return 0;
    const auto now = clock::now();
    if (now >= deadline) return 1;
    if (pid > 0 && now >= next_check) {
      if (process_gone(pid)) return flag->load(std::memory_order_acquire) >= value ? 0 : 2;
      next_check = now + std::chrono::milliseconds(50);
    }
    // Sleep until the word changes (a signaller wakes us) or 50 ms pass (to look at the peer).
    struct timespec ts{0, 50 * 1000 * 1000};
    ::syscall(SYS_futex, futex_word(addr), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Parallel loops
// ---------------------------------------------------------------------------------------------

template <class F>
static void parallel_chunks(size_t n, size_t grain, int nthreads, F&& body) {
  if (nthreads <= 1 || n < 2 * grain) {
    body(size_t{0}, n);
    return;
  }
  size_t parts = std::min<size_t>(static_cast<size_t>(nthreads), n / grain);
  size_t step = (n + parts - 1) / parts;
  step = (step + 63) / 64 * 64;  // keep chunk edges on cache lines
  std::vector<std::thread> threads;
  for (size_t p = 1; p < parts && p * step < n; ++p) {
    size_t lo = p * step, hi = std::min(n, lo + step);
    threads.emplace_back([&body, lo, hi] { body(lo, hi); });
  }
  body(0, std::min(n, step));
  for (auto& t : threads) t.join();
}

// Copies of at least this many bytes store past the caches (non-temporal stores): a plain store
// first reads each destination line (read-for-ownership), a third more memory traffic on a
// copy whose destination is bigger than the caches anyway. Below it, memcpy keeps the data
// cached for whoever reads it next.
// HP_KERNELS_STREAM_MIN: a byte count (digits only); anything else keeps the default.
static size_t parse_stream_min() {
  const size_t fallback = size_t{4} << 20;
  const char* e = std::getenv("HP_KERNELS_STREAM_MIN");
  if (e == nullptr || *e < '0' || *e > '9') return fallback;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(e, &end, 10);
  if (errno != 0 || end == e || *end != '\0') return fallback;
  return static_cast<size_t>(v);
}

size_t stream_min_bytes() {
  static const size_t v = parse_stream_min();  // first read at module import (GIL held)
  return v;
}

static void stream_copy(char* d, const char* s, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;  // align the stores
  head = std::min(head, n);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();  // the streamed lines are visible before any flag that follows
#else
  std::memcpy(d, s, n);
#endif
}

void copy_bytes(uintptr_t dst, uintptr_t src, size_t nbytes, int nthreads) {
  if (nbytes != 0 && dst < src + nbytes && src < dst + nbytes) {  // overlapping: as memmove
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
    return;
  }
  const bool stream = nbytes >= stream_min_bytes();
  parallel_chunks(nbytes, size_t{1} << 20, nthreads, [&](size_t lo, size_t hi) {
    char* d = reinterpret_cast<char*>(dst) + lo;
    const char* s = reinterpret_cast<const char*>(src) + lo;
    if (stream) {
      stream_copy(d, s, hi - lo);
    } else {
      std::memcpy(d, s, hi - lo);
    }
  });
}

// Cross-memory attach: one copy straight out of another process's memory (what MPI's CMA
// transport does), instead of the two copies through a shared slot. Returns 0, or errno.
int cma_read(int64_t pid, uintptr_t local, uintptr_t remote, size_t nbytes) {
  size_t done = 0;
  while (done < nbytes) {
    struct iovec l{reinterpret_cast<void*>(local + done), nbytes - done};
    struct iovec r{reinterpret_cast<void*>(remote + done), nbytes - done};
    ssize_t got = ::process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EFAULT;
    done += static_cast<size_t>(got);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Element conversions
// ---------------------------------------------------------------------------------------------

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct BF16T { uint16_t bits; };
using F16T = _Float16;

template <class T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <> struct Acc<int64_t> { using type = int64_t; };
template <> struct Acc<int32_t> { using type = int64_t; };

template <class A, class T> static inline A load(const T* p, size_t i) {
  if constexpr (std::is_same_v<T, BF16T>) return static_cast<A>(bf16_to_f32(p[i].bits));
  else return static_cast<A>(p[i]);
}
template <class T, class A> static inline void store(T* p, size_t i, A v) {
  if constexpr (std::is_same_v<T, BF16T>) p[i].bits = f32_to_bf16(static_cast<float>(v));
  else p[i] = static_cast<T>(v);
}

template <class F> static void dispatch(int dtype, F&& f) {
  switch (dtype) {
    case F32: f(static_cast<float*>(nullptr)); return;
    case BF16: f(static_cast<BF16T*>(nullptr)); return;
    case F16: f(static_cast<F16T*>(nullptr)); return;
    case F64: f(static_cast<double*>(nullptr)); return;
    case I64: f(static_cast<int64_t*>(nullptr)); return;
    case I32: f(static_cast<int32_t*>(nullptr)); return;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(dtype));
}

void convert(uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, size_t n, int nthreads) {
  if (dst_dtype == src_dtype) {
    copy_bytes(dst, src, n * dtype_size(dst_dtype), nthreads);
    return;
  }
  dispatch(dst_dtype, [&](auto* dtag) {
    using D = std::remove_pointer_t<decltype(dtag)>;
    dispatch(src_dtype, [&](auto* stag) {
      using S = std::remove_pointer_t<decltype(stag)>;
      using A = std::conditional_t<std::is_same_v<typename Acc<D>::type, double> ||
                                       std::is_same_v<typename Acc<S>::type, double>,
                                   double, typename Acc<S>::type>;
      D* d = reinterpret_cast<D*>(dst);
      const S* s = reinterpret_cast<const S*>(src);
      parallel_chunks(n, size_t{1} << 18, nthreads, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) store<D, A>(d, i, load<A, S>(s, i));
      });
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Reductions over several sources (peers' buffers)
// ---------------------------------------------------------------------------------------------

template <class D, class S>
static void reduce_typed(D* dst, const std::vector<const S*>& srcs, size_t n, int op, double scale,
                         int nthreads) {
  using A = std::conditional_t<std::is_same_v<typename Acc<S>::type, double> ||
                                   std::is_same_v<typename Acc<D>::type, double>,
                               double, typename Acc<S>::type>;
  constexpr size_t kBlock = 1024;
  parallel_chunks(n, size_t{1} << 16, nthreads, [&](size_t lo, size_t hi) {
    A acc[kBlock];
    for (size_t b = lo; b < hi; b += kBlock) {
      const size_t m = std::min(kBlock, hi - b);
      const S* s0 = srcs[0] + b;
      for (size_t i = 0; i < m; ++i) acc[i] = load<A, S>(s0, i);
      for (size_t k = 1; k < srcs.size(); ++k) {
        const S* sk = srcs[k] + b;
        if (op == MAX) {
          for (size_t i = 0; i < m; ++i) {
            A v = load<A, S>(sk, i);
            acc[i] = (v > acc[i] || v != v) ? v : acc[i];  // NaN wins, as in torch.maximum
          }
        } else {
          for (size_t i = 0; i < m; ++i) acc[i] += load<A, S>(sk, i);
        }
      }
      if (op == AVG) {
        for (size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(acc[i] * scale);
      }
      D* d = dst + b;
      for (size_t i = 0; i < m; ++i) store<D, A>(d, i, acc[i]);
    }
  });
}

void reduce(uintptr_t dst, int dst_dtype, const std::vector<uintptr_t>& srcs, int src_dtype,
            size_t n, int op, double scale, int nthreads) {
  if (srcs.empty()) throw std::invalid_argument("reduce needs at least one source");
  if (op != SUM && op != AVG && op != MAX)
    throw std::invalid_argument("unknown reduce op code " + std::to_string(op));
  dispatch(dst_dtype, [&](auto* dtag) {
    using D = std::remove_pointer_t<decltype(dtag)>;
    dispatch(src_dtype, [&](auto* stag) {
      using S = std::remove_pointer_t<decltype(stag)>;
      std::vector<const S*> s;
      for (auto a : srcs) s.push_back(reinterpret_cast<const S*>(a));
      reduce_typed<D, S>(reinterpret_cast<D*>(dst), s, n, op, scale, nthreads);
    });
  });
}

// ---------------------------------------------------------------------------------------------
// MoE: stable counting sort of expert ids
// ---------------------------------------------------------------------------------------------

int64_t expert_order(const int64_t* ids, size_t n, int64_t num_experts, int64_t* order,
                     int64_t* counts) {
  std::fill(counts, counts + num_experts, 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t e = ids[i];
    if (e < 0 || e >= num_experts) return static_cast<int64_t>(i);
    ++counts[e];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_experts));
  int64_t run = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    next[static_cast<size_t>(e)] = run;
    run += counts[e];
  }
  for (size_t i = 0; i < n; ++i) order[next[static_cast<size_t>(ids[i])]++] = static_cast<int64_t>(i);
  return -1;
}

}  // namespace hpk
