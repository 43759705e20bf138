// The host memory roofs a CPU benchmark is judged against, measured by the benchmark binary itself.
// The reference is the copy roof: `threads` threads memcpy contiguous pieces of one large buffer
// into another, counting bytes read + bytes written (METHOD.md). Two more roofs give the ceiling of
// the access pattern a pass actually has (read only; read then write back in place), which on some
// machines differ from the copy's by a third either way. Also the cache size the buffers must
// dwarf, and aligned host buffers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace xent_bench {

constexpr std::size_t kib = std::size_t{1} << 10;
constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t gib = std::size_t{1} << 30;

/// Size of the last-level cache one core sees: /sys's highest cache index (the kernel's view of
/// the VM's CCD or socket), else sysconf, else 32 MiB. sysconf alone is not trusted: under KVM on
/// an EPYC it reported 320 MiB (the whole package) where /sys and lscpu say 32 MiB.
inline std::size_t last_level_cache_bytes() {
  std::size_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string s;
    if (!(f >> s) || s.empty()) continue;
    std::size_t mult = 1;
    const char unit = s.back();
    if (unit == 'K') mult = kib;
    if (unit == 'M') mult = mib;
    if (unit == 'G') mult = gib;
    best = std::max<std::size_t>(best, std::strtoull(s.c_str(), nullptr, 10) * mult);
  }
#ifdef _SC_LEVEL3_CACHE_SIZE
  if (best == 0) {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) best = static_cast<std::size_t>(l3);
  }
#endif
  return best ? best : 32 * mib;
}

inline std::size_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : 8 * gib;
}

/// An uninitialised, 2 MiB-aligned host buffer (plain pages: no madvise, as a framework's default
/// CPU allocator hands them out). Callers touch it before timing.
class host_buffer {
 public:
  host_buffer() = default;
  explicit host_buffer(std::size_t bytes) : bytes_(bytes) {
    constexpr std::size_t align = 2 * mib;
    if (bytes == 0) return;
    ptr_ = std::aligned_alloc(align, (bytes + align - 1) / align * align);
    if (!ptr_) throw std::bad_alloc();
  }
  host_buffer(host_buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  host_buffer& operator=(host_buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  ~host_buffer() { std::free(ptr_); }

  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Calls f(begin, end) on `threads` contiguous pieces of [0, count), the calling thread taking the
/// first; threads are started per call, as xent::cpu starts its own.
template <class F>
void parallel_pieces(int threads, std::size_t count, F&& f) {
  threads = std::max(threads, 1);
  auto at = [&](int w) { return count / threads * w + std::min<std::size_t>(w, count % threads); };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int w = 1; w < threads; ++w) pool.emplace_back([&, w] { f(at(w), at(w + 1)); });
  f(at(0), at(1));
  for (auto& t : pool) t.join();
}

/// Bytes each roof buffer gets for `threads` threads: at least 1 GiB and 4x the LLC, and at least
/// 256 MiB per thread so that every thread's memcpy is far above glibc's non-temporal threshold
/// (3/4 of its idea of the shared cache; 240 MiB on the 2-core EPYC VM), where memcpy streams with
/// non-temporal stores and its traffic really is read + write. Capped at 1/8 of RAM.
inline std::size_t roof_bytes(int threads) {
  std::size_t bytes = std::max({gib, 4 * last_level_cache_bytes(),
                                static_cast<std::size_t>(std::max(threads, 1)) * 256 * mib});
  return std::min(bytes, physical_memory_bytes() / 8) / 4096 * 4096;
}

/// The access patterns a roof is measured for, each over contiguous per-thread pieces:
///   copy    memcpy(dst, src): the reference roof (bytes read + bytes written);
///   read    a sum over src: what a forward pass does (bytes read);
///   update  src[i] = src[i] * c in place, regular stores to lines just read: what an in-place
///           forward_backward does (bytes read + bytes written).
enum class roof_kind { copy, read, update };

inline const char* roof_name(roof_kind k) {
  return k == roof_kind::copy ? "copy_roof" : k == roof_kind::read ? "read_roof" : "update_roof";
}

/// Source and destination of the roofs, touched once so that no page fault is timed.
struct roof_buffers {
  host_buffer src, dst;

  explicit roof_buffers(std::size_t bytes) : src(bytes), dst(bytes) {
    parallel_pieces(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), bytes,
                    [&](std::size_t b, std::size_t e) {
                      std::memset(src.as<char>() + b, 0x3f, e - b);  // floats near 0.75
                      std::memset(dst.as<char>() + b, 0, e - b);
                    });
  }
  std::size_t bytes() const { return src.bytes(); }
  /// Bytes a pass moves: read + written for copy and update, read for read.
  std::size_t traffic(roof_kind k) const { return k == roof_kind::read ? bytes() : 2 * bytes(); }

  /// One pass of `k` over the whole buffer on `threads` threads, each taking a contiguous piece
  /// (split on 4 KiB pages so no two threads share a page or line).
  void run(roof_kind k, int threads) {
    const std::size_t pages = bytes() / 4096;
    parallel_pieces(threads, pages, [&](std::size_t b, std::size_t e) {
      char* d = dst.as<char>() + b * 4096;
      char* s = src.as<char>() + b * 4096;
      const std::size_t n = (e - b) * 4096;
      if (k == roof_kind::copy) {
        std::memcpy(d, s, n);
      } else if (k == roof_kind::read) {
        // Integer sums vectorise (their order does not matter); the result goes to memory so
        // the loads cannot be dropped.
        const std::uint64_t* p = reinterpret_cast<const std::uint64_t*>(s);
        std::uint64_t acc = 0;
        for (std::size_t i = 0; i < n / 8; ++i) acc += p[i];
        *reinterpret_cast<std::uint64_t*>(d) = acc;
      } else {
        volatile float one = 1.0f;  // a runtime 1: the stores cannot be proved redundant
        const float c = one;
        float* p = reinterpret_cast<float*>(s);
        for (std::size_t i = 0; i < n / 4; ++i) p[i] *= c;
      }
    });
  }

  /// Bytes/s of the mean of `reps` timed passes after one untimed one.
  double measure(roof_kind k, int threads, int reps = 4) {
    run(k, threads);
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) run(k, threads);
    const std::chrono::duration<double> s = std::chrono::steady_clock::now() - t0;
    return static_cast<double>(traffic(k)) * reps / s.count();
  }
};

/// Roofs measured in this run, by name ("copy/threads:2"): a benchmark line records its measurement
/// here and later benchmarks divide by it. A roof is a ceiling, so the table keeps the best of the
/// measurements recorded (repetitions; a core shared with another process only lowers it). `get`
/// measures on the spot (through `measure`) when the line that records it did not run, e.g. under
/// --benchmark_filter.
class roof_table {
 public:
  static roof_table& instance() {
    static roof_table t;
    return t;
  }
  void record(const std::string& key, double bytes_per_s) {
    double& r = roofs_[key];
    r = std::max(r, bytes_per_s);
  }
  template <class Measure>
  double get(const std::string& key, Measure&& measure) {
    auto it = roofs_.find(key);
    if (it != roofs_.end()) return it->second;
    const double r = measure();
    roofs_[key] = r;
    return r;
  }

 private:
  std::map<std::string, double> roofs_;
};

}  // namespace xent_bench
