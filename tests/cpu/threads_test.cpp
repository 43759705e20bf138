// What a CPU call does when its threads fail: an exception thrown on a worker reaches the caller,
// and a thread that cannot be started (the process's thread limit) costs speed, not the call. An
// exception escaping a std::thread, or a joinable std::thread destroyed while one unwinds, ends
// the process (std::terminate): no call of the library may do either.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "xent/cpu/parallel.hpp"
#include "xent/parallel/inprocess_group.hpp"

#if defined(__linux__)
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace {

TEST(CpuThreads, AWorkersExceptionReachesTheCallerAfterEveryPieceRan) {
  std::atomic<std::int64_t> covered{0};
  // Pieces of 25: workers 1 and 3 throw, the lowest one's exception is the one rethrown.
  auto run = [&] {
    xent::cpu_detail::parallel_for(4, 100, [&](std::int64_t b, std::int64_t e, int w) {
      if (w == 1 || w == 3) throw std::runtime_error("piece " + std::to_string(w));
      covered += e - b;
    });
  };
  try {
    run();
    ADD_FAILURE() << "no exception reached the caller";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "piece 1");
  }
  EXPECT_EQ(covered.load(), 50) << "the pieces that did not throw all ran";
  // The calling thread's own piece throwing: the workers are joined before it propagates.
  EXPECT_THROW(xent::cpu_detail::parallel_for(3, 9,
                                              [](std::int64_t, std::int64_t, int w) {
                                                if (w == 0) throw std::logic_error("first");
                                              }),
               std::logic_error);
}

#if defined(__linux__)

/// The exit codes of a child run under a thread limit.
enum child_code { passed = 0, wrong = 1, not_enforced = 2, threw = 3, returned = 4 };

/// Runs `body` in a child process under RLIMIT_NPROC = `limit` (as user nobody where the test runs
/// as root, whose limit is not enforced), and returns its exit code, or 1000 + the signal that
/// ended it. The child counts as one of the limit's processes, so it may start limit - 1 threads
/// at most (fewer where other processes of nobody's run). `prepare` runs before the limit.
template <class Prepare, class Body>
int under_thread_limit(rlim_t limit, Prepare prepare, Body body) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    prepare();
    const rlimit lim{limit, limit};
    if (setrlimit(RLIMIT_NPROC, &lim) != 0) _exit(not_enforced);
    if (getuid() == 0 && setuid(65534) != 0) _exit(not_enforced);  // RLIMIT_NPROC counts by uid
    // A thread more than the limit allows must fail to start, or the test says nothing.
    std::vector<std::thread> probes;
    probes.reserve(limit);
    bool refused = false;
    for (rlim_t i = 0; i < limit && !refused; ++i) {
      try {
        probes.emplace_back([] {});
      } catch (const std::system_error&) {
        refused = true;
      }
    }
    for (auto& t : probes) t.join();
    if (!refused) _exit(not_enforced);
    _exit(body());  // _exit: no exit-time handlers of the parent's in the child
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  if (WIFSIGNALED(status)) return 1000 + WTERMSIG(status);  // std::terminate: SIGABRT
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void expect_child(int code, child_code want) {
  if (code == not_enforced)
    GTEST_SKIP() << "this machine does not enforce RLIMIT_NPROC for the test";
  ASSERT_LT(code, 1000) << "the child died of signal " << code - 1000
                        << " (6: SIGABRT, std::terminate)";
  EXPECT_EQ(code, want) << "exit codes: 1 wrong results, 3 threw, 4 returned";
}

TEST(CpuThreads, ThreadLimitLeavesThePiecesToTheCallingThreadWithTheSameBits) {
  constexpr std::int64_t N = 64, V = 4096;  // enough elements for eight threads (policy)
  std::vector<float> x(N * V);
  std::vector<std::int64_t> y(N);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : x) v = normal(rng);
  for (std::int64_t& t : y) t = static_cast<std::int64_t>(rng() % V);
  std::vector<float> want(N * V), got(N * V);
  float want_loss = 0.0f, got_loss = 0.0f;
  auto call = [&](float& loss, std::vector<float>& grad) {
    xent::forward_outputs out;
    out.loss = &loss;
    xent::forward_backward(xent::cpu{8}, xent::matrix_view<const float>(x.data(), N, V),
                           xent::vector_view<const std::int64_t>(y.data(), N), xent::options{},
                           xent::upstream{}, out, xent::matrix_view<float>(grad.data(), N, V));
  };
  // Three of the call's seven threads at most start; the calling thread takes the other pieces.
  const int code = under_thread_limit(
      4, [&] { call(want_loss, want); },
      [&]() -> int {
        try {
          call(got_loss, got);
        } catch (...) {
          return threw;
        }
        const bool same = xt::same_bits(got_loss, want_loss) &&
                          std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
        return same ? passed : wrong;
      });
  expect_child(code, passed);
}

TEST(CpuThreads, GroupWhoseRankCannotStartThrowsSystemError) {
  // Ranks 1-3 at most start, wait in the collective and leave it (group_aborted) when rank 4
  // cannot start; the caller gets that start's std::system_error.
  const int code = under_thread_limit(
      4, [] {},
      []() -> int {
        xent::inprocess_group group(8);
        try {
          group.run([](xent::inprocess_group::communicator c) {
            int mine = c.rank(), all[8];
            c.all_gather(&mine, all, sizeof mine);
          });
        } catch (const std::system_error&) {
          return passed;
        } catch (...) {
          return threw;
        }
        return returned;
      });
  expect_child(code, passed);
}

#endif  // __linux__

}  // namespace
