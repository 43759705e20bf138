// xent_bench_cpu: xent::forward and xent::forward_backward on the CPU backend, against memory
// roofs measured by this binary in this run.
//
//   xent_bench_cpu --benchmark_min_time=0.2 [--refresh_inplace] [--xent_threads=1,2,8]
//                  [--xent_chunks=512,1024] --benchmark_out=bench/results/cpu-HOST-DATE.json
//                  --benchmark_out_format=json
//
// Lines (every one in real time; threads T = 1, 2 and std::thread::hardware_concurrency() unless
// --xent_threads says otherwise; chunk sweep C = 512, 1024, 2048, 4096, 8192 unless --xent_chunks):
//   copy_roof/threads:T        memcpy of >= 1 GiB in T contiguous pieces, bytes read + written
//   read_roof/threads:T        a sum over >= 1 GiB (forward's access pattern), bytes read
//   update_roof/threads:T      x[i] *= c in place over >= 1 GiB (in-place forward_backward's
//                              pattern), bytes read + written
//   forward/DTYPE/NxV/threads:T             class-id targets (int64), mean; outputs loss + LSE
//   forward_backward/DTYPE/NxV/threads:T    the same plus the gradient, in place over the logits
//   forward_backward_out_of_place/f32/4096x32000/threads:T    gradient to a separate float buffer
//   backward/f32/4096x32000/threads:T       xent::backward: that gradient from the LSE a forward
//                                           saved (untimed, before the timed loop)
//   forward/DTYPE/NxV/chunk:C/threads:T, forward_backward/DTYPE/NxV/chunk:C/threads:T
//                              xent::cpu{T, C}: the policy's chunk swept (training shapes)
// Counters:
//   bytes_per_second   the minimum traffic: forward N*V*sizeof(T); forward_backward that plus
//                      N*V*sizeof(gradient)
//   items_per_second   logits elements
//   roof_pct           bytes_per_second / copy_roof of the same thread count * 100 (the reference)
//   read_roof_pct      forward lines: the same over read_roof
//   update_roof_pct    in-place lines: the same over update_roof
//   other_cores        cores' worth of CPU other processes used meanwhile (host_load.hpp); a line
//                      with other_cores near 1 on a 2-core machine shared a core and is not clean
//   loss, input_sets   the last call's loss; how many input sets the line rotates through
//
// Inputs are normal-ish (mean 0, sd 1) logits and uniform class ids. A shape whose logits are
// smaller than max(4 x LLC, 256 MiB) gets several input sets, used in turn, so that every call
// reads from DRAM as the roofs do rather than from cache (METHOD.md). After each line the loss,
// the LSE and (for forward_backward) the gradient of the last call are checked (finite, |g| <= 1/N,
// rows summing to ~0); a failed check turns the line into an error.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <xent/xent.hpp>

#include "common/host_load.hpp"
#include "common/host_roof.hpp"
#include "common/random_fill.hpp"
#include "common/traffic.hpp"

namespace {

namespace xb = xent_bench;

// With --refresh_inplace, in-place forward_backward copies pristine logits back before every call
// (PauseTiming, outside the timed region). Off by default: see `run_cross_entropy`.
bool refresh_inplace = false;

// ---------------------------------------------------------------------------------------------
// The roofs.
// ---------------------------------------------------------------------------------------------

// The buffers live from the first roof line to the first cross-entropy line, so Google
// Benchmark's repeated calls of one line do not re-touch 2+ GiB each time.
std::unique_ptr<xb::roof_buffers> roof_buffers;

xb::roof_buffers& roof_buffers_for(int threads) {
  const std::size_t bytes = xb::roof_bytes(threads);
  if (!roof_buffers || roof_buffers->bytes() != bytes) {
    roof_buffers.reset();
    roof_buffers = std::make_unique<xb::roof_buffers>(bytes);
  }
  return *roof_buffers;
}

std::string roof_key(xb::roof_kind k, int threads) {
  return std::string(xb::roof_name(k)) + "/threads:" + std::to_string(threads);
}

void bm_roof(benchmark::State& state, xb::roof_kind kind) {
  const int threads = static_cast<int>(state.range(0));
  auto& buf = roof_buffers_for(threads);
  // Timed again here, around the same loop the framework times, so that roof_pct divides by the
  // bytes/s this line prints (to within microseconds of a >= 100 ms loop).
  const xb::cpu_sample load0 = xb::sample_cpu();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    buf.run(kind, threads);
    benchmark::ClobberMemory();
  }
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - t0;
  const double others = xb::other_cores(load0, xb::sample_cpu());
  const double traffic = static_cast<double>(buf.traffic(kind));
  // The line runs a fixed number of iterations (register_all), so every call of it is a reported
  // one (one per repetition) and the table's best is a printed figure.
  if (state.iterations() > 0 && seconds.count() > 0)
    xb::roof_table::instance().record(
        roof_key(kind, threads),
        traffic * static_cast<double>(state.iterations()) / seconds.count());
  state.SetBytesProcessed(static_cast<std::int64_t>(traffic) * state.iterations());
  state.counters["buffer_MiB"] = static_cast<double>(buf.bytes()) / xb::mib;
  state.counters["other_cores"] = others;
}

/// The roof of `kind` for `threads`: the best KIND_roof/threads:T line of this run (its bytes/s as
/// printed; the best repetition under --benchmark_repetitions), or measured here (mean of four
/// passes after a warm-up) if that line did not run, e.g. under --benchmark_filter.
double roof(xb::roof_kind kind, int threads) {
  return xb::roof_table::instance().get(roof_key(kind, threads), [&] {
    const double r = roof_buffers_for(threads).measure(kind, threads);
    roof_buffers.reset();
    return r;
  });
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy inputs, kept across the calls Google Benchmark makes for one line and across the
// lines of one shape (filling 512 MiB takes longer than timing it).
// ---------------------------------------------------------------------------------------------

enum class op { forward, forward_backward_in_place, forward_backward_out_of_place, backward };

/// Whether a line writes its gradient to the separate float buffer.
bool separate_gradient(op o) { return o == op::forward_backward_out_of_place || o == op::backward; }

struct input_set {
  std::string key;
  std::int64_t rows = 0, cols = 0, elem_bytes = 0;
  int copies = 1;                     // input sets used in turn
  xb::host_buffer logits;             // copies x rows x cols
  xb::host_buffer grad;               // out of place only, copies x rows x cols float
  xb::host_buffer pristine;           // --refresh_inplace only: the logits as first filled
  std::vector<std::int64_t> targets;  // copies x rows
  std::vector<float> lse;             // rows
  std::vector<float> saved_lse;       // backward only: copies x rows, each set's LSE
  float saved_loss = 0.0f;            // backward only: the last set's loss
  bool dirty = false;                 // an in-place call has overwritten logits with gradients

  std::int64_t set_bytes() const { return rows * cols * elem_bytes; }
};

std::unique_ptr<input_set> inputs;

template <class T>
const char* dtype_name() {
  if constexpr (std::is_same<T, float>::value) return "f32";
  if constexpr (std::is_same<T, Eigen::bfloat16>::value) return "bf16";
  if constexpr (std::is_same<T, Eigen::half>::value) return "f16";
}

template <class T>
void fill_logits(input_set& in) {
  xb::fill_normalish(in.logits.as<T>(), in.rows * in.cols * in.copies, 0x5eed + in.cols);
  in.dirty = false;
}

template <class T>
input_set& inputs_for(std::int64_t rows, std::int64_t cols, op o) {
  roof_buffers.reset();  // the roof lines are done; give their memory back
  const std::string key =
      std::string(dtype_name<T>()) + "/" + std::to_string(rows) + "x" + std::to_string(cols);
  if (!inputs || inputs->key != key) {
    inputs.reset();
    auto in = std::make_unique<input_set>();
    in->key = key;
    in->rows = rows;
    in->cols = cols;
    in->elem_bytes = sizeof(T);
    const std::int64_t rotate =
        static_cast<std::int64_t>(std::max(4 * xb::last_level_cache_bytes(), 256 * xb::mib));
    in->copies = static_cast<int>(
        std::max<std::int64_t>(1, (rotate + in->set_bytes() - 1) / in->set_bytes()));
    in->logits = xb::host_buffer(static_cast<std::size_t>(in->set_bytes()) * in->copies);
    in->targets.resize(static_cast<std::size_t>(rows * in->copies));
    xb::fill_class_ids(in->targets.data(), rows * in->copies, cols, 0x7a7 + cols);
    in->lse.assign(static_cast<std::size_t>(rows), 0.0f);
    fill_logits<T>(*in);
    inputs = std::move(in);
  }
  input_set& in = *inputs;
  if (separate_gradient(o) && in.grad.bytes() == 0) {
    in.grad = xb::host_buffer(static_cast<std::size_t>(rows * cols * sizeof(float)) * in.copies);
    xb::fill_normalish(in.grad.as<float>(), rows * cols * in.copies, 0x9a9);  // touch every page
  }
  if (o != op::forward_backward_in_place && in.dirty) fill_logits<T>(in);
  if (o == op::forward_backward_in_place && refresh_inplace && in.pristine.bytes() == 0) {
    if (in.dirty) fill_logits<T>(in);
    in.pristine = xb::host_buffer(in.logits.bytes());
    std::memcpy(in.pristine.as<char>(), in.logits.as<char>(), in.logits.bytes());
  }
  return in;
}

// ---------------------------------------------------------------------------------------------
// Sanity checks after the timed loop (untimed): the loss is finite and plausible, and a gradient
// is finite, bounded by 1/N (mean reduction, upstream 1: g = (p - onehot) / N) and sums to ~0 per
// row. In place, the logits of later calls are the previous call's gradient; this checks that they
// stay in that sane range however many times the benchmark runs.
// ---------------------------------------------------------------------------------------------

bool plausible_loss(float loss, std::int64_t cols) {
  // Normal-ish logits (sd 1) give ~log(V) + 0.5; in-place reruns see near-uniform rows, ~log(V).
  return std::isfinite(loss) && loss > 0.0f && loss < std::log(static_cast<float>(cols)) + 10.0f;
}

template <class G>
std::string check_gradient(const G* g, std::int64_t rows, std::int64_t cols) {
  const double bound = 1.0 / static_cast<double>(rows) * (1.0 + 1.0 / 64);
  double worst_sum = 0.0;
  for (std::int64_t n = 0; n < rows; ++n) {
    double sum = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const double v = static_cast<double>(static_cast<float>(g[n * cols + j]));
      if (!std::isfinite(v) || std::abs(v) > bound)
        return "gradient out of range at (" + std::to_string(n) + ", " + std::to_string(j) +
               "): " + std::to_string(v);
      sum += v;
    }
    worst_sum = std::max(worst_sum, std::abs(sum));
  }
  // fp32 rounds each term by 2^-24, bf16 by 2^-9; the sum of |g| over a row is <= 2 / N.
  const double tol = (sizeof(G) == 2 ? 1e-2 : 1e-4) / static_cast<double>(rows);
  if (worst_sum > tol) return "a gradient row sums to " + std::to_string(worst_sum) + ", not ~0";
  return {};
}

// ---------------------------------------------------------------------------------------------
// The cross-entropy lines.
// ---------------------------------------------------------------------------------------------

template <class T>
void run_cross_entropy(benchmark::State& state, std::int64_t rows, std::int64_t cols, op o,
                       std::int64_t chunk) {
  const int threads = static_cast<int>(state.range(0));
  const double copy_roof = roof(xb::roof_kind::copy, threads);
  const double pattern_roof = o == op::forward ? roof(xb::roof_kind::read, threads)
                              : o == op::forward_backward_in_place
                                  ? roof(xb::roof_kind::update, threads)
                                  : 0.0;
  input_set& in = inputs_for<T>(rows, cols, o);
  const xent::cpu exec(threads, chunk);
  const xent::options opts;  // class ids, mean, ignore_index -100: PyTorch's defaults
  const xent::upstream up;   // d(loss) = 1
  float loss = 0.0f;
  xent::forward_outputs out;
  out.loss = &loss;
  out.lse = xent::vector_view<float>(in.lse.data(), rows);
  if (o == op::backward && in.saved_lse.empty()) {
    in.saved_lse.resize(static_cast<std::size_t>(rows * in.copies));
    for (int c = 0; c < in.copies; ++c) {
      xent::forward_outputs saved = out;
      saved.lse = xent::vector_view<float>(in.saved_lse.data() + c * rows, rows);
      xent::forward(
          exec,
          xent::matrix_view<const T>(
              in.logits.as<const T>() + static_cast<std::int64_t>(c) * rows * cols, rows, cols),
          xent::vector_view<const std::int64_t>(in.targets.data() + c * rows, rows), opts, saved);
    }
    in.saved_loss = loss;
  }
  if (o == op::backward) loss = in.saved_loss;  // the forward's, for the checks below

  // In place, each call's logits are the previous call's gradient: (p - onehot) / N, finite and
  // far from denormal (>= ~1e-9 for these shapes), so later calls run on near-uniform rows. The
  // CPU path has no data-dependent branch on the way (the packet exp is branch-free; argmax is not
  // requested), so that costs nothing in realism, and it avoids re-copying 512 MiB per call, which
  // would also leave the tail of the logits in cache. --refresh_inplace restores the logits
  // before each call instead, to check this claim (see bench/results/README.md).
  int k = 0, last = 0;
  std::chrono::duration<double> paused{0.0};
  const xb::cpu_sample load0 = xb::sample_cpu();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (auto _ : state) {
      T* x = in.logits.as<T>() + static_cast<std::int64_t>(k) * rows * cols;
      const xent::matrix_view<T> logits(x, rows, cols);
      const xent::vector_view<const std::int64_t> targets(in.targets.data() + k * rows, rows);
      switch (o) {
        case op::forward:
          xent::forward(exec, xent::matrix_view<const T>(logits), targets, opts, out);
          break;
        case op::forward_backward_in_place:
          if (refresh_inplace) {
            state.PauseTiming();
            const auto p0 = std::chrono::steady_clock::now();
            std::memcpy(x, in.pristine.as<const T>() + static_cast<std::int64_t>(k) * rows * cols,
                        static_cast<std::size_t>(in.set_bytes()));
            paused += std::chrono::steady_clock::now() - p0;
            state.ResumeTiming();
          }
          xent::forward_backward(exec, xent::matrix_view<const T>(logits), targets, opts, up, out,
                                 logits);
          in.dirty = true;
          break;
        case op::forward_backward_out_of_place: {
          const xent::matrix_view<float> grad(
              in.grad.as<float>() + static_cast<std::int64_t>(k) * rows * cols, rows, cols);
          xent::forward_backward(exec, xent::matrix_view<const T>(logits), targets, opts, up, out,
                                 grad);
          break;
        }
        case op::backward: {
          const xent::matrix_view<float> grad(
              in.grad.as<float>() + static_cast<std::int64_t>(k) * rows * cols, rows, cols);
          xent::backward(exec, xent::matrix_view<const T>(logits), targets, opts,
                         xent::vector_view<const float>(in.saved_lse.data() + k * rows, rows), up,
                         grad);
          break;
        }
      }
      benchmark::DoNotOptimize(loss);
      benchmark::ClobberMemory();
      last = k;
      k = k + 1 == in.copies ? 0 : k + 1;
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - t0 - paused;
  const double others = xb::other_cores(load0, xb::sample_cpu());

  if (!plausible_loss(loss, cols)) {
    state.SkipWithError(("implausible loss " + std::to_string(loss)).c_str());
    return;
  }
  for (std::int64_t n = 0; n < rows; ++n)
    if (!std::isfinite(in.lse[n])) {
      state.SkipWithError("non-finite LSE");
      return;
    }
  std::string bad;
  const std::int64_t offset = static_cast<std::int64_t>(last) * rows * cols;
  if (o == op::forward_backward_in_place)
    bad = check_gradient(in.logits.as<const T>() + offset, rows, cols);
  if (separate_gradient(o)) bad = check_gradient(in.grad.as<const float>() + offset, rows, cols);
  if (!bad.empty()) {
    state.SkipWithError(bad.c_str());
    return;
  }

  const std::int64_t grad_bytes = separate_gradient(o) ? sizeof(float) : 0;
  const std::int64_t bytes =
      xb::min_traffic_bytes(o == op::forward ? xb::pass::forward : xb::pass::forward_backward, rows,
                            cols, sizeof(T), grad_bytes);
  xb::report_traffic(state, bytes, rows * cols, seconds.count(), copy_roof);
  if (pattern_roof > 0)
    state.counters[o == op::forward ? "read_roof_pct" : "update_roof_pct"] =
        static_cast<double>(bytes) * static_cast<double>(state.iterations()) / seconds.count() *
        100.0 / pattern_roof;
  state.counters["loss"] = loss;
  state.counters["input_sets"] = in.copies;
  state.counters["other_cores"] = others;
}

// Thread counts and the chunk sweep; --xent_threads=1,2,8 and --xent_chunks=512,1024 override them.
std::vector<int> threads_list;
std::vector<std::int64_t> chunks_list{512, 1024, 2048, 4096, 8192};

std::vector<int> thread_counts() {
  if (!threads_list.empty()) return threads_list;
  std::set<int> t{1, 2, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))};
  return {t.begin(), t.end()};
}

template <class I>
std::vector<I> parse_list(const std::string& s) {
  std::vector<I> out;
  std::size_t at = 0;
  while (at < s.size()) {
    const std::size_t comma = std::min(s.find(',', at), s.size());
    out.push_back(static_cast<I>(std::stoll(s.substr(at, comma - at))));
    at = comma + 1;
  }
  return out;
}

template <class T>
void add(const char* what, std::int64_t rows, std::int64_t cols, op o, std::int64_t chunk,
         benchmark::TimeUnit unit) {
  std::string name = std::string(what) + "/" + dtype_name<T>() + "/" + std::to_string(rows) + "x" +
                     std::to_string(cols);
  if (chunk) name += "/chunk:" + std::to_string(chunk);
  auto* b = benchmark::RegisterBenchmark(
      name.c_str(), [=](benchmark::State& s) { run_cross_entropy<T>(s, rows, cols, o, chunk); });
  b->ArgName("threads")->UseRealTime()->Unit(unit);
  for (int t : thread_counts()) b->Arg(t);
}

template <class T>
void add_shape(std::int64_t rows, std::int64_t cols, bool out_of_place, bool sweep_chunks,
               benchmark::TimeUnit unit) {
  // Order matters only for speed: forward and out-of-place need random logits, in place
  // overwrites them (refilling takes a second), so in-place lines come last for a shape.
  add<T>("forward", rows, cols, op::forward, 0, unit);
  if (sweep_chunks)
    for (std::int64_t chunk : chunks_list) add<T>("forward", rows, cols, op::forward, chunk, unit);
  if (out_of_place) {
    add<T>("forward_backward_out_of_place", rows, cols, op::forward_backward_out_of_place, 0, unit);
    add<T>("backward", rows, cols, op::backward, 0, unit);
  }
  add<T>("forward_backward", rows, cols, op::forward_backward_in_place, 0, unit);
  if (sweep_chunks)
    for (std::int64_t chunk : chunks_list)
      add<T>("forward_backward", rows, cols, op::forward_backward_in_place, chunk, unit);
}

void register_all() {
  for (xb::roof_kind k : {xb::roof_kind::copy, xb::roof_kind::read, xb::roof_kind::update}) {
    auto* b =
        benchmark::RegisterBenchmark(xb::roof_name(k), [k](benchmark::State& s) { bm_roof(s, k); });
    // 5 passes over >= 1 GiB: >= 0.2 s on this class of machine, and no iteration-count probing.
    b->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(5);
    for (int t : thread_counts()) b->Arg(t);
  }

  // Seed shapes (the small batches).
  add_shape<float>(32, 32000, false, false, benchmark::kMicrosecond);
  add_shape<float>(128, 32000, false, false, benchmark::kMicrosecond);
  add_shape<float>(32, 50257, false, false, benchmark::kMicrosecond);
  // Training shapes.
  add_shape<float>(4096, 32000, true, true, benchmark::kMillisecond);
  add_shape<Eigen::bfloat16>(2048, 128256, false, true, benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--refresh_inplace")
      refresh_inplace = true;
    else if (arg.rfind("--xent_threads=", 0) == 0)
      threads_list = parse_list<int>(arg.substr(15));
    else if (arg.rfind("--xent_chunks=", 0) == 0)
      chunks_list = parse_list<std::int64_t>(arg.substr(14));
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("xent_llc_bytes", std::to_string(xb::last_level_cache_bytes()));
  benchmark::AddCustomContext("xent_refresh_inplace", refresh_inplace ? "true" : "false");
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
