// A progress bar on stderr for long CLI operations (cp, verify).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include "base/bytes.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

// A progress bar on stderr (a terminal, or --progress): bytes, rate and time left, redrawn at
// most 10 times a second. CopyStep calls it serialized; verify after each image.
class ProgressBar {
 public:
  explicit ProgressBar(std::string label)
      : label_(std::move(label)), start_(std::chrono::steady_clock::now()) {}

  void Update(const CopyProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (p.bytes_done < p.bytes_total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? static_cast<double>(p.bytes_done) / elapsed : 0;
    const double fraction =
        p.bytes_total > 0 ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total)
                          : 1;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar =
        "\r" + label_ + " [" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "] ";
    char pct[16];
    std::snprintf(pct, sizeof(pct), "%3d%% ", static_cast<int>(fraction * 100));
    bar += pct + internal::HumanBytes(p.bytes_done) + "/" + internal::HumanBytes(p.bytes_total);
    if (rate > 0) {
      bar += "  " + internal::HumanBytes(static_cast<uint64_t>(rate)) + "/s";
      const double left = static_cast<double>(p.bytes_total - p.bytes_done) / rate;
      char eta[32];
      std::snprintf(eta, sizeof(eta), "  ETA %dm%02ds", static_cast<int>(left) / 60,
                    static_cast<int>(left) % 60);
      bar += eta;
    }
    bar += "\033[K";  // clear the rest of the line
    std::fputs(bar.c_str(), stderr);
    std::fflush(stderr);
    drawn_ = true;
  }

  void Finish() {
    if (drawn_) std::fputs("\r\033[K", stderr);
  }

 private:
  const std::string label_;
  const std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_{};
  bool drawn_ = false;
};

}  // namespace safepoint
