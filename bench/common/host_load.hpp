// How much of the machine other processes used while a benchmark line ran, from /proc (Linux):
// a line whose `other_cores` counter is near 0 ran undisturbed; 1 means another process kept a
// whole core busy meanwhile (a shared 2-core development VM sees this often). Elsewhere: 0.
#pragma once

#include <algorithm>
#include <cstdio>
#include <thread>

namespace xent_bench {

struct cpu_sample {
  long long busy = 0, total = 0;  ///< all CPUs, clock ticks
  long long self = 0;             ///< this process (every thread), clock ticks
};

inline cpu_sample sample_cpu() {
  cpu_sample s;
#ifdef __linux__
  if (std::FILE* f = std::fopen("/proc/stat", "r")) {
    long long v[8] = {};
    if (std::fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3],
                    &v[4], &v[5], &v[6], &v[7]) == 8) {
      for (long long x : v) s.total += x;
      s.busy = s.total - v[3] - v[4];  // minus idle and iowait
    }
    std::fclose(f);
  }
  if (std::FILE* f = std::fopen("/proc/self/stat", "r")) {
    long long utime = 0, stime = 0;
    // pid (comm) state, then 10 fields before utime and stime (fields 14 and 15).
    if (std::fscanf(f, "%*d (%*[^)]) %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lld %lld", &utime,
                    &stime) == 2)
      s.self = utime + stime;
    std::fclose(f);
  }
#endif
  return s;
}

/// Cores' worth of CPU time that other processes used between two samples.
inline double other_cores(const cpu_sample& a, const cpu_sample& b) {
  const long long total = b.total - a.total;
  if (total <= 0) return 0.0;
  const double cpus = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
  const double other = static_cast<double>((b.busy - a.busy) - (b.self - a.self));
  return std::max(0.0, other / static_cast<double>(total) * cpus);
}

}  // namespace xent_bench
