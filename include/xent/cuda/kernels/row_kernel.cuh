// The CUDA row kernel that every entry point runs. Included only by nvcc.
//
// Each row's vocabulary is cut over the CTAs of a thread-block cluster; each CTA's slice is
// staged in shared memory (one bulk copy per chunk on sm_90, cp.async below it), loaded into
// registers once, and swept there: a max, a sum of exponentials, and the gradient, with the
// statistics merged over the warp, the CTA and the cluster in between. The row is read from HBM
// once when a slice fits one chunk (resident), the normal case up to 512 KiB rows. Plain fused
// resident rows on sm_90 sweep whole register tiles (the stages hold -inf past the slice) and
// write their gradient into a shared-memory stage of its own, stored by one bulk copy
// (policy::bulk_gradient); the others store it from registers. Plain fused rows that do not start
// on 16-byte boundaries are cut at their own (row_kernel's Shifted) where the gradient's rows
// share them; other unaligned rows are staged element by element.
#pragma once

#include <cooperative_groups.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../block/async_copy.cuh"
#include "../block/chunk_stats.cuh"
#include "../block/dtype.cuh"
#include "../block/row_args.cuh"
#include "../block/row_queue.cuh"
#include "../block/row_reduce.cuh"
#include "../block/row_sums.cuh"
#include "../block/tile.cuh"
#include "../block/tile_gradient.cuh"
#include "../cuda.cuh"
#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {

/// Stages `count` elements of a row with per-thread copies (below sm_90, or rows that are not
/// 16-byte aligned): 16-byte cp.async accesses when aligned (the last vector zero-filled past the
/// row's end, so nothing outside the row is read), plain loads otherwise.
template <int Block, bool Aligned, class T>
__device__ void stage_by_threads(T* stage, const T* src, int count) {
  if constexpr (Aligned) {
    constexpr int vec = 16 / sizeof(T);
    const int vectors = (count + vec - 1) / vec;
#pragma unroll 1
    for (int j = threadIdx.x; j < vectors; j += Block) {
      const int valid = count - j * vec < vec ? count - j * vec : vec;
      copy16_async(stage + j * vec, src + j * vec, valid * static_cast<int>(sizeof(T)));
    }
  } else {
    for (int j = threadIdx.x; j < count; j += Block) stage[j] = src[j];
  }
}

/// What a CTA knows of the row it is on.
struct row_state {
  std::int64_t n = 0;
  row_gradient rg{0.0f, 0.0f, 0.0f, 1.0f, -1};  ///< y = -1: soft targets
  bool skip = false;     ///< ignored or out of range: no statistics, zero gradient
  bool invalid = false;  ///< out of range: NaN loss, counted as a device error
};

/// The row kernel. Grid (cluster, clusters in flight): the CTAs of one cluster share a row, CTA
/// `rank` owning classes [rank * slice, (rank + 1) * slice), and each cluster walks rows
/// blockIdx.y, + gridDim.y, ... (persistent).
///
/// The work of a cluster is a sequence of items. A resident row (its slice fits one chunk) is one
/// item, and rows are pipelined: while row i's partial crosses the cluster, the CTA takes row
/// i + 1's statistics from shared memory, and only then merges row i and writes its gradient from
/// registers. A longer row takes `chunks` statistics items then `chunks` gradient items, each
/// chunk staged twice. Item k lands in stage k % Stages with the row's target and saved LSE, so no
/// iteration waits on a dependent global load. On sm_90 with aligned rows, thread 0 stages a
/// whole item with one bulk copy that a "landed" mbarrier tracks, and refills a stage as soon as
/// every warp is done with it ("freed"): no CTA-wide barrier guards the copies. Otherwise every
/// thread copies its share with cp.async, and one barrier per item serves both the landed copy
/// and the freed stage.
template <int Block, int Regs, int Stages, bool Aligned, bool Plain, pass P, class T, class G,
          class Tgt, bool Shifted = false, row_queue_form Queue = row_queue_form::none>
XENT_KERNEL void __launch_bounds__(
    Block, row_shape<Block, Regs>::blocks_at(
               policy::min_blocks<T, P == pass::backward,
                                  policy::template keep_exps<T, Plain, P == pass::fused> ||
                                      (Aligned && Plain && P == pass::fused)>()))
    row_kernel(row_args<T, G, Tgt> a) {
#if XENT_CUDA_SM90_PTX
  constexpr bool bulk = Aligned;
#else
  constexpr bool bulk = false;
#endif
  // Shifted: plain fused resident rows that need not start on a 16-byte boundary, each gradient row
  // on the same boundaries as its logits row (policy::shifted_rows). Row n is cut at its own
  // boundaries: rank r owns [r slice - lead, (r + 1) slice - lead), lead = lead_of(row n), so
  // every tile starts on a boundary. Rank 0's first vector is copied whole from the boundary
  // before the row (bytes of the same allocation: the row before's, or those before the first
  // row, which a 16-byte aligned allocation holds) and its lead elements set to -inf in the stage
  // by thread 0, the only thread that reads that vector; they are never stored. The plan leaves
  // the last rank room (slices of cols + vec - 1 classes), and launches resident rows alone.
  static_assert(!Shifted || (Aligned && Plain && P == pass::fused && sizeof(T) == sizeof(G)),
                "shifted rows: plain fused rows whose gradient has the logits' element size");
  // Fused resident rows whose gradient leaves by one bulk copy from a stage after the logits'
  // stages (policy::bulk_gradient).
  constexpr bool store_bulk = bulk && policy::template bulk_gradient<T, G, Plain, P == pass::fused>;
  if constexpr (Shifted && !store_bulk) {  // never launched: launch_rows refuses it (see there)
    (void)a;
    return;
  }
  // Exponentials kept from the statistics for the gradient (policy::exp_once): plain fused
  // 16-bit resident rows finished before the next row's statistics.
  constexpr bool keep_exps = policy::template keep_exps<T, Plain, P == pass::fused>;
  // Plain fused resident rows staged by bulk copies sweep whole tiles (whole_extent) when the
  // slice is whole vectors: the logits stages hold -inf past the slice (filled below, never
  // overwritten: a row's copy covers its slice alone), so no sweep tests a vector. Rows that
  // keep their exponentials need the gradient stage for it (it is written whole too).
  // Shifted rows too: the CTA where a row ends holds a count that moves with the row's lead, so
  // after each copy lands the threads owning the vectors past that count (at most two) set them
  // to -inf over what a longer row's copy left there, and fence that for the next copy.
  constexpr bool whole_capable = bulk && Plain && P == pass::fused && (!keep_exps || store_bulk);
  using part_t = std::conditional_t<Plain, row_partial, slice_partial>;
  using exchange_t = row_exchange<part_t, Block>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ std::int64_t stage_target[Stages];
  __shared__ float stage_lse[Stages];
  __shared__ unsigned long long landed[Stages], freed[Stages];
  // Raw storage: shared memory takes no initialiser (the mbarriers are set up below).
  using exchange_state = row_exchange_state<part_t, exchange_t::warps>;
  __shared__ alignas(exchange_state) unsigned char exchange_bytes[sizeof(exchange_state)];
  exchange_t ex{*reinterpret_cast<exchange_state*>(exchange_bytes), a.cluster};
  // Rows from the launch's queue (policy::row_queue, row_queue.cuh, `Queue`), for resident rows
  // staged by bulk copies, forward or fused, on 16-byte boundaries, where the call gave a
  // workspace (launch_rows launches a queued form only there). Item k's row is then
  // stage_row[k % Stages], set by thread 0 as it issues the item's copy (rows, past the last
  // item). Own kernel: every queue test is resolved at compile time and the streaming path is
  // left out; branch: `queued` is decided at run time (policy::queue_form says why both exist).
  static_assert(Queue == row_queue_form::none || (Aligned && P != pass::backward && !Shifted),
                "the queue serves aligned forward and fused rows");
  constexpr bool queue_code = Queue != row_queue_form::none && bulk;
  constexpr bool own_queue = queue_code && Queue == row_queue_form::own_kernel;
  constexpr int queue_slots = 2 * Stages;
  static_assert(!queue_code || Block >= 64, "the queue's taker is thread 32");
  __shared__ row_queue_state<queue_slots> queue_boxes;
  __shared__ std::int64_t stage_row[Stages];
  __shared__ std::int64_t queue_end;  // thread 0: the first item past the last row

  const int rank = static_cast<int>(blockIdx.x);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t v0 = rank * a.slice;
  const std::int64_t v1 = v0 + a.slice < a.cols ? v0 + a.slice : a.cols;
  const int chunks = static_cast<int>(a.chunks);
  const bool resident = chunks == 1;
  constexpr int tile_elems = Regs * Block * (16 / static_cast<int>(sizeof(T)));
  const int slice_count = static_cast<int>(v1 - v0 < a.chunk ? (v1 > v0 ? v1 - v0 : 0) : a.chunk);
  const bool whole = whole_capable && resident &&
                     (Shifted || slice_count % (16 / sizeof(T)) == 0) &&
                     a.chunk_bytes >= tile_elems * sizeof(T);
  constexpr bool want_grad = P != pass::forward;
  // Backward needs statistics only for soft targets (their mass); the LSE comes from forward.
  constexpr bool want_stats = P != pass::backward || Tgt::soft;
  const int stat_items = want_stats ? chunks : 0;
  const int per_row = resident ? 1 : stat_items + (want_grad ? chunks : 0);
  const std::int64_t my_rows =
      a.rows > blockIdx.y ? (a.rows - blockIdx.y + gridDim.y - 1) / gridDim.y : 0;
  const std::int64_t items = my_rows * per_row;
  const bool queued = own_queue || (queue_code && resident && a.queue != nullptr);
  const bool need_reduce = a.workspace && (a.loss || a.num_correct) && P != pass::backward;
  const row_queue<Stages, queue_slots> queue{queue_boxes, a.queue,   a.rows,
                                             gridDim.y,   a.cluster, rank};
  // The thread of rank 0 that takes tickets (warp 1: warp 0 waits on the cluster and issues the
  // copies).
  const bool taker = queued && rank == 0 && threadIdx.x == 32;
  std::int64_t rows_here = my_rows;  // rows this CTA took statistics of
  auto stage = [&](std::int64_t k) {
    return reinterpret_cast<T*>(smem + static_cast<std::size_t>(k % Stages) * a.chunk_bytes);
  };
  auto gradient_stage = [&] { return reinterpret_cast<G*>(smem + Stages * a.chunk_bytes); };
  // A resident row is one item: no division by per_row on the row's path.
  auto row_of = [&](std::int64_t k) -> std::int64_t {
    if constexpr (queue_code)
      if (queued) return stage_row[k % Stages];
    return blockIdx.y + (resident ? k : k / per_row) * gridDim.y;
  };
  // Where this CTA's part of row n starts and ends (Shifted: lead(n) classes earlier).
  auto row_lead = [&](std::int64_t n) { return Shifted ? lead_of(a.logits + n * a.ld) : 0; };
  auto part_of = [&](std::int64_t n, std::int64_t& lo, std::int64_t& hi) {
    lo = v0;
    hi = v1;
    if constexpr (Shifted) {
      lo -= row_lead(n);
      hi = lo + a.slice < a.cols ? lo + a.slice : a.cols;
    }
  };
  auto chunk_span = [&](std::int64_t k, std::int64_t& base, int& count) {
    const int c = resident ? 0 : static_cast<int>(k % per_row) % chunks;
    std::int64_t lo, hi;
    part_of(row_of(k), lo, hi);
    base = lo + static_cast<std::int64_t>(c) * a.chunk;
    const std::int64_t rest = hi - base;
    count = static_cast<int>(rest < a.chunk ? (rest > 0 ? rest : 0) : a.chunk);
  };
  // Item k's target and saved LSE, copied with its first chunk (a 4-byte id into the low half).
  auto copy_row_scalars = [&](std::int64_t k, std::int64_t n) {
    if constexpr (!Tgt::soft)
      copy_small_async<sizeof(*a.targets.ids)>(&stage_target[k % Stages], a.targets.ids + n);
    if constexpr (P == pass::backward) copy_small_async<4>(&stage_lse[k % Stages], a.lse_in + n);
  };
  constexpr bool row_scalars = !Tgt::soft || P == pass::backward;
  // Ignored rows are copied too: knowing that first would put a dependent load before the copy.
  auto issue_bulk = [&](std::int64_t k) {  // thread 0 only
    if (queue_code && queued) {
      if (k > queue_end) return;
      const std::int64_t n = k < Stages ? queue.dealt(k) : queue.row_of_item(k);
      stage_row[k % Stages] = n < a.rows ? n : a.rows;
      if (n >= a.rows) {  // no row: its waiters learn so from stage_row
        queue_end = k;
        mbarrier_arrive_expect(&landed[k % Stages], 0);
        return;
      }
    } else if (k >= items) {
      return;
    }
    // Thread 0's -inf over a lead (generic proxy) is ordered before the copy that overwrites it.
    if constexpr (Shifted) fence_async_shared();
    const std::int64_t n = row_of(k);
    const bool first = resident || k % per_row == 0;
    std::int64_t base;
    int count;
    chunk_span(k, base, count);
    unsigned long long* bar = &landed[k % Stages];
    const char* src = reinterpret_cast<const char*>(a.logits + n * a.ld + base);
    char* dst = reinterpret_cast<char*>(stage(k));
    const unsigned bytes = static_cast<unsigned>(count) * sizeof(T);
    const unsigned whole = bytes & ~15u;  // bulk copies move 16-byte multiples
    bool tail = bytes != whole;
    if (Shifted && tail && n == a.rows - 1) {
      // The tensor's last bytes, which may end its allocation: a 16-byte copy of fewer bytes is
      // a 16-byte read to compute-sanitizer, so plain loads, published by the arrive below. (A
      // shifted row's tail is otherwise followed by the next row.)
      for (unsigned b = whole; b < bytes; b += sizeof(T))
        *reinterpret_cast<T*>(dst + b) = *reinterpret_cast<const T*>(src + b);
      tail = false;
    }
    if (tail) copy16_async(dst + whole, src + whole, static_cast<int>(bytes - whole));
    if (first) copy_row_scalars(k, n);
    if (tail || (first && row_scalars)) mbarrier_track_copies(bar);
    mbarrier_arrive_expect(bar, whole);
    if (whole) bulk_copy(dst, src, whole, bar);
  };
  // Issues item k's copies (or none) and always commits a group, so group counts stay uniform.
  auto issue_by_threads = [&](std::int64_t k) {
    if (k < items) {
      std::int64_t base;
      int count;
      chunk_span(k, base, count);
      stage_by_threads<Block, Aligned>(stage(k), a.logits + row_of(k) * a.ld + base, count);
      if (threadIdx.x == 0 && k % per_row == 0) copy_row_scalars(k, row_of(k));
    }
    __pipeline_commit();
  };
  // Waits until item k has landed in its stage.
  auto wait_item = [&](std::int64_t k) {
    if constexpr (bulk) {
      mbarrier_wait(&landed[k % Stages], static_cast<unsigned>(k / Stages) & 1u);
    } else {
      // Copies issued so far reach item k + Stages - 2: waiting for all but Stages - 2 of them
      // lands item k. One barrier then serves twice: item k is visible to every thread, and every
      // thread is done with item k - 1, whose stage the next copy refills.
      __pipeline_wait_prior(Stages - 2);
      __syncthreads();
      issue_by_threads(k + Stages - 1);
    }
  };
  // Every thread is done with item k's stage: with bulk copies, thread 0 refills it once every
  // warp has said so (the per-thread path refills at the next wait_item).
  auto release_item = [&](std::int64_t k) {
    if constexpr (bulk) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&freed[k % Stages]);
      if (threadIdx.x == 0) {
        mbarrier_wait(&freed[k % Stages], static_cast<unsigned>(k / Stages) & 1u);
        issue_bulk(k + Stages);
      }
    }
  };
  // The row of item k (its first), from the scalars staged with it.
  auto begin_row = [&](std::int64_t k) {
    row_state r;
    r.n = row_of(k);
    if constexpr (!Tgt::soft) {
      std::int64_t y = stage_target[k % Stages];
      if (sizeof(*a.targets.ids) == 4) y = static_cast<std::int32_t>(y & 0xffffffff);
      r.skip = skipped_target(a, y);
      r.invalid = r.skip && y != a.ignore_index;
      r.rg.y = y - a.first;  // the target's column in this shard
      if (!r.skip && a.weights) r.rg.w_y = full_weights(a)[y];
    }
    if constexpr (P == pass::backward) r.rg.lse = stage_lse[k % Stages];
    return r;
  };
  // Statistics of item k into `part`, with the target's logit if the chunk holds it.
  // `whole_tiles`: std::true_type where the stage holds -inf past the chunk (whole_capable).
  // `swept`: the vectors per thread the sweeps cover (Regs, fewer for trimmed whole tiles).
  auto item_stats = [&](std::int64_t k, const row_state& r, part_t& part, auto whole_tiles,
                        auto swept) {
    std::int64_t base;
    int count;
    chunk_span(k, base, count);
    const T* chunk = stage(k);
    chunk_stats<Plain, decltype(swept)::value, Block, decltype(whole_tiles)::value>(
        a, chunk, count, r.n, base, part);
    if constexpr (!Tgt::soft) {
      if (threadIdx.x == 0 && r.rg.y >= base && r.rg.y < base + count)
        stats_of(part).target_logit = capped<Plain>(chunk[r.rg.y - base], a.k);
    }
  };
  // Merges a thread's partial over its warp (lanes share the warp's max: see chunk_stats).
  auto warp_total = [&](const part_t& part) { return warp_merge<32>(part); };
  // Scalar upstream gradient (scale * *scale_ptr / W), summed by every CTA (see below).
  double scalar = 0.0;
  // The row's statistics are complete: its loss and side outputs, and the constants of its
  // gradient.
  auto finish_stats = [&](row_state& r, const part_t& row) {
    const row_partial& st = stats_of(row);
    if constexpr (P != pass::backward) r.rg.lse = st.lse.lse();
    float mass;
    if constexpr (Tgt::soft) {
      mass = a.mass_in ? a.mass_in[r.n] : st.mass;
    } else {
      mass = class_target_mass(r.rg.w_y, a.k);
    }
    if constexpr (P != pass::backward) {
      float loss;
      if constexpr (Tgt::soft) {
        loss = soft_row_loss(st, a.k);
      } else {
        loss = class_row_loss(st, r.rg.w_y, a.k);
      }
      // A vocab-parallel shard's forward writes its record instead (the merge writes the
      // outputs). Only forwards take records: fused kernels carry none of this code.
      bool recorded = false;
      if constexpr (P == pass::forward) {
        if (rank == 0 && threadIdx.x == 0 && a.records.block) {
          slice_partial rec;
          rec.stats = st;
          rec.argmax = argmax_of(row);
          if (rec.argmax.index >= 0) rec.argmax.index += a.first;  // a global class id
          a.records.put(r.n, rec);
          recorded = true;
        }
      }
      if (!recorded && rank == 0 && threadIdx.x == 0)
        write_row_outputs(a, r.n, loss, r.rg.lse, best_of(row), best_of(row) == r.rg.y,
                          need_reduce);
    }
    if constexpr (want_grad) {
      r.rg.g = row_scale(a, r.n, scalar);
      r.rg.alpha = gradient_alpha(mass, r.rg.lse, a.k);
    }
  };
  // An ignored or out-of-range row: zero gradient, loss 0 (ignored) or NaN (out of range).
  auto finish_skipped = [&](const row_state& r) {
    if (rank == 0 && threadIdx.x == 0)
      write_skipped_row(a, r.n, r.invalid, P != pass::backward, need_reduce);
    if (want_grad) {
      G* out = a.grad + r.n * a.grad_ld;
      std::int64_t lo = v0, hi = v1;
      if constexpr (Shifted) {
        part_of(r.n, lo, hi);
        if (lo < 0) lo = 0;
      }
      for (std::int64_t c = lo + threadIdx.x; c < hi; c += Block) out[c] = from_float<G>(0.0f);
    }
  };

  const bool use_cluster = a.cluster > 1 && want_stats;
  if (whole) {  // -inf past the slice in every logits stage, before the barrier below
    for (int s = 0; s < Stages; ++s)
      for (int j = slice_count + static_cast<int>(threadIdx.x); j < tile_elems; j += Block)
        stage(s)[j] = negative_infinity<T>();
  }
  if (threadIdx.x == 0) {
    if constexpr (bulk) {
      for (int s = 0; s < Stages; ++s) {
        mbarrier_init(&landed[s], 1);
        mbarrier_init(&freed[s], Block / 32);
      }
    }
    if (use_cluster) ex.init();
    if (queue_code && queued) {
      queue.init();
      queue_end = INT64_MAX;
    }
    mbarrier_init_fence();
  }
#if XENT_CUDA_SM90_PTX
  if (use_cluster)
    cooperative_groups::this_cluster().sync();  // once per launch, not per row
  else
    __syncthreads();
#else
  __syncthreads();
#endif
  if constexpr (bulk) {
    if (threadIdx.x == 0)
      for (int k = 0; k < Stages; ++k) issue_bulk(k);
  } else {
    for (int k = 0; k < Stages - 1; ++k) issue_by_threads(k);
  }

  // Per-launch constants, summed by every CTA while its first copies are in flight: one launch
  // per call, where a separate kernel cost a launch (17 us for 32 x 32000).
  if (a.weights && a.k.smooth != 0.0f)
    a.k.weight_sum = static_cast<float>(class_weight_sum<Block>(full_weights(a), a.vocab));
  // The mean's normaliser, once per CTA for the gradient's scale and the reduced loss alike.
  const double normalizer =
      a.reduce == reduction::mean && (P != pass::forward || need_reduce)
          ? (a.normalizer_ahead ? normalizer_from_ahead(a.workspace)
                                : mean_normalizer<Block, true>(a.targets, a.rows, a.vocab,
                                                               a.ignore_index, full_weights(a)))
          : 1.0;
  if (a.reduce != reduction::none && P != pass::forward)
    scalar = scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer);

  int sent = 0, received = 0;  // rows whose partials crossed the cluster, each way
  const bool warp0 = threadIdx.x < 32;
  // Row i's warp partials, published, handed to warp 0 (the consumer) by named barrier 1 + i % 2:
  // the other warps arrive and move on. Without split barriers (policy::split_barriers) it is a
  // full CTA barrier.
  constexpr bool split = policy::split_barriers;
  auto partials_handoff = [](std::int64_t i, bool consumer) {
    parity_handoff<1, Block, split>(i, consumer);
  };
  if (resident) {
    // Iteration i takes row i's statistics and finishes row i - 1 (prev), whose values wait in
    // registers (tile) while its partial crosses the cluster. Only warp 0 waits for the cluster:
    // it receives row i - 1 first thing (sent a row ago, so it has usually landed), and named
    // barriers, one pair per row parity, hand over the rest: warps 1.. arrive with row i's
    // partials and move on, warp 0 waits for them to send; warp 0 arrives with row i - 1's result,
    // which the other warps wait for only when its gradient is due.
    // Barrier ids: 1 + parity for row partials (partials_handoff), 3 + parity for row results.
    auto result_ready = [](std::int64_t i) {  // warp 0, once result(i) is written
      if (split) i & 1 ? named_barrier_arrive<4>(Block) : named_barrier_arrive<3>(Block);
    };
    auto result_wait = [](std::int64_t i, bool producer) {  // every thread, before gradient(i)
      if (!split)
        __syncthreads();
      else if (!producer)
        i & 1 ? named_barrier_sync<4>(Block) : named_barrier_sync<3>(Block);
    };
    // Row n's gradient, written by every thread over the gradient stage (G, count elements from
    // v0), leaves by one bulk copy from thread 0: the writers fence their stores to the async
    // proxy and arrive at named barrier 5, which warp 0 waits on. One barrier id serves every
    // row: a warp reaches row i + 1's arrive only past result_wait(i + 1), which warp 0 opens
    // after its wait here for row i. The bytes past the whole vectors go by plain stores.
    auto store_gradient = [&](std::int64_t n, int count) {
      fence_async_shared();
      if (!split)
        __syncthreads();
      else if (warp0)
        named_barrier_sync<5>(Block);
      else
        named_barrier_arrive<5>(Block);
      if (threadIdx.x == 0) {
        if constexpr (Shifted) {  // rank 0's lead elements are another row's (or no row's)
          const int lead = row_lead(n);
          store_row_tile<true>(a.grad + n * a.grad_ld + v0 - lead, gradient_stage(), count,
                               rank == 0 ? lead : 0);
        } else {  // store_row_tile<false>'s work, as written before it: that call moved the SASS
          constexpr int vec = 16 / static_cast<int>(sizeof(G));
          G* out = a.grad + n * a.grad_ld + v0;
          const G* src = gradient_stage();
          const int vectors = count / vec * vec;
          if (vectors) bulk_store(out, src, static_cast<unsigned>(vectors * sizeof(G)));
          for (int e = vectors; e < count; ++e) out[e] = src[e];
        }
      }
    };
    // Row i - 1 is finished after row i's statistics (its cluster round trip hidden behind them,
    // its tile held in registers meanwhile) or before them (the tile is then live only between
    // rows: see policy::overlap_rows).
    constexpr bool overlap = policy::template overlap_rows<T, P == pass::fused>;
    // Whole tiles (whole_extent) where the stage's tail holds -inf: copies of the loop for
    // slices of whole vectors (the tail filled once per launch), swept over all of each thread's
    // vectors or the first `swept` (policy::trim_tiles), and for the rest.
    auto resident_rows = [&](auto whole_tiles, auto swept) {
      constexpr bool whole_tile = decltype(whole_tiles)::value;
      constexpr int R = decltype(swept)::value;
      using held_t = std::conditional_t<keep_exps, exp_tile<T, R, Block, whole_tile>,
                                        row_tile<T, R, Block, whole_tile>>;
      held_t tile;
      row_state prev;
      for (std::int64_t i = 0;; ++i) {
        // Queued, whether item i is a row is known once it has landed.
        bool has_cur = queued || i < my_rows;
        const int slot = static_cast<int>(i & 1);
        const bool prev_stats = want_stats && i > 0 && !prev.skip;
        if (prev_stats) {
          if (warp0) {
            ex.receive(slot ^ 1, received);
            // The gradient stage is free once the last row's bulk store has read it; the other
            // warps write it only past result_ready.
            if (store_bulk && threadIdx.x == 0) bulk_stores_wait<0>();
            if (want_grad) result_ready(i - 1);
          }
          ++received;
        }
        // Row i - 1's loss, outputs and gradient.
        auto finish_prev = [&] {
          if (i == 0) return;
          if (prev.skip) {
            finish_skipped(prev);
          } else if (want_grad) {
            if (prev_stats) result_wait(i - 1, warp0);
            finish_stats(prev, want_stats ? ex.result(slot ^ 1) : part_t{});
            if constexpr (store_bulk) {
              const std::int64_t base = v0 - row_lead(prev.n);
              tile_gradient<Plain, Aligned>(a, tile, prev.n, base, prev.rg,
                                            gradient_stage() - base);
              store_gradient(prev.n, tile.count);
            } else {
              tile_gradient<Plain, Aligned>(a, tile, prev.n, v0, prev.rg,
                                            a.grad + prev.n * a.grad_ld);
            }
          } else if (warp0) {  // forward: warp 0 alone writes the row's outputs
            finish_stats(prev, ex.result(slot ^ 1));
          }
        };
        if (!overlap) finish_prev();
        row_state cur;
        if (has_cur) {
          wait_item(i);
          if (queue_code && queued) has_cur = stage_row[i % Stages] < a.rows;
        }
        if (has_cur) {
          // Item i + Stages's ticket, posted at once: a ticket held until this warp is done
          // with item i, or taken a row ahead, made the pass 1-15% slower.
          if (queue_code && taker && queue.taking()) queue.post(i + Stages, queue.take());
          cur = begin_row(i);
          if constexpr (Shifted) {  // rank 0's lead: -inf, in the vector thread 0 alone reads
            if (rank == 0 && threadIdx.x == 0)
              for (int e = row_lead(cur.n); e-- > 0;) stage(i)[e] = negative_infinity<T>();
            if constexpr (decltype(whole_tiles)::value) {
              // Past the row's end, -inf again: the copy's last vector holds zeros there (a
              // 16-byte cp.async of fewer bytes fills the rest) and a row of a larger lead may
              // have left logits up to `dirty` (the launch filled the rest). Each thread over its
              // own vectors, the ones its sweeps read.
              constexpr int vec = 16 / static_cast<int>(sizeof(T));
              std::int64_t base;
              int count;
              chunk_span(i, base, count);
              const int dirty = (slice_count + 2 * vec - 2) / vec * vec;
              const int end = dirty < tile_elems ? dirty : tile_elems;
              if (count < a.slice) {
                bool wrote = false;
                for (int j = count / vec; j * vec < end; ++j) {
                  if (j % Block != static_cast<int>(threadIdx.x)) continue;
                  for (int e = 0; e < vec; ++e)
                    if (j * vec + e >= count) stage(i)[j * vec + e] = negative_infinity<T>();
                  wrote = true;
                }
                if (wrote) fence_async_shared();  // before this stage is freed and refilled
              }
            }
          }
          if (want_stats && !cur.skip) {
            part_t part{};
            if constexpr (keep_exps) {
              std::int64_t base;
              int count;
              chunk_span(i, base, count);
              chunk_stats_keeping_exps<R, Block>(stage(i), count, part, tile);
              if (threadIdx.x == 0 && cur.rg.y >= base && cur.rg.y < base + count)
                stats_of(part).target_logit = to_float(stage(i)[cur.rg.y - base]);
            } else {
              item_stats(i, cur, part, whole_tiles, swept);
            }
            ex.publish(warp_total(part), slot);
            partials_handoff(i, warp0);
            if (warp0) ex.send(slot, sent);
            ++sent;
          }
          if (!want_grad || keep_exps) release_item(i);
        }
        if (overlap) finish_prev();
        if constexpr (want_grad && !keep_exps) {
          if (has_cur) {
            if (!cur.skip) {
              std::int64_t base;
              int count;
              chunk_span(i, base, count);
              tile.load(stage(i), count);
            }
            release_item(i);
          }
        }
        prev = cur;
        if (!has_cur) {
          rows_here = i;
          break;
        }
      }
    };
    using all_vectors = std::integral_constant<int, Regs>;
    if constexpr (whole_capable) {
      if (!whole) {
        resident_rows(std::false_type{}, all_vectors{});
      } else if constexpr (policy::trim_tiles && Block == policy::block && Regs > 2) {
        auto fills = [&](int r) { return a.slice <= std::int64_t{r} * Block * (16 / sizeof(T)); };
        if (fills(Regs - 2))
          resident_rows(std::true_type{}, std::integral_constant<int, Regs - 2>{});
        else if (fills(Regs - 1))
          resident_rows(std::true_type{}, std::integral_constant<int, Regs - 1>{});
        else
          resident_rows(std::true_type{}, all_vectors{});
      } else {
        resident_rows(std::true_type{}, all_vectors{});
      }
    } else {
      resident_rows(std::false_type{}, all_vectors{});
    }
  } else if constexpr (!Shifted && !own_queue) {  // launch_rows: these rows are resident
    // Rows longer than a cluster holds: per chunk, statistics items, then gradient items that
    // stage the chunk again; each row's statistics cross the cluster before its gradient.
    row_state cur;
    part_t part{};
    for (std::int64_t k = 0; k < items; ++k) {
      wait_item(k);
      const int j = static_cast<int>(k % per_row);
      if (j == 0) {
        cur = begin_row(k);
        part = part_t{};
      }
      const bool stats_item = want_stats && j < stat_items;
      row_tile<T, Regs, Block> tile;  // the stage is released before the gradient here
      if (!cur.skip) {
        if (stats_item) {
          item_stats(k, cur, part, std::false_type{}, std::integral_constant<int, Regs>{});
        } else {
          std::int64_t base;
          int count;
          chunk_span(k, base, count);
          tile.load(stage(k), count);
        }
      }
      release_item(k);
      if (cur.skip) {
        if (j == 0) finish_skipped(cur);
        continue;
      }
      if (!want_grad && !use_cluster && j == stat_items - 1) {
        // A forward CTA streaming whole rows: warp 0 alone finishes the row while the other
        // warps go on to the next row's chunks. A partial slot is published into again two rows
        // later, which needs a chunk that thread 0 stages only after warp 0 has taken this one.
        ex.publish(warp_total(part), sent & 1);
        partials_handoff(sent, warp0);
        if (warp0) {
          ex.send(sent & 1, sent);
          finish_stats(cur, ex.result(sent & 1));
        }
        ++sent;
      } else if (want_stats ? j == stat_items - 1 : j == 0) {
        part_t row{};
        if (want_stats) {
          ex.publish(warp_total(part), sent & 1);
          __syncthreads();
          if (threadIdx.x < 32) {
            ex.send(sent & 1, sent);
            ex.receive(sent & 1, sent);
          }
          __syncthreads();
          row = ex.result(sent & 1);
          ++sent;
        }
        finish_stats(cur, row);
      }
      if (want_grad && !stats_item) {
        std::int64_t base;
        int count;
        chunk_span(k, base, count);
        tile_gradient<Plain, Aligned>(a, tile, cur.n, base, cur.rg, a.grad + cur.n * a.grad_ld);
      }
    }
  }
  if constexpr (!bulk) __pipeline_wait_prior(0);  // no copy is left in flight at exit
  if constexpr (store_bulk) {
    if (threadIdx.x == 0) bulk_stores_wait<0, true>();
  }
#if XENT_CUDA_SM90_PTX
  // Queued: the other ranks' last reads of rank 0's mailboxes and arrivals on them are done
  // before any CTA of the cluster exits.
  if (queue_code && queued && a.cluster > 1) cooperative_groups::this_cluster().sync();
#endif
  if (need_reduce && rank == 0) {
    finish_reduction<Block>(a.workspace, a.rows, static_cast<std::uint64_t>(rows_here), a.loss,
                            a.num_correct, normalizer);
  }
}

}  // namespace cuda_detail
}  // namespace xent
