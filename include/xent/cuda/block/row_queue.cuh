// The row kernel's queue of rows: clusters take rows as they finish them, rather than each
// walking a fixed share, so that the launch ends when the work does and not with its slowest SM.
// Included only by nvcc.
//
// Why: the resident row kernel is one wave of persistent clusters. Dealt out in turn, rows gave
// every cluster the same count, and the SMs of an H200 then finished 7-12% apart (bf16 8192 x 32000
// fused: SM active cycles 470k-541k over 541k elapsed). With a
// queue a fast SM takes more rows.
//
// How: a cluster's first `Stages` rows are dealt out as before (blockIdx.y + k gridDim.y, so no
// launch starts by waiting on an atomic); the rest come from a counter in the workspace header,
// ticket t being row Stages gridDim.y + t. One thread of the cluster's rank 0 (the taker) takes
// the ticket of item i + Stages while the CTA works on item i, so that it is in shared memory
// when the copy of that item is issued; it hands each ticket to the other ranks by st.async into
// their shared memory, one of `Slots` mailboxes each with a "full" mbarrier (the bytes landed) and,
// in rank 0, an "empty" one (every other rank has read it). A ticket past the last row ends the
// cluster's items; each cluster takes exactly one such, so the launch's last take is known and
// resets the counter to 0 for the next call.
//
// Where: launch_rows launches a queued form of the row kernel (policy::queue_form) for resident
// aligned rows of a forward or fused call given a workspace; other calls take the dealt form,
// which carries none of this code (with it, as a branch, dealt rows ran 2-5% slower).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../tuning/policy.cuh"
#include "async_copy.cuh"
#include "row_reduce.cuh"

namespace xent {
namespace cuda_detail {

/// Tickets a launch takes from the queue: the rows past those dealt out (`stages` a cluster, in
/// turn), and one past the last by every cluster whose dealt rows were all rows (those take until
/// they get one).
__host__ __device__ constexpr std::int64_t row_queue_takes(std::int64_t rows, std::int64_t clusters,
                                                           int stages) {
  const std::int64_t late = rows - (stages - 1) * clusters;
  const std::int64_t takers = late < 0 ? 0 : (late < clusters ? late : clusters);
  return (rows > stages * clusters ? rows - stages * clusters : 0) + takers;
}

/// Mailboxes of one CTA (every rank has them; rank 0's hold what its taker wrote).
template <int Slots>
struct row_queue_state {
  std::int64_t row[Slots];
  unsigned long long full[Slots];   ///< other ranks: the ticket landed (one arrival + 8 bytes)
  unsigned long long empty[Slots];  ///< rank 0: every other rank has read it
  bool dry;                         ///< the taker has taken its last ticket
};

template <int Stages, int Slots>
struct row_queue {
  static_assert(Slots >= Stages, "a mailbox is written again only once its item is issued");
  row_queue_state<Slots>& s;
  unsigned long long* counter;
  std::int64_t rows, clusters;  ///< the call's rows, gridDim.y
  int cluster, rank;

  /// Item k < Stages: dealt out in turn; may be past the last row.
  __device__ std::int64_t dealt(std::int64_t k) const { return blockIdx.y + k * clusters; }

  /// Thread 0, before the launch's first barrier (mbarrier_init_fence follows).
  __device__ void init() const {
    for (int i = 0; i < Slots; ++i) {
      mbarrier_init(&s.full[i], 1);
      mbarrier_init(&s.empty[i], cluster > 1 ? static_cast<unsigned>(cluster - 1) : 1u);
    }
    // A cluster whose dealt rows run out takes no ticket.
    s.dry = dealt(Stages - 1) >= rows;
  }

  /// The taker: whether it takes a ticket now (its item in hand is a row, not past the last).
  __device__ bool taking() const { return !s.dry; }

  /// The taker: one ticket from the counter, as a row (rows where the queue is empty); resets the
  /// counter on the launch's last take.
  __device__ std::int64_t take() const {
    const std::int64_t base = Stages * clusters;
    const auto t = static_cast<std::int64_t>(atomicAdd(counter, 1ull));
    // Every other take is in: the last one.
    if (t == row_queue_takes(rows, clusters, Stages) - 1) atomicExch(counter, 0ull);
    return base + t < rows ? base + t : rows;
  }

  /// The taker: item k's row (k >= Stages) into every rank's mailbox. Before its copy is issued.
  __device__ void post(std::int64_t k, std::int64_t n) const {
    const std::int64_t m = k - Stages;
    const int box = static_cast<int>(m % Slots);
    if (n >= rows) s.dry = true;
#if XENT_CUDA_SM90_PTX
    if (cluster > 1 && m >= Slots)  // its last ticket read by every other rank
      mbarrier_wait<true>(&s.empty[box], static_cast<unsigned>(m / Slots - 1) & 1u);
    const unsigned w[2] = {static_cast<unsigned>(n), static_cast<unsigned>(n >> 32)};
    for (int to = 1; to < cluster; ++to) push_words(&s.row[box], w, &s.full[box], to);
#endif
    s.row[box] = n;
  }

  /// Thread 0 of every rank, issuing item k (k >= Stages): its row, rows past the last.
  __device__ std::int64_t row_of_item(std::int64_t k) const {
    const std::int64_t m = k - Stages;
    const int box = static_cast<int>(m % Slots);
    if (rank == 0) return s.row[box];  // posted by this CTA before the item's stage was freed
#if XENT_CUDA_SM90_PTX
    mbarrier_arrive_expect(&s.full[box], 8);
    mbarrier_wait<true>(&s.full[box], static_cast<unsigned>(m / Slots) & 1u);
    const std::int64_t n = s.row[box];
    if (n < rows) mbarrier_arrive_in(&s.empty[box], 0);  // none is posted after the last
    return n;
#else
    return rows;
#endif
  }
};

}  // namespace cuda_detail
}  // namespace xent
