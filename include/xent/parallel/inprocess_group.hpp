// A communicator (parallel/communicator.hpp) whose ranks are threads of one process: what the CPU
// backend's vocab-parallel calls run on in tests and on one machine, and what lets CI, without a
// GPU, check the cross-rank merge that an NCCL group runs on devices.
//
//   xent::inprocess_group group(4);
//   group.run([&](xent::inprocess_group::communicator comm) {
//     xent::vocab_parallel_forward(xent::cpu{1}, comm, my_logits[comm.rank()], ...);
//   });
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../error.hpp"

namespace xent {

/// Thrown by a rank waiting in a collective of an inprocess_group that was aborted (another rank
/// failed): without it the waiting ranks would wait forever, as NCCL ranks do.
class group_aborted : public std::runtime_error {
 public:
  group_aborted() : std::runtime_error("xent::inprocess_group: aborted (another rank failed)") {}
};

/// `size` ranks sharing one set of slots and a barrier. Each rank holds a `communicator` handle
/// (cheap to copy) and calls the collective from its own thread. The group must outlive the
/// handles; an aborted group stays aborted.
class inprocess_group {
 public:
  explicit inprocess_group(int size)
      : size_(size > 0 ? size
                       : throw error("xent::inprocess_group", "size",
                                     "must be >= 1, got " + std::to_string(size))),
        sends_(static_cast<std::size_t>(size_)),
        bytes_(static_cast<std::size_t>(size_)) {}
  inprocess_group(const inprocess_group&) = delete;
  inprocess_group& operator=(const inprocess_group&) = delete;

  /// One rank's view of the group: models the communicator concept.
  class communicator {
   public:
    int rank() const { return rank_; }
    int size() const { return group_->size_; }
    /// Blocks until every rank has called it, then copies every rank's `bytes` into recv in rank
    /// order. Ranks passing different sizes all throw xent::error (naming "bytes").
    void all_gather(const void* send, void* recv, std::size_t bytes) const {
      group_->all_gather(rank_, send, recv, bytes);
    }

   private:
    friend class inprocess_group;
    communicator(inprocess_group* group, int rank) : group_(group), rank_(rank) {}
    inprocess_group* group_;
    int rank_;
  };

  int size() const { return size_; }

  /// The handle of rank r, 0 <= r < size().
  communicator member(int r) {
    if (r < 0 || r >= size_)
      throw error("xent::inprocess_group::member", "r",
                  std::to_string(r) + " is outside [0, " + std::to_string(size_) + ")");
    return communicator(this, r);
  }

  /// Runs f(member(r)) for every rank r on its own thread (rank 0 on the calling thread) and
  /// returns when all have returned. When a rank throws, the group is aborted so that ranks waiting
  /// in a collective throw group_aborted instead of waiting forever; then the lowest rank's
  /// exception other than group_aborted is rethrown (group_aborted if there is no other). A rank
  /// whose thread cannot be started fails so too, with the std::system_error of its start; the
  /// ranks after it are not started, nor rank 0.
  template <class F>
  void run(F&& f) {
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(size_));
    auto rank_main = [&](int r) {
      try {
        f(member(r));
      } catch (...) {
        failures[static_cast<std::size_t>(r)] = std::current_exception();
        abort();
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    bool all_started = true;
    for (int r = 1; r < size_ && all_started; ++r) {
      try {
        threads.emplace_back(rank_main, r);
      } catch (...) {  // the process's thread limit, say: rank r cannot run, so the group cannot
        failures[static_cast<std::size_t>(r)] = std::current_exception();
        abort();  // the ranks already started leave their collectives
        all_started = false;
      }
    }
    if (all_started) rank_main(0);
    for (auto& t : threads) t.join();
    std::exception_ptr first;
    for (const auto& e : failures) {
      if (!e) continue;
      if (!first) first = e;
      try {
        std::rethrow_exception(e);
      } catch (const group_aborted&) {
      } catch (...) {
        throw;
      }
    }
    if (first) std::rethrow_exception(first);
  }

  /// Wakes every rank waiting in a collective; they, and every later collective, throw
  /// group_aborted.
  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    changed_.notify_all();
  }

 private:
  /// Waits until all ranks have arrived (generation counting makes it reusable).
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw group_aborted();
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    changed_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) throw group_aborted();
  }

  void all_gather(int rank, const void* send, void* recv, std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sends_[static_cast<std::size_t>(rank)] = send;
      bytes_[static_cast<std::size_t>(rank)] = bytes;
    }
    barrier();  // every rank's send buffer is posted
    bool same = true;
    for (std::size_t b : bytes_) same = same && b == bytes;
    if (same)
      for (int r = 0; r < size_; ++r)
        if (bytes > 0)
          std::memcpy(static_cast<unsigned char*>(recv) + static_cast<std::size_t>(r) * bytes,
                      sends_[static_cast<std::size_t>(r)], bytes);
    barrier();  // nobody returns (and reuses its send buffer or slot) before every rank copied
    if (!same)
      throw error("xent::inprocess_group::all_gather", "bytes",
                  "ranks passed different sizes (rank " + std::to_string(rank) + ": " +
                      std::to_string(bytes) + " bytes); the call's arguments differ across ranks");
  }

  int size_;
  std::vector<const void*> sends_;
  std::vector<std::size_t> bytes_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace xent
