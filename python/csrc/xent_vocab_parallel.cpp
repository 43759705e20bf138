// The vocab-parallel ops' schemas and their CPU kernels (xent_vocab_parallel.h over xent::cpu,
// the exchange through a gloo process group). Autograd is xent/torch/distributed.py's.
#include <torch/library.h>

#include "xent_cpu_backend.h"
#include "xent_vocab_parallel.h"

namespace xent_torch {
namespace {

// The single-device ops' CPU backend with the vocab-parallel calls' communicator.
struct cpu_vp_backend : cpu_backend {
  static call vp_exec(const at::Tensor& x, std::int64_t, int) { return exec(x, false); }
  static torch_group vp_group(const std::string& name, const at::Device& device, std::int64_t rows,
                              std::int64_t digest) {
    return torch_group(name, device, rows, digest);
  }
};

}  // namespace

// A call refused by the Python side's checks on this rank alone: its part in the agreement
// exchange that every call of the other ranks makes (where calls make one), so they raise too.
void vocab_parallel_refuse(const std::string& group, c10::Device device) {
  if (torch_group::checks(device)) torch_group::refuse(group, device);
}

}  // namespace xent_torch

TORCH_LIBRARY_FRAGMENT(xent, m) {
  // vocab_start, vocab_size: this rank's classes [vocab_start, vocab_start + V_local) of
  // vocab_size; group: the process group's group_name.
  m.def(
      "vocab_parallel_cross_entropy_fwd(Tensor input, Tensor target, Tensor? weight, "
      "int vocab_start, int vocab_size, str group, int ignore_index, int reduction, "
      "float label_smoothing, float z_loss, float softcap) -> (Tensor loss, Tensor lse)");
  m.def(
      "vocab_parallel_cross_entropy_bwd(Tensor grad_output, Tensor input, Tensor target, "
      "Tensor? weight, Tensor lse, int vocab_start, int vocab_size, str group, int ignore_index, "
      "int reduction, float label_smoothing, float z_loss, float softcap) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_fwd_bwd(Tensor input, Tensor target, Tensor? weight, "
      "int vocab_start, int vocab_size, str group, int ignore_index, int reduction, "
      "float label_smoothing, float z_loss, float softcap) "
      "-> (Tensor loss, Tensor lse, Tensor grad)");
  // The fused linear ops over this rank's weight rows: d_hidden is the rank's partial (the
  // Python side sums it over the group); output_mask as the single-device linear ops'.
  m.def(
      "vocab_parallel_linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, Tensor? class_weight, int vocab_start, int vocab_size, str group, "
      "int ignore_index, int reduction, float label_smoothing, float z_loss, float softcap) "
      "-> (Tensor loss, Tensor lse)");
  m.def(
      "vocab_parallel_linear_cross_entropy_bwd(Tensor grad_output, Tensor hidden, Tensor weight, "
      "Tensor? bias, Tensor target, Tensor? class_weight, Tensor lse, int vocab_start, "
      "int vocab_size, str group, int ignore_index, int reduction, float label_smoothing, "
      "float z_loss, float softcap, bool[3] output_mask) "
      "-> (Tensor d_hidden, Tensor d_weight, Tensor d_bias)");
  m.def(
      "vocab_parallel_linear_cross_entropy_fwd_bwd(Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, Tensor? class_weight, int vocab_start, int vocab_size, str group, "
      "int ignore_index, int reduction, float label_smoothing, float z_loss, float softcap, "
      "bool[3] output_mask) "
      "-> (Tensor loss, Tensor lse, Tensor d_hidden, Tensor d_weight, Tensor d_bias)");
  m.def("vocab_parallel_refuse(str group, Device device) -> ()",
        &xent_torch::vocab_parallel_refuse);
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  xent_torch::register_vocab_parallel<xent_torch::cpu_vp_backend>(m);
}
