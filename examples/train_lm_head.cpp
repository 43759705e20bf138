// train_lm_head: trains a small word-level language model with xent's fused linear cross-entropy,
// on text that every Debian machine ships (the GPL, /usr/share/common-licenses/GPL-3, by default).
//
// The model guesses each word of the text from the k words before it (a linear n-gram model):
//     h      = [E[x(t-1)], ..., E[x(t-k)]]             N x kD   E: V x D word embeddings
//     logits = h · Wᵀ                                  N x V    W: V x kD, the LM head
//     loss   = mean cross-entropy(logits, x(t))
// xent::linear_forward_backward takes h and W and returns the loss, dh and dW: it computes the
// logits a chunk of rows at a time in a workspace (a quarter of the logits' size here, to show the
// chunking), runs the fused cross-entropy in place on each chunk and folds the chunk's gradient G
// into dW = Gᵀ · h and dh = G · W. The N x V logits never exist. Then dE[x(t-i)] += dh's i-th D
// columns, and SGD with momentum and weight decay. Step 1 is checked against the unfused path
// written plainly in double precision.
//
//   xent_demo [corpus file or directory ...] [--steps N] [--threads T] [--dim D] [--batch B] ...
//   xent_demo --help
#include <xent/xent.hpp>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/console.hpp"
#include "common/corpus.hpp"

namespace {

using examples::format;
using examples::si;
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ids = Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// ----------------------------------------------------------------------------------------------
// Command line
// ----------------------------------------------------------------------------------------------

struct config {
  std::vector<std::string> corpus;
  std::int64_t steps = 1000;
  int threads = 0;  // 0: the machine's cores, at most 8
  std::int64_t dim = 64;
  std::int64_t batch = 512;
  std::int64_t context = 3;
  float lr = 0.1f;
  float momentum = 0.9f;
  float weight_decay = 1e-3f;  // the GPL is small: without it the model memorises the text
  float smoothing = 0.0f;
  float z_loss = 0.0f;
  std::uint64_t seed = 1;
};

constexpr const char* default_corpus = "/usr/share/common-licenses/GPL-3";

void print_usage() {
  std::printf(
      "usage: xent_demo [CORPUS ...] [options]\n"
      "\n"
      "Trains a word-level language-model head on CORPUS (files or directories of text;\n"
      "default %s) with xent's fused linear cross-entropy.\n"
      "\n"
      "  --steps N        training steps (1000)\n"
      "  --threads T      threads for xent (the machine's cores, at most 8)\n"
      "  --dim D          embedding width (64)\n"
      "  --batch B        tokens per step (512)\n"
      "  --context K      words the model sees before the one it guesses (3)\n"
      "  --lr LR          SGD learning rate (0.1)\n"
      "  --momentum M     SGD momentum (0.9)\n"
      "  --weight-decay W L2 weight decay (0.001)\n"
      "  --smoothing EPS  label smoothing in [0, 1] (0)\n"
      "  --z-loss Z       z-loss coefficient, Z * lse^2 per token (0)\n"
      "  --seed S         random seed (1)\n"
      "\n"
      "Try: xent_demo /usr/share/common-licenses   (every license: a larger vocabulary)\n",
      default_corpus);
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "xent_demo: %s (see --help)\n", message.c_str());
  std::exit(2);
}

config parse_args(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      print_usage();
      std::exit(0);
    }
    if (arg.rfind("--", 0) != 0) {
      c.corpus.push_back(arg);
      continue;
    }
    std::string value;  // --name=value or --name value
    if (const auto eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      usage_error(arg + " needs a value");
    }
    auto number = [&](double lo, double hi) {
      char* end = nullptr;
      const double x = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(x >= lo && x <= hi))
        usage_error(format("%s expects a number in [%g, %g], got '%s'", arg.c_str(), lo, hi,
                           value.c_str()));
      return x;
    };
    auto integer = [&](double lo, double hi) {
      const double x = number(lo, hi);
      if (x != std::floor(x)) usage_error(arg + " expects an integer, got '" + value + "'");
      return static_cast<std::int64_t>(x);
    };
    if (arg == "--steps")
      c.steps = integer(1, 1e9);
    else if (arg == "--threads")
      c.threads = static_cast<int>(integer(1, 256));
    else if (arg == "--dim")
      c.dim = integer(1, 4096);
    else if (arg == "--batch")
      c.batch = integer(1, 1 << 20);
    else if (arg == "--context")
      c.context = integer(1, 64);
    else if (arg == "--lr")
      c.lr = static_cast<float>(number(1e-9, 1e3));
    else if (arg == "--momentum")
      c.momentum = static_cast<float>(number(0, 0.999));
    else if (arg == "--weight-decay")
      c.weight_decay = static_cast<float>(number(0, 1));
    else if (arg == "--smoothing")
      c.smoothing = static_cast<float>(number(0, 1));
    else if (arg == "--z-loss")
      c.z_loss = static_cast<float>(number(0, 1e3));
    else if (arg == "--seed")
      c.seed = static_cast<std::uint64_t>(integer(0, 9.007e15));
    else
      usage_error("unknown option " + arg);
  }
  if (c.corpus.empty()) c.corpus.push_back(default_corpus);
  if (c.threads == 0)
    c.threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  return c;
}

// ----------------------------------------------------------------------------------------------
// Data: the corpus as token ids, cut into training and held-out positions
// ----------------------------------------------------------------------------------------------

/// Position t means "guess ids[t] from ids[t-k .. t-1]". The text is cut into blocks of 100
/// tokens and every tenth block is held out, so the held-out set samples the whole text; a
/// training position's context never reaches into a held-out block.
struct dataset {
  examples::vocabulary vocab;
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> train, heldout;

  static constexpr std::int64_t block = 100;

  dataset(const std::vector<std::string>& tokens, std::int64_t k)
      : vocab(tokens), ids(vocab.encode(tokens)) {
    auto held = [](std::int64_t t) { return (t / block) % 10 == 9; };
    for (std::int64_t t = k; t < static_cast<std::int64_t>(ids.size()); ++t) {
      if (held(t))
        heldout.push_back(t);
      else if (!held(t - k))
        train.push_back(t);
    }
  }
};

// ----------------------------------------------------------------------------------------------
// The model
// ----------------------------------------------------------------------------------------------

struct model {
  matrix E;       // V x D: the embedding of each word
  matrix W;       // V x kD: the LM head, one row per word it may guess
  matrix vE, vW;  // momentum buffers

  model(std::int64_t vocab, std::int64_t dim, std::int64_t k, std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    E = matrix::NullaryExpr(vocab, dim, [&] { return normal(rng); });
    // Small head weights: initial logits ~ N(0, 0.25), so the first loss is close to log V.
    const float w_scale = 0.5f / std::sqrt(static_cast<float>(k * dim));
    W = matrix::NullaryExpr(vocab, k * dim, [&] { return w_scale * normal(rng); });
    vE = matrix::Zero(vocab, dim);
    vW = matrix::Zero(vocab, k * dim);
  }
};

/// Row n of h = [E[x(t-1)], E[x(t-2)], ..., E[x(t-k)]] for t = pos[n]: the k embeddings side by
/// side. Writes the first `rows` rows of h (N x kD).
void embed(const model& m, const std::vector<std::int32_t>& text, const std::int64_t* pos,
           std::int64_t rows, std::int64_t k, matrix& h) {
  const std::int64_t d = m.E.cols();
  for (std::int64_t n = 0; n < rows; ++n)
    for (std::int64_t i = 0; i < k; ++i) h.row(n).segment(i * d, d) = m.E.row(text[pos[n] - 1 - i]);
}

// ----------------------------------------------------------------------------------------------
// The loss: the one place xent is called in training. The execution object picks the backend;
// the views are plain {pointer, rows, cols, ld}, so another backend passes its execution object and
// views of its memory here and nothing else about the call changes.
// ----------------------------------------------------------------------------------------------

/// Mean cross-entropy (with the options' smoothing and z-loss) of the logits h · Wᵀ against
/// `targets`, and its gradients dh (N x kD) and dW (V x kD), in one call over row chunks of the
/// workspace.
template <class Exec>
float loss_and_gradients(const Exec& exec, const matrix& h, const matrix& W, const ids& targets,
                         const xent::linear_options& opts, matrix& dh, matrix& dW,
                         std::vector<unsigned char>& workspace) {
  float loss = 0.0f;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::linear_forward_backward(exec, xent::view(h), xent::view(W), {}, xent::view(targets), opts,
                                xent::upstream{}, out,
                                xent::linear_grads<float>{xent::view(dh), xent::view(dW), {}},
                                {workspace.data(), workspace.size()});
  return loss;
}

struct eval_result {
  double loss = 0.0;      // mean cross-entropy (no smoothing, no z-loss)
  double accuracy = 0.0;  // fraction of positions whose most likely word is the right one
};

/// Loss and top-1 accuracy over `positions` with xent::linear_forward, in batches that reuse the
/// training buffers; num_correct counts rows whose argmax is the target.
template <class Exec>
eval_result evaluate(const Exec& exec, const model& m, const dataset& data,
                     const std::vector<std::int64_t>& positions, std::int64_t k, matrix& h,
                     ids& targets, std::vector<unsigned char>& workspace) {
  xent::linear_options plain;
  plain.reduce = xent::reduction::sum;
  double loss_sum = 0.0;
  std::int64_t correct = 0;
  const std::int64_t total = static_cast<std::int64_t>(positions.size());
  for (std::int64_t begin = 0; begin < total; begin += h.rows()) {
    const std::int64_t rows = std::min<std::int64_t>(h.rows(), total - begin);
    embed(m, data.ids, positions.data() + begin, rows, k, h);
    auto y = targets.head(rows);
    for (std::int64_t n = 0; n < rows; ++n) y[n] = data.ids[positions[begin + n]];

    float loss = 0.0f;
    std::int64_t num_correct = 0;
    xent::forward_outputs out;
    out.loss = &loss;
    out.num_correct = &num_correct;
    const auto x = xent::view(h);
    xent::linear_forward(exec, xent::matrix_view<const float>(x.data, rows, x.cols, x.ld),
                         xent::view(m.W), {}, xent::view(y), plain, out,
                         {workspace.data(), workspace.size()});
    loss_sum += loss;
    correct += num_correct;
  }
  return {loss_sum / static_cast<double>(total), static_cast<double>(correct) / total};
}

/// Backward through the embeddings from dh, then one SGD step with momentum and weight decay.
void backward_and_update(model& m, const matrix& dh, const matrix& dW, const dataset& data,
                         const std::vector<std::int64_t>& pos, const config& cfg, matrix& dE) {
  const std::int64_t k = cfg.context, d = cfg.dim;
  dE.setZero();
  for (std::size_t n = 0; n < pos.size(); ++n)
    for (std::int64_t i = 0; i < k; ++i)
      dE.row(data.ids[pos[n] - 1 - i]) += dh.row(static_cast<Eigen::Index>(n)).segment(i * d, d);
  m.vW = cfg.momentum * m.vW + dW + cfg.weight_decay * m.W;
  m.vE = cfg.momentum * m.vE + dE + cfg.weight_decay * m.E;
  m.W -= cfg.lr * m.vW;
  m.E -= cfg.lr * m.vE;
}

// ----------------------------------------------------------------------------------------------
// The judge for the first step: the same loss and gradients, unfused, written plainly in double
// precision with the logits and the softmax spelled out, independently of xent's code.
// ----------------------------------------------------------------------------------------------

struct check_result {
  double max_abs_diff = 0.0;  // over every element of dh and dW
  double max_abs_grad = 0.0;
  double loss_diff = 0.0;
};

/// Per row, with z = h Wᵀ, p = softmax(z), lse = log sum exp(z), t' = (1 - eps) onehot(y) + eps /
/// V:
///   loss = sum_j t'_j (lse - z_j) + z_loss lse^2,   G_j = dloss/dz_j = (1 + 2 z_loss lse) p_j -
///   t'_j,
/// both divided by N for the mean; then dh = G W and dW = Gᵀ h.
check_result check_against_float64(const matrix& h, const matrix& W, const ids& targets,
                                   const xent::options& opts, const matrix& fused_dh,
                                   const matrix& fused_dW, float fused_loss) {
  const std::int64_t rows = h.rows(), vocab = W.rows(), width = h.cols();
  const double eps = opts.label_smoothing, zl = opts.z_loss;
  const Eigen::MatrixXd hd = h.cast<double>(), Wd = W.cast<double>();
  Eigen::MatrixXd dh = Eigen::MatrixXd::Zero(rows, width), dW = Eigen::MatrixXd::Zero(vocab, width);
  check_result r;
  double loss = 0.0;
  Eigen::VectorXd z(vocab), g(vocab);
  for (std::int64_t n = 0; n < rows; ++n) {
    z.noalias() = Wd * hd.row(n).transpose();
    const double mx = z.maxCoeff();
    const Eigen::VectorXd p = (z.array() - mx).exp().matrix();
    const double sum = p.sum(), lse = mx + std::log(sum);
    const std::int32_t y = targets[n];
    loss += (1 - eps) * (lse - z[y]) + eps / vocab * (vocab * lse - z.sum()) + zl * lse * lse;
    for (std::int64_t j = 0; j < vocab; ++j)
      g[j] = ((1 + 2 * zl * lse) * p[j] / sum - ((1 - eps) * (j == y) + eps / vocab)) / rows;
    dh.row(n) = g.transpose() * Wd;
    dW += g * hd.row(n);
  }
  r.max_abs_diff = std::max((dh - fused_dh.cast<double>()).cwiseAbs().maxCoeff(),
                            (dW - fused_dW.cast<double>()).cwiseAbs().maxCoeff());
  r.max_abs_grad = std::max(dh.cwiseAbs().maxCoeff(), dW.cwiseAbs().maxCoeff());
  r.loss_diff = std::abs(loss / rows - fused_loss);
  return r;
}

// ----------------------------------------------------------------------------------------------
// Greedy continuation of a prompt
// ----------------------------------------------------------------------------------------------

std::vector<std::int32_t> continue_greedily(const model& m, std::vector<std::int32_t> words,
                                            std::int64_t k, int count) {
  const std::int64_t d = m.E.cols();
  Eigen::RowVectorXf h(k * d);
  Eigen::VectorXf logits(m.W.rows());
  for (int i = 0; i < count; ++i) {
    for (std::int64_t j = 0; j < k; ++j) h.segment(j * d, d) = m.E.row(words[words.size() - 1 - j]);
    logits.noalias() = m.W * h.transpose();
    Eigen::Index next = 0;
    logits.maxCoeff(&next);
    words.push_back(static_cast<std::int32_t>(next));
  }
  return words;
}

// ----------------------------------------------------------------------------------------------
// Reports
// ----------------------------------------------------------------------------------------------

void print_continuations(const model& m, const dataset& data, std::int64_t k) {
  constexpr int words = 14;
  std::printf("\ngreedy continuations (prompt | the model's most likely next words)\n");
  auto show = [&](const std::vector<std::int32_t>& prompt) {
    const auto out = continue_greedily(m, prompt, k, words);
    const std::vector<std::int32_t> tail(out.end() - words, out.end());
    std::printf("  %s | %s\n", data.vocab.decode(prompt).c_str(), data.vocab.decode(tail).c_str());
  };
  int shown = 0;
  for (const char* text :
       {"you may convey", "the terms of this", "if you modify", "this program is"}) {
    const std::vector<std::int32_t> prompt = data.vocab.encode(examples::tokenize(text));
    const bool known = std::find(prompt.begin(), prompt.end(), -1) == prompt.end();
    if (known && static_cast<std::int64_t>(prompt.size()) >= k) show(prompt), ++shown;
  }
  // Another corpus may lack those words: prompts from its held-out text instead.
  for (std::size_t i = 0; shown < 3 && i < data.heldout.size(); i += data.heldout.size() / 3 + 1) {
    const std::int64_t t = data.heldout[i];
    show(std::vector<std::int32_t>(data.ids.begin() + (t - k), data.ids.begin() + t));
    ++shown;
  }
}

/// Memory of the loss for one batch. A naive softmax keeps the logits, the probabilities and the
/// gradient (PyTorch eager also keeps log-probs for backward); xent's fused cross-entropy keeps the
/// logits buffer, which becomes the gradient, and fused linear cross-entropy only its workspace.
void print_memory(std::int64_t rows, std::int64_t vocab, std::size_t workspace,
                  std::int64_t chunk_rows) {
  auto naive = [](double n, double v, int arrays) { return arrays * n * v * 4.0; };
  auto fused = [](double n, double v) { return n * v * 4.0 + n * 4.0; };
  const double n = static_cast<double>(rows), v = static_cast<double>(vocab);
  auto row = [](const std::string& label, const std::string& value, const std::string& note) {
    std::printf("  %-50s %10s%s%s\n", label.c_str(), value.c_str(), note.empty() ? "" : "   ",
                note.c_str());
  };
  std::printf("\nmemory for the loss of one batch (%lld x %lld fp32 logits)\n",
              static_cast<long long>(rows), static_cast<long long>(vocab));
  row("naive softmax: logits + probabilities + gradient", examples::mib(naive(n, v, 3)),
      "(PyTorch eager, + log-probs: " + examples::mib(naive(n, v, 4)) + ")");
  row(format("xent in place: logits (+ %lld floats of LSE)", static_cast<long long>(rows)),
      examples::mib(fused(n, v)), "");
  row("saved", examples::mib(naive(n, v, 3) - fused(n, v)),
      format("(%.0f%%)", 100 * (1 - fused(n, v) / naive(n, v, 3))));
  row(format("xent fused linear: workspace (%lld-row chunks)", static_cast<long long>(chunk_rows)),
      examples::mib(static_cast<double>(workspace)), "(no N x V array at all)");
  const double big_n = 8192, big_v = 128256;
  std::printf("  the same arithmetic at 8192 tokens x 128256 words (Llama 3): %s vs %s\n",
              examples::bytes_human(naive(big_n, big_v, 3)).c_str(),
              examples::bytes_human(fused(big_n, big_v)).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const config cfg = parse_args(argc, argv);

  // ---- Corpus -> tokens -> ids ------------------------------------------------------------------
  std::vector<std::string> files;
  std::string text;
  try {
    text = examples::read_corpus(cfg.corpus, &files);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "xent_demo: %s\n", e.what());
    return 1;
  }
  const dataset data(examples::tokenize(text), cfg.context);
  const std::int64_t V = data.vocab.size(), D = cfg.dim, B = cfg.batch, k = cfg.context;
  if (data.ids.size() < 1000) {
    std::fprintf(stderr, "xent_demo: the corpus has %zu tokens; it needs at least 1000\n",
                 data.ids.size());
    return 1;
  }

  xent::linear_options opts;  // mean reduction, d_weight summed in float
  opts.label_smoothing = cfg.smoothing;
  opts.z_loss = cfg.z_loss;
  const xent::cpu exec{cfg.threads};

  const std::string corpus_name =
      files.size() == 1 ? files[0] : format("%s (%zu files)", cfg.corpus[0].c_str(), files.size());
  std::printf("xent demo: a word-level LM head trained with fused linear cross-entropy\n");
  std::printf("  corpus    %s\n", corpus_name.c_str());
  std::printf("  tokens    %zu (%zu training positions, %zu held out)\n", data.ids.size(),
              data.train.size(), data.heldout.size());
  std::printf("  vocab     V = %lld words and punctuation marks (log V = %.3f)\n",
              static_cast<long long>(V), std::log(static_cast<double>(V)));
  std::printf(
      "  model     the previous %lld words' embeddings (D = %lld each) -> LM head -> logits\n",
      static_cast<long long>(k), static_cast<long long>(D));
  std::printf(
      "  training  %lld steps of B = %lld tokens; SGD lr %g, momentum %g, weight decay %g\n",
      static_cast<long long>(cfg.steps), static_cast<long long>(B), cfg.lr, cfg.momentum,
      cfg.weight_decay);
  std::printf(
      "  loss      xent::linear_forward_backward on %lld x %lld logits never materialised: mean, "
      "label smoothing %g, z-loss %g\n",
      static_cast<long long>(B), static_cast<long long>(V), cfg.smoothing, cfg.z_loss);
  std::printf("  threads   %d for xent::cpu (Eigen GEMMs: %d)\n\n", cfg.threads,
              Eigen::nbThreads());

  // ---- Buffers, allocated once ----------------------------------------------------------------
  std::mt19937_64 rng(cfg.seed);
  model m(V, D, k, rng);
  matrix h(B, k * D), dh(B, k * D), dW(V, k * D), dE(V, D);
  // The workspace: a quarter of the logits' bytes (chunks of about B / 4 rows), or the minimum.
  const xent::linear_shape shape{B, k * D, V};
  const std::size_t budget = static_cast<std::size_t>(B * V) * sizeof(float) / 4;
  const xent::linear_workspace_sizes plan =
      xent::linear_workspace_size<float>(exec, shape, xent::linear_pass::training, opts, budget);
  std::vector<unsigned char> workspace(plan.bytes);
  ids targets(B);
  std::vector<std::int64_t> pos(static_cast<std::size_t>(B));
  std::uniform_int_distribution<std::size_t> pick(0, data.train.size() - 1);

  const eval_result before = evaluate(exec, m, data, data.heldout, k, h, targets, workspace);

  // ---- Training ---------------------------------------------------------------------------------
  examples::progress bar(cfg.steps, examples::stdout_is_terminal());
  double train_seconds = 0.0, xent_seconds = 0.0;
  double first_loss = 0.0, window_loss = 0.0, last_window_loss = 0.0, last_heldout = before.loss;
  std::int64_t window = 0;
  for (std::int64_t step = 1; step <= cfg.steps; ++step) {
    const auto t0 = clock_type::now();
    for (std::int64_t n = 0; n < B; ++n) {
      pos[n] = data.train[pick(rng)];
      targets[n] = data.ids[pos[n]];
    }
    embed(m, data.ids, pos.data(), B, k, h);
    matrix W_before;
    if (step == 1) W_before = m.W;  // for the gradient check below

    const auto tx = clock_type::now();
    const float loss = loss_and_gradients(exec, h, m.W, targets, opts, dh, dW, workspace);
    xent_seconds += seconds_since(tx);
    backward_and_update(m, dh, dW, data, pos, cfg, dE);
    train_seconds += seconds_since(t0);

    if (!std::isfinite(loss)) {
      std::printf("\n");
      std::fprintf(stderr, "xent_demo: the loss diverged (%g) at step %lld; try a smaller --lr\n",
                   loss, static_cast<long long>(step));
      return 1;
    }
    if (step == 1) {
      first_loss = loss;
      const check_result c = check_against_float64(h, W_before, targets, opts, dh, dW, loss);
      const bool ok = c.max_abs_diff <= 1e-5 * c.max_abs_grad && c.loss_diff <= 1e-4 * loss;
      std::printf(
          "gradient check, step 1 (fused linear fp32, dh and dW, vs unfused fp64 logits and "
          "softmax):\n"
          "  max abs diff %.2e (largest gradient %.2e), loss diff %.2e  %s\n\n",
          c.max_abs_diff, c.max_abs_grad, c.loss_diff, ok ? "ok" : "MISMATCH");
      if (!ok) {
        std::fprintf(stderr, "xent_demo: the fused gradient disagrees with the float64 softmax\n");
        return 1;
      }
      std::printf(
          "training (loss: mean over each tenth of the run; held-out: cross-entropy on unseen "
          "text)\n");
    }

    window_loss += loss;
    ++window;
    if (bar.milestone(step)) {
      last_window_loss = window_loss / window;
      window_loss = 0.0;
      window = 0;
      last_heldout = evaluate(exec, m, data, data.heldout, k, h, targets, workspace).loss;
    }
    const double tokens = static_cast<double>(B) * step;
    bar.update(step, format("loss %.3f  held-out %.3f  %s tok/s  (xent %s tok/s)",
                            window ? window_loss / window : last_window_loss, last_heldout,
                            si(tokens / train_seconds).c_str(), si(tokens / xent_seconds).c_str()));
  }

  // ---- Results ----------------------------------------------------------------------------------
  const eval_result after = evaluate(exec, m, data, data.heldout, k, h, targets, workspace);
  std::int64_t most_frequent = 0;
  for (const std::int64_t t : data.heldout) most_frequent += data.ids[t] == 0;
  const double tokens = static_cast<double>(B) * cfg.steps;

  std::printf("\nresults\n");
  std::printf("  training loss   %.3f at step 1 -> %.3f over the last tenth of the steps\n",
              first_loss, last_window_loss);
  std::printf("  held-out loss   %.3f -> %.3f   (perplexity %.0f -> %.0f)\n", before.loss,
              after.loss, std::exp(before.loss), std::exp(after.loss));
  std::printf("  held-out top-1  %.1f%% -> %.1f%%   (always guessing \"%s\": %.1f%%)\n",
              100 * before.accuracy, 100 * after.accuracy, data.vocab.word(0).c_str(),
              100.0 * most_frequent / data.heldout.size());
  std::printf(
      "  time            %.2f s for %lld steps: %s tokens/s end to end (most of it in the GEMMs)\n",
      train_seconds, static_cast<long long>(cfg.steps), si(tokens / train_seconds).c_str());
  std::printf(
      "  xent            %.3f s of it (%.0f%%): %s tokens/s, %.1f GFLOP/s (its three GEMMs, "
      "6 N V kD)\n",
      xent_seconds, 100 * xent_seconds / train_seconds, si(tokens / xent_seconds).c_str(),
      tokens * V * 6.0 * static_cast<double>(k * D) / xent_seconds / 1e9);

  print_continuations(m, data, k);
  print_memory(B, V, plan.bytes, plan.chunk_rows);
  return 0;
}
