// The one exception type xent throws for bad arguments.
#pragma once

#include <stdexcept>
#include <string>

namespace xent {

/// Thrown, before anything is written, when an argument is invalid. `argument()` names it
/// ("logits", "targets", "options.label_smoothing", ...); `what()` says what is wrong and, for a
/// target, the row and the value.
class error : public std::invalid_argument {
 public:
  error(const std::string& function, std::string argument, const std::string& message)
      : std::invalid_argument(function + ": argument '" + argument + "': " + message),
        argument_(std::move(argument)) {}

  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

}  // namespace xent
