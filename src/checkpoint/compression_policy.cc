// The compression policy of packed writes (compression_policy.h), and the compression names of
// PackOptions (checkpoint.h), which are the codec's.
#include "checkpoint/compression_policy.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "base/parallel.h"

namespace safepoint {

static_assert(static_cast<int>(Compression::kAuto) == static_cast<int>(codec::Mode::kAuto));
static_assert(static_cast<int>(Compression::kNone) == static_cast<int>(codec::Mode::kNone));
static_assert(static_cast<int>(Compression::kZstd) == static_cast<int>(codec::Mode::kZstd));
static_assert(static_cast<int>(Compression::kPlanes) == static_cast<int>(codec::Mode::kPlanes));

Result<Compression> ParseCompression(std::string_view text) {
  SP_ASSIGN_OR_RETURN(codec::Mode m, codec::ParseMode(text));
  return static_cast<Compression>(m);
}

std::string_view CompressionName(Compression c) {
  return codec::ModeName(static_cast<codec::Mode>(c));
}

PackOptions MakePackOptions(std::string_view compression, bool incremental) {
  auto c = ParseCompression(compression);
  return {c.ok() ? *c : Compression::kNone, incremental};
}

PackReport PackReportFor(const std::string& uri) {
  return internal::CompressionPolicy::Get().Report(uri);
}

namespace internal {

CompressionPolicy& CompressionPolicy::Get() {
  static CompressionPolicy* p = new CompressionPolicy();
  return *p;
}

bool CompressionPolicy::WantPacked(const std::string& uri, const PackOptions& options,
                                   std::span<const std::byte> sample, int element_size) {
  if (!options.packed()) return false;
  if (options.compression != Compression::kAuto) return true;
  // Incremental too: the packed writer's choice needs the encoder's speed.
  if (NeedsProbe(uri)) Probe(uri, sample, element_size);
  return options.incremental || Choose(uri, Compression::kAuto) != codec::Mode::kNone;
}

codec::Mode CompressionPolicy::Choose(const std::string& uri, Compression requested) {
  if (requested != Compression::kAuto) return static_cast<codec::Mode>(requested);
  std::lock_guard<std::mutex> lock(mu_);
  const TierLearning& t = tiers_[uri];
  const double threads = static_cast<double>(DefaultCpuThreads());
  // What was measured beats what was predicted: compressed writes that moved the image
  // slower than plain ones did (the encoder shares the cores with SHA-256 and the other
  // processes, and the packed layout writes an object per chunk) mean plain.
  const bool measured_slower =
      t.plain_bps > 0 && t.compressed_bps > 0 && t.compressed_bps < t.plain_bps;
  if (!measured_slower && t.write_bps > 0 && t.encode_bps_thread > 0 && t.probe_ratio < 0.95 &&
      t.encode_bps_thread * threads >= t.write_bps) {
    return codec::Mode::kAuto;
  }
  return codec::Mode::kNone;
}

bool CompressionPolicy::NeedsProbe(const std::string& uri) {
  std::lock_guard<std::mutex> lock(mu_);
  return tiers_[uri].encode_bps_thread == 0;
}

void CompressionPolicy::Probe(const std::string& uri, std::span<const std::byte> sample,
                              int element_size) {
  if (sample.empty()) return;
  std::vector<std::byte> frame;
  const auto t0 = std::chrono::steady_clock::now();
  auto m = codec::EncodeChunk(sample, element_size, codec::Mode::kAuto, &frame);
  const double s =
      std::max(1e-9, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!m.ok()) return;
  std::lock_guard<std::mutex> lock(mu_);
  TierLearning& t = tiers_[uri];
  t.encode_bps_thread = static_cast<double>(sample.size()) / s;
  t.probe_ratio = static_cast<double>(frame.size()) / static_cast<double>(sample.size());
}

void CompressionPolicy::WrotePlain(const std::string& uri, const PackOptions& options,
                                   uint64_t bytes, double seconds) {
  if (options.compression != Compression::kAuto) return;
  Wrote(uri, bytes, seconds);
  Moved(uri, /*compressed=*/false, bytes, seconds);
  Plain(uri, "auto:none");
}

void CompressionPolicy::Wrote(const std::string& uri, uint64_t bytes, double seconds) {
  if (bytes < (1 << 20) || seconds <= 0) return;  // too small to say anything
  std::lock_guard<std::mutex> lock(mu_);
  TierLearning& t = tiers_[uri];
  const double bps = static_cast<double>(bytes) / seconds;
  t.write_bps = t.write_bps == 0 ? bps : 0.5 * t.write_bps + 0.5 * bps;
}

void CompressionPolicy::Moved(const std::string& uri, bool compressed, uint64_t bytes,
                              double seconds) {
  if (bytes < (1 << 20) || seconds <= 0) return;  // too small to say anything
  std::lock_guard<std::mutex> lock(mu_);
  double& bps = compressed ? tiers_[uri].compressed_bps : tiers_[uri].plain_bps;
  const double now = static_cast<double>(bytes) / seconds;
  bps = bps == 0 ? now : 0.5 * bps + 0.5 * now;
}

void CompressionPolicy::Encoded(const std::string& uri, uint64_t raw, uint64_t stored,
                                std::string mode) {
  std::lock_guard<std::mutex> lock(mu_);
  TierLearning& t = tiers_[uri];
  t.raw += raw;
  t.stored += stored;
  t.mode = std::move(mode);
}

void CompressionPolicy::Plain(const std::string& uri, std::string mode) {
  std::lock_guard<std::mutex> lock(mu_);
  tiers_[uri].mode = std::move(mode);
}

PackReport CompressionPolicy::Report(const std::string& uri) {
  std::lock_guard<std::mutex> lock(mu_);
  PackReport r;
  auto it = tiers_.find(uri);
  if (it == tiers_.end()) return r;
  const TierLearning& t = it->second;
  r.mode = t.mode;
  r.raw_bytes = t.raw;
  r.stored_bytes = t.stored;
  r.ratio = t.stored > 0 ? static_cast<double>(t.raw) / static_cast<double>(t.stored) : 1.0;
  r.write_bps = t.write_bps;
  r.encode_bps = t.encode_bps_thread * static_cast<double>(DefaultCpuThreads());
  return r;
}

void CompressionPolicy::SetForTest(const std::string& uri, double write_bps,
                                   double encode_bps_thread, double probe_ratio) {
  std::lock_guard<std::mutex> lock(mu_);
  TierLearning& t = tiers_[uri];
  t.write_bps = write_bps;
  t.encode_bps_thread = encode_bps_thread;
  t.probe_ratio = probe_ratio;
}

void CompressionPolicy::SetRatesForTest(const std::string& uri, double plain_bps,
                                        double compressed_bps) {
  std::lock_guard<std::mutex> lock(mu_);
  TierLearning& t = tiers_[uri];
  t.plain_bps = plain_bps;
  t.compressed_bps = compressed_bps;
}

void SetTierLearningForTest(const std::string& uri, double write_bps, double encode_bps_thread,
                            double probe_ratio) {
  CompressionPolicy::Get().SetForTest(uri, write_bps, encode_bps_thread, probe_ratio);
}
void SetTierRatesForTest(const std::string& uri, double plain_bps, double compressed_bps) {
  CompressionPolicy::Get().SetRatesForTest(uri, plain_bps, compressed_bps);
}

}  // namespace internal
}  // namespace safepoint
