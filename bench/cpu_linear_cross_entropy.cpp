// xent_bench_cpu_linear: fused linear cross-entropy on the CPU backend (xent::linear_forward,
// xent::linear_forward_backward) against the GEMM floor measured by this binary in this run.
//
//   xent_bench_cpu_linear [--xent_threads=1,2] --benchmark_out=bench/results/linear-HOST-DATE.json
//                         --benchmark_out_format=json
//
// Lines (real time; threads T = 1 and std::thread::hardware_concurrency() unless --xent_threads):
//   gemm_floor_forward/NxDxV/threads:T    L = X · Wᵀ alone, float, Eigen, split over T threads by
//                                         blocks of W's rows as xent splits it
//   gemm_floor_training/NxDxV/threads:T   that, then dW = Lᵀ · X (by W blocks) and dX = L · W (by
//                                         rows): the three GEMMs of a training step, nothing else
//   linear_forward/DTYPE/NxDxV/threads:T           class ids, mean; outputs loss + LSE
//   linear_forward_backward/DTYPE/NxDxV/threads:T  the same plus d_hidden and d_weight
//   linear_forward_backward_low_memory/DTYPE/NxDxV/threads:T   in linear_order::low_memory
//   linear_orders_alternated/DTYPE/NxDxV/threads:T   training in both orders, call by call, ten
//                                         of each (fast_ms, low_memory_ms: each order's best)
//   linear_forward_backward_trained/DTYPE/NxDxV/threads:T      low_memory on trained-like inputs
//                                         (trained_inputs: Zipf targets, hidden = a W[y] + noise,
//                                         a set for a mean loss of 2.5 nats), exact
//   linear_forward_backward_sparse/DTYPE/NxDxV/threads:T       the same with sparse_threshold
//                                         linear_sparse_threshold_bf16 (2^-12)
//   vocab_parallel_linear_forward_backward[_low_memory]/DTYPE/NxDxV/ranks:R   the vocab-parallel
//                      call over R ranks of an inprocess_group (Megatron's split of V, one thread
//                      per rank, R = each --xent_threads count above 1), in the fast / low-memory
//                      order: the time of the group's call, every rank's shard
// Counters:
//   items_per_second   multiply-adds x 2 (FLOP/s): 2 N V D forward, 6 N V D training, 8 N V D
//                      on the trained and sparse lines (the low-memory order's four GEMMs)
//   floor_pct          the floor line's time / this line's time * 100 (the floor's float GEMMs on
//                      the same shapes; bf16 lines also convert, so their floor is the same)
//   fast_ratio         (low-memory lines) this line's time / the fast order's line of the same
//                      dtype, shape and threads (ranks) in this run; (alternated lines) the
//                      low-memory order's best call / the fast order's
//   chunk_rows, workspace_MiB   the plan the default 256 MiB budget gives (for the line's order;
//                      vocab-parallel lines: rank 0's)
//   loss               the last call's loss (checked finite, else the line is an error)
//   exact_ratio        (sparse lines) this line's time / the trained line's of the same dtype,
//                      shape and threads in this run
//   skipped_pct        (sparse lines) the gradient tiles skipped, % of all (sparse_counts)
//   dh_err, dw_err     (sparse lines) max |sparse - exact| / max |exact| of d_hidden, d_weight
//   load1              (trained and sparse lines) the machine's 1-minute load average at the end
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <xent/xent.hpp>

namespace {

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct shape {
  std::int64_t n, d, v;
  std::string name() const {
    return std::to_string(n) + "x" + std::to_string(d) + "x" + std::to_string(v);
  }
};

// Small enough to time in seconds on a 2-core machine, large enough that the GEMMs dominate.
const shape shapes[] = {{512, 256, 8192}, {1024, 512, 32000}};

/// Best seconds per call of each floor line (by name), for floor_pct.
std::map<std::string, double>& floors() {
  static std::map<std::string, double> table;
  return table;
}

std::string floor_key(bool training, const shape& s, int threads) {
  return std::string(training ? "training/" : "forward/") + s.name() + "/" +
         std::to_string(threads);
}

template <class F>
void split(int threads, std::int64_t count, F&& f) {
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t)
    workers.emplace_back([&, t] { f(count * t / threads, count * (t + 1) / threads); });
  f(std::int64_t{0}, count / threads);
  for (auto& w : workers) w.join();
}

/// The GEMMs alone, on float matrices, split as xent splits them (256-row blocks of W).
struct floor_problem {
  row_matrix x, w, l, dx, dw;
  explicit floor_problem(const shape& s)
      : x(row_matrix::Random(s.n, s.d)),
        w(row_matrix::Random(s.v, s.d)),
        l(s.n, s.v),
        dx(s.n, s.d),
        dw(s.v, s.d) {}
  void run(bool training, int threads) {
    const std::int64_t block = 256, blocks = (w.rows() + block - 1) / block;
    auto by_block = [&](auto&& f) {
      split(threads, blocks, [&](std::int64_t b0, std::int64_t b1) {
        for (std::int64_t b = b0; b < b1; ++b) {
          const std::int64_t v0 = b * block, nb = std::min(block, w.rows() - v0);
          f(v0, nb);
        }
      });
    };
    by_block([&](std::int64_t v0, std::int64_t nb) {
      l.middleCols(v0, nb).noalias() = x * w.middleRows(v0, nb).transpose();
    });
    if (!training) return;
    by_block([&](std::int64_t v0, std::int64_t nb) {
      dw.middleRows(v0, nb).noalias() = l.middleCols(v0, nb).transpose() * x;
    });
    split(threads, x.rows(), [&](std::int64_t r0, std::int64_t r1) {
      dx.middleRows(r0, r1 - r0).noalias() = l.middleRows(r0, r1 - r0) * w;
    });
  }
};

void bm_floor(benchmark::State& state, bool training, shape s) {
  const int threads = static_cast<int>(state.range(0));
  floor_problem p(s);
  p.run(training, threads);  // warm-up: first touch of every page
  double best = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    p.run(training, threads);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    benchmark::ClobberMemory();
  }
  auto& f = floors()[floor_key(training, s, threads)];
  f = f > 0 ? std::min(f, best) : best;
  state.SetItemsProcessed(state.iterations() * (training ? 6 : 2) * s.n * s.v * s.d);
}

template <class T>
const char* dtype_name() {
  return std::is_same<T, float>::value ? "f32" : "bf16";
}

/// Best seconds per call of each fast-order training line (by dtype, shape, threads).
std::map<std::string, double>& fast_lines() {
  static std::map<std::string, double> table;
  return table;
}

/// A line's inputs: hidden (normal), weight (normal / sqrt(D)), class ids uniform over V.
template <class T>
struct inputs {
  std::vector<T> x, w;
  std::vector<std::int64_t> targets;
  explicit inputs(const shape& s) : x(s.n * s.d), w(s.v * s.d), targets(s.n) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& e : x) e = T(normal(rng));
    for (auto& e : w) e = T(normal(rng) / std::sqrt(static_cast<float>(s.d)));
    for (auto& t : targets) t = static_cast<std::int64_t>(rng() % static_cast<unsigned>(s.v));
  }
};

/// Seconds of the fastest of the state's calls of `call` (after one warm-up call).
template <class F>
double best_seconds(benchmark::State& state, F&& call) {
  call();
  double best = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

/// Records a training line's best time under `key`: a fast-order line's for the low-memory
/// line of the same key, which gets fast_ratio.
void note_order(benchmark::State& state, const std::string& key, xent::linear_order order,
                double best) {
  if (order == xent::linear_order::fast) {
    auto& fast = fast_lines()[key];
    fast = fast > 0 ? std::min(fast, best) : best;
  } else if (fast_lines().count(key)) {
    state.counters["fast_ratio"] = best / fast_lines()[key];
  }
}

/// A line's problem (class ids, mean, loss + LSE; training: d_hidden and d_weight too), called in
/// either order, each with a workspace of its own order's size.
template <class T>
struct linear_line {
  shape s;
  bool training;
  inputs<T> in;
  std::vector<T> dx, dw;
  std::vector<float> lse;
  xent::cpu exec;
  float loss = 0.0f;

  linear_line(shape s_, bool training_, int threads)
      : s(s_),
        training(training_),
        in(s_),
        dx(s_.n * s_.d),
        dw(s_.v * s_.d),
        lse(s_.n),
        exec(threads) {}

  xent::linear_options options(xent::linear_order order) const {
    xent::linear_options opts;
    opts.order = order;
    return opts;
  }
  xent::linear_workspace_sizes size(xent::linear_order order) const {
    const auto pass = training ? xent::linear_pass::training : xent::linear_pass::forward;
    return xent::linear_workspace_size<T>(exec, {s.n, s.d, s.v}, pass, options(order));
  }
  void call(xent::linear_order order, std::vector<unsigned char>& workspace) {
    xent::forward_outputs out;
    out.loss = &loss;
    out.lse = {lse.data(), s.n};
    const xent::matrix_view<const T> hidden(in.x.data(), s.n, s.d), weight(in.w.data(), s.v, s.d);
    const xent::vector_view<const std::int64_t> ids(in.targets.data(), s.n);
    const xent::linear_grads<T> grads{{dx.data(), s.n, s.d}, {dw.data(), s.v, s.d}, {}};
    const xent::linear_workspace ws{workspace.data(), workspace.size()};
    if (training)
      xent::linear_forward_backward(exec, hidden, weight, {}, ids, options(order), xent::upstream{},
                                    out, grads, ws);
    else
      xent::linear_forward(exec, hidden, weight, {}, ids, options(order), out, ws);
  }
};

template <class T>
void bm_linear(benchmark::State& state, bool training, shape s, xent::linear_order order) {
  const int threads = static_cast<int>(state.range(0));
  linear_line<T> line(s, training, threads);
  const auto size = line.size(order);
  std::vector<unsigned char> workspace(size.bytes);
  const double best = best_seconds(state, [&] { line.call(order, workspace); });
  if (!std::isfinite(line.loss)) state.SkipWithError("non-finite loss");
  state.SetItemsProcessed(state.iterations() * (training ? 6 : 2) * s.n * s.v * s.d);
  state.counters["chunk_rows"] = static_cast<double>(size.chunk_rows);
  state.counters["workspace_MiB"] = static_cast<double>(size.bytes) / (1 << 20);
  state.counters["loss"] = line.loss;
  const auto f = floors().find(floor_key(training, s, threads));
  if (f != floors().end()) state.counters["floor_pct"] = 100.0 * f->second / best;
  if (!training) return;
  note_order(state, std::string(dtype_name<T>()) + "/" + floor_key(true, s, threads), order, best);
}

/// Training in both orders, call by call (fast then low memory, swapped every other iteration),
/// so that both see the same moments of a shared machine: each order's best call and their ratio.
template <class T>
void bm_orders(benchmark::State& state, shape s) {
  using order = xent::linear_order;
  linear_line<T> line(s, true, static_cast<int>(state.range(0)));
  std::vector<unsigned char> fast_ws(line.size(order::fast).bytes),
      low_ws(line.size(order::low_memory).bytes);
  double best[2] = {1e30, 1e30};
  auto timed = [&](int k) {
    const auto t0 = std::chrono::steady_clock::now();
    line.call(k == 0 ? order::fast : order::low_memory, k == 0 ? fast_ws : low_ws);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best[k] = std::min(best[k], t);
    return t;
  };
  timed(0);  // warm-up of both
  timed(1);
  best[0] = best[1] = 1e30;
  std::int64_t i = 0;
  for (auto _ : state) {
    const int first = static_cast<int>(i++ % 2);
    state.SetIterationTime(timed(first) + timed(1 - first));
  }
  if (!std::isfinite(line.loss)) state.SkipWithError("non-finite loss");
  state.counters["fast_ms"] = 1e3 * best[0];
  state.counters["low_memory_ms"] = 1e3 * best[1];
  state.counters["fast_ratio"] = best[1] / best[0];
}

/// vocab_parallel_linear_forward_backward on `ranks` ranks of an inprocess_group, rank r holding
/// Megatron's [r V / R, (r + 1) V / R): class ids, mean, loss + LSE, the partial d_hidden and the
/// shard's d_weight.
template <class T>
void bm_vocab_parallel(benchmark::State& state, shape s, xent::linear_order order) {
  const int ranks = static_cast<int>(state.range(0));
  const inputs<T> in(s);
  const xent::cpu exec(1);
  xent::linear_options opts;
  opts.order = order;
  struct rank {
    std::int64_t first, cols;
    std::vector<T> dx, dw;
    std::vector<float> lse;
    std::vector<unsigned char> workspace;
    xent::linear_workspace_sizes size;
    float loss = 0.0f;
  };
  std::vector<rank> rs(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    rank& k = rs[r];
    k.first = s.v * r / ranks;
    k.cols = s.v * (r + 1) / ranks - k.first;
    k.dx.resize(s.n * s.d);
    k.dw.resize(k.cols * s.d);
    k.lse.resize(s.n);
    k.size = xent::vocab_parallel_linear_workspace_size<T>(exec, {s.n, s.d, k.cols}, s.v, ranks,
                                                           xent::linear_pass::training, opts);
    k.workspace.resize(k.size.bytes);
  }
  xent::inprocess_group group(ranks);
  auto call = [&] {
    group.run([&](xent::inprocess_group::communicator comm) {
      rank& k = rs[comm.rank()];
      xent::forward_outputs out;
      out.loss = &k.loss;
      out.lse = {k.lse.data(), s.n};
      const xent::linear_grads<T> grads{{k.dx.data(), s.n, s.d}, {k.dw.data(), k.cols, s.d}, {}};
      xent::vocab_parallel_linear_workspace ws;
      ws.data = k.workspace.data();
      ws.bytes = k.workspace.size();
      ws.chunk_rows = k.size.chunk_rows;
      xent::vocab_parallel_linear_forward_backward(
          exec, comm, xent::matrix_view<const T>(in.x.data(), s.n, s.d),
          xent::matrix_view<const T>(in.w.data() + k.first * s.d, k.cols, s.d), {},
          xent::vocab_shard{k.first, s.v},
          xent::vector_view<const std::int64_t>(in.targets.data(), s.n), opts, xent::upstream{},
          out, grads, ws);
    });
  };
  const double best = best_seconds(state, call);
  if (!std::isfinite(rs[0].loss)) state.SkipWithError("non-finite loss");
  state.SetItemsProcessed(state.iterations() * 6 * s.n * s.v * s.d);
  state.counters["chunk_rows"] = static_cast<double>(rs[0].size.chunk_rows);
  state.counters["workspace_MiB"] = static_cast<double>(rs[0].size.bytes) / (1 << 20);
  state.counters["loss"] = rs[0].loss;
  note_order(state,
             std::string("vp/") + dtype_name<T>() + "/" + s.name() + "/" + std::to_string(ranks),
             order, best);
}

/// Inputs shaped like a trained model's last layer: weight rows ~ N(0, I / D) (norm about 1),
/// targets drawn from a Zipf distribution over the class ids (p(k) ~ 1 / (k + 1): text's token
/// frequencies, in a vocabulary numbered by frequency as BPE's roughly is), and
/// hidden_n = a * weight[y_n] + sigma * N(0, I), so the target's logit is about a and the others
/// about N(0, sigma^2 + a^2 / D); a is bisected so the mean loss (of the first 256 rows, float) is
/// 2.5 nats. sigma = 0.3 keeps the others' tail below the threshold's cut for V = 32000.
template <class T>
struct trained_inputs {
  std::vector<T> x, w;
  std::vector<std::int64_t> targets;
  double a = 0.0;
};

template <class T>
const trained_inputs<T>& trained(const shape& s) {
  static std::map<std::string, trained_inputs<T>> cache;
  auto found = cache.find(s.name());
  if (found != cache.end()) return found->second;
  trained_inputs<T>& in = cache[s.name()];
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> w(s.v * s.d), noise(s.n * s.d), cdf(s.v);
  for (auto& e : w) e = normal(rng) / std::sqrt(static_cast<double>(s.d));
  for (auto& e : noise) e = 0.3 * normal(rng);
  double total = 0.0;
  for (std::int64_t k = 0; k < s.v; ++k) cdf[k] = total += 1.0 / static_cast<double>(k + 1);
  std::uniform_real_distribution<double> uniform(0.0, total);
  in.targets.resize(s.n);
  for (auto& t : in.targets)
    t = std::min<std::int64_t>(std::lower_bound(cdf.begin(), cdf.end(), uniform(rng)) - cdf.begin(),
                               s.v - 1);
  in.w.resize(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) in.w[i] = T(static_cast<float>(w[i]));
  auto make_hidden = [&](double a) {
    in.x.resize(s.n * s.d);
    for (std::int64_t n = 0; n < s.n; ++n)
      for (std::int64_t k = 0; k < s.d; ++k)
        in.x[n * s.d + k] =
            T(static_cast<float>(a * w[in.targets[n] * s.d + k] + noise[n * s.d + k]));
  };
  auto mean_loss = [&](double a) {
    make_hidden(a);
    const std::int64_t rows = std::min<std::int64_t>(s.n, 256);
    const xent::cpu exec(2);
    const auto size =
        xent::linear_workspace_size<T>(exec, {rows, s.d, s.v}, xent::linear_pass::forward);
    std::vector<unsigned char> ws(size.bytes);
    float loss = 0.0f;
    xent::forward_outputs out;
    out.loss = &loss;
    xent::linear_forward(exec, xent::matrix_view<const T>(in.x.data(), rows, s.d),
                         xent::matrix_view<const T>(in.w.data(), s.v, s.d),
                         xent::vector_view<const T>{},
                         xent::vector_view<const std::int64_t>(in.targets.data(), rows),
                         xent::linear_options{}, out, {ws.data(), ws.size()});
    return static_cast<double>(loss);
  };
  double lo = 0.0, hi = 64.0;  // the loss falls as a grows
  for (int i = 0; i < 16; ++i) {
    const double mid = 0.5 * (lo + hi);
    (mean_loss(mid) > 2.5 ? lo : hi) = mid;
  }
  in.a = 0.5 * (lo + hi);
  make_hidden(in.a);
  return in;
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double load = -1.0;
  f >> load;
  return load;
}

/// Best seconds per call of each exact trained-input line (by dtype, shape, threads).
std::map<std::string, double>& trained_lines() {
  static std::map<std::string, double> table;
  return table;
}

/// max |a - b| / max |b|.
template <class T>
double relative_error(const std::vector<T>& a, const std::vector<T>& b) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    diff = std::max(diff, std::fabs(x - y));
    scale = std::max(scale, std::fabs(y));
  }
  return scale > 0 ? diff / scale : diff;
}

/// Training in the low-memory order on trained_inputs, exact (`tau` = 0) or sparse.
template <class T>
void bm_trained(benchmark::State& state, shape s, float tau) {
  const int threads = static_cast<int>(state.range(0));
  const trained_inputs<T>& in = trained<T>(s);
  const xent::cpu exec(threads);
  std::vector<T> dx(s.n * s.d), dw(s.v * s.d), dx0(s.n * s.d), dw0(s.v * s.d);
  xent::linear_options exact;
  exact.order = xent::linear_order::low_memory;
  xent::linear_options opts = exact;
  opts.sparse_threshold = tau;
  xent::linear_sparse_counts counts;
  opts.sparse_counts = &counts;
  const auto size =
      xent::linear_workspace_size<T>(exec, {s.n, s.d, s.v}, xent::linear_pass::training, opts);
  std::vector<unsigned char> workspace(size.bytes);
  float loss = 0.0f, exact_loss = 0.0f;
  xent::forward_outputs out, exact_out;
  out.loss = &loss;
  exact_out.loss = &exact_loss;
  const xent::matrix_view<const T> hidden(in.x.data(), s.n, s.d), weight(in.w.data(), s.v, s.d);
  const xent::vector_view<const std::int64_t> ids(in.targets.data(), s.n);
  const xent::linear_workspace ws{workspace.data(), workspace.size()};
  auto train = [&](const xent::linear_options& o, const xent::forward_outputs& f,
                   std::vector<T>& gx, std::vector<T>& gw) {
    const xent::linear_grads<T> grads{{gx.data(), s.n, s.d}, {gw.data(), s.v, s.d}, {}};
    xent::linear_forward_backward(exec, hidden, weight, {}, ids, o, xent::upstream{}, f, grads, ws);
  };
  train(exact, exact_out, dx0, dw0);  // the reference, and the warm-up
  double best = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    train(opts, out, dx, dw);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (!std::isfinite(loss)) state.SkipWithError("non-finite loss");
  if (loss != exact_loss) state.SkipWithError("the threshold changed the loss");
  state.SetItemsProcessed(state.iterations() * 8 * s.n * s.v * s.d);
  state.counters["loss"] = loss;
  state.counters["a"] = in.a;
  state.counters["load1"] = load_average();
  const std::string key = std::string(dtype_name<T>()) + "/" + floor_key(true, s, threads);
  if (tau == 0.0f) {
    auto& t = trained_lines()[key];
    t = t > 0 ? std::min(t, best) : best;
    return;
  }
  if (trained_lines().count(key)) state.counters["exact_ratio"] = best / trained_lines()[key];
  state.counters["skipped_pct"] =
      counts.tiles > 0 ? 100.0 * static_cast<double>(counts.skipped) / counts.tiles : 0.0;
  state.counters["dh_err"] = relative_error(dx, dx0);
  state.counters["dw_err"] = relative_error(dw, dw0);
}

std::vector<int> thread_counts(int* argc, char** argv) {
  std::set<int> t{1, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))};
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i], flag = "--xent_threads=";
    if (a.rfind(flag, 0) != 0) continue;
    t.clear();
    for (std::size_t p = flag.size(); p < a.size();) {
      const std::size_t q = std::min(a.find(',', p), a.size());
      t.insert(std::stoi(a.substr(p, q - p)));
      p = q + 1;
    }
    for (int j = i; j + 1 < *argc; ++j) argv[j] = argv[j + 1];
    --*argc;
    break;
  }
  return {t.begin(), t.end()};
}

/// Registers a line at one thread (or rank) count `t`, timed in real milliseconds.
template <class F, class... Args>
void add_line(const std::string& name, const char* arg, int t, F f, Args... args) {
  benchmark::RegisterBenchmark(name.c_str(), f, args...)
      ->Arg(t)
      ->ArgName(arg)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<int> threads = thread_counts(&argc, argv);
  benchmark::Initialize(&argc, argv);
  // Each floor line runs before the xent lines of its shape, so floor_pct has its figure.
  for (const shape& s : shapes)
    for (bool training : {false, true}) {
      const std::string op = training ? "training" : "forward";
      for (int t : threads)
        add_line("gemm_floor_" + op + "/" + s.name(), "threads", t, bm_floor, training, s);
      // The fast order's lines come before the low-memory order's, for fast_ratio.
      for (auto order : {xent::linear_order::fast, xent::linear_order::low_memory}) {
        const std::string low = order == xent::linear_order::low_memory ? "_low_memory/" : "/";
        for (int t : threads) {
          if (!training || t < 2) continue;
          const std::string vp = "vocab_parallel_linear_forward_backward" + low;
          add_line(vp + "f32/" + s.name(), "ranks", t, bm_vocab_parallel<float>, s, order);
          add_line(vp + "bf16/" + s.name(), "ranks", t, bm_vocab_parallel<Eigen::bfloat16>, s,
                   order);
        }
        if (!training && order == xent::linear_order::low_memory) continue;
        const std::string name =
            std::string(training ? "linear_forward_backward" : "linear_forward") + low;
        for (int t : threads) {
          add_line(name + "f32/" + s.name(), "threads", t, bm_linear<float>, training, s, order);
          add_line(name + "bf16/" + s.name(), "threads", t, bm_linear<Eigen::bfloat16>, training, s,
                   order);
        }
      }
    }
  // Both orders call by call.
  for (const shape& s : shapes)
    for (int t : threads) {
      const std::string name = "linear_orders_alternated/";
      benchmark::RegisterBenchmark((name + "f32/" + s.name()).c_str(), bm_orders<float>, s)
          ->Arg(t)
          ->ArgName("threads")
          ->UseManualTime()
          ->Iterations(10)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark((name + "bf16/" + s.name()).c_str(), bm_orders<Eigen::bfloat16>,
                                   s)
          ->Arg(t)
          ->ArgName("threads")
          ->UseManualTime()
          ->Iterations(10)
          ->Unit(benchmark::kMillisecond);
    }
  // Trained-like inputs, exact before sparse for exact_ratio.
  for (const shape& s : shapes)
    for (float tau : {0.0f, xent::linear_sparse_threshold_bf16}) {
      const std::string name =
          tau == 0.0f ? "linear_forward_backward_trained/" : "linear_forward_backward_sparse/";
      for (int t : threads) {
        add_line(name + "f32/" + s.name(), "threads", t, bm_trained<float>, s, tau);
        add_line(name + "bf16/" + s.name(), "threads", t, bm_trained<Eigen::bfloat16>, s, tau);
      }
    }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
