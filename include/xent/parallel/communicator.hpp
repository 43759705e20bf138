// What a vocab-parallel call needs from the group of ranks it runs on: one collective.
//
// A type G is a communicator when, for `const G& g`:
//   int g.rank()   this rank, in [0, g.size())
//   int g.size()   the number of ranks, >= 1
//   void g.all_gather(const void* send, void* recv, std::size_t bytes)
//       every rank passes the same `bytes`; afterwards, on every rank, recv[r * bytes, (r + 1) *
//       bytes) holds rank r's send bytes. On the CPU (inprocess_group) the call blocks until the
//       exchange is done; a device communicator (NCCL, ncclAllGather with ncclUint8) enqueues it
//       on the stream of the call's work, without a host synchronisation.
// xent never creates processes or communicators: the caller builds one and passes it in.
//
// Why an all-gather of fixed-size records and not an all-reduce. Each rank sends, per row, the
// statistics of its shard that the call merges (parallel/records.hpp: the online-LSE state and the
// target logit, 12 bytes with class ids; the sums label smoothing and soft targets need, and its
// argmax, only when the call reads them).
// Every rank then merges the R records of a row in rank order 0, 1, ..., R - 1 with the same code
// (slice_partial::merge on online_lse). The merge is not associative in float, but the same inputs
// in the same order give the same bits: every rank ends with bitwise-identical losses, LSEs and
// argmax, and the result does not depend on timing. An all-reduce would need a custom reduction
// operator (NCCL has none for a (max, sum) pair: a max all-reduce then a sum all-reduce is two
// collectives and a second pass) and would leave the order of combination to the library.
// Traffic per rank is R x (record bytes) per row, 4 to 32 bytes a record.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace xent {
namespace detail {

template <class G, class = void>
struct is_communicator : std::false_type {};

template <class G>
struct is_communicator<
    G, std::void_t<decltype(std::declval<const G&>().all_gather(
                       std::declval<const void*>(), std::declval<void*>(), std::size_t{})),
                   decltype(int{std::declval<const G&>().rank()}),
                   decltype(int{std::declval<const G&>().size()})>> : std::true_type {};

}  // namespace detail
}  // namespace xent
