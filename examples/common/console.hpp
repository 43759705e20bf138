// Console output for the examples: a one-line progress bar on a terminal, a readable log line every
// tenth of the run otherwise, and number formatting. Nothing here knows about xent.
#pragma once

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace examples {

inline bool stdout_is_terminal() { return isatty(fileno(stdout)) == 1; }

/// Width of the terminal on stdout, or 80 when it cannot be told.
inline int terminal_columns() {
  winsize w{};
  return ioctl(fileno(stdout), TIOCGWINSZ, &w) == 0 && w.ws_col > 0 ? w.ws_col : 80;
}

/// printf into a std::string.
template <class... Args>
std::string format(const char* fmt, Args... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string s(static_cast<std::size_t>(n > 0 ? n : 0), '\0');
  std::snprintf(s.data(), s.size() + 1, fmt, args...);
  return s;
}

/// 1234567 -> "1.23M"; for rates and counts.
inline std::string si(double x) {
  if (x >= 1e9) return format("%.2fG", x / 1e9);
  if (x >= 1e6) return format("%.2fM", x / 1e6);
  if (x >= 1e3) return format("%.1fk", x / 1e3);
  return format("%.0f", x);
}

inline std::string mib(double bytes) { return format("%.1f MiB", bytes / (1024.0 * 1024.0)); }

inline std::string bytes_human(double bytes) {
  return bytes >= 1024.0 * 1024.0 * 1024.0 ? format("%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0))
                                           : mib(bytes);
}

/// Progress of a loop of `total` steps. On a terminal, `update` redraws one line in place (at most
/// ~20 times a second); otherwise it prints a line at each tenth of the run, so a log stays short.
class progress {
 public:
  progress(std::int64_t total, bool terminal) : total_(total), terminal_(terminal) {}

  /// True for the steps (1-based) that end a tenth of the run, and for the last one.
  bool milestone(std::int64_t step) const {
    return step == total_ || (step * 10) / total_ != ((step - 1) * 10) / total_;
  }

  void update(std::int64_t step, const std::string& status) {
    if (!terminal_) {
      if (milestone(step)) {
        std::printf("  step %*lld/%lld  %s\n", width(), static_cast<long long>(step),
                    static_cast<long long>(total_), status.c_str());
        std::fflush(stdout);
      }
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (step != total_ && !milestone(step) && now - last_draw_ < std::chrono::milliseconds(50))
      return;
    last_draw_ = now;
    constexpr int bar = 20;
    const int filled = static_cast<int>(bar * step / total_);
    std::string line = "  [" + std::string(static_cast<std::size_t>(filled), '#') +
                       std::string(static_cast<std::size_t>(bar - filled), '.') + "] " +
                       format("%3d%%  %*lld/%lld  ", static_cast<int>(100 * step / total_), width(),
                              static_cast<long long>(step), static_cast<long long>(total_)) +
                       status;
    // \r only returns to the start of the terminal's last row: a line that wrapped would leave
    // its first rows behind at every redraw, so it is cut to the terminal's width.
    line.resize(std::min(line.size(), static_cast<std::size_t>(terminal_columns() - 1)));
    // \033[K clears what a longer previous line left.
    std::printf("\r%s\033[K%s", line.c_str(), step == total_ ? "\n" : "");
    std::fflush(stdout);
  }

 private:
  int width() const { return static_cast<int>(std::to_string(total_).size()); }

  std::int64_t total_;
  bool terminal_;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace examples
