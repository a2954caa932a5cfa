// The compression policy of packed writes: which codec mode a write to a tier uses, and for
// compression="auto" whether compressing pays on that tier at all, learned per tier from what
// this process measured (the tier's write bandwidth, the encoder's speed and ratio, and how fast
// auto's plain and compressed writes moved images). Not the checkpoint-interval advisor
// (src/advisor): this one only picks a layout and a codec mode.
//
// One policy per process (CompressionPolicy::Get), keyed by the tier's URI; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>

#include "codec/codec.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

// What a tier's writes achieved and chose: the compression in use and its ratio, for status().
struct PackReport {
  std::string mode;           // "none", "zstd", "planes", "auto:zstd", "auto:none", ...
  double ratio = 1.0;         // raw bytes / stored bytes of the chunks written
  double write_bps = 0;       // measured write bandwidth of the tier
  double encode_bps = 0;      // measured encoder throughput (all threads)
  uint64_t raw_bytes = 0;     // chunks encoded
  uint64_t stored_bytes = 0;  // their frames
};
// The report for the tier at `uri` in this process (empty mode when it wrote nothing packed).
PackReport PackReportFor(const std::string& uri);

namespace internal {

class CompressionPolicy {
 public:
  static CompressionPolicy& Get();

  // Whether `options` asks for a packed write here and now (auto without incremental packs only
  // where compressing pays on this tier), probing the encoder with `sample` (tensor bytes of
  // `element_size`-byte values) when it must.
  bool WantPacked(const std::string& uri, const PackOptions& options,
                  std::span<const std::byte> sample, int element_size);
  // The codec mode for a write to `uri` that asked for `requested`.
  codec::Mode Choose(const std::string& uri, Compression requested);
  // Whether the encoder's speed on `uri` was never measured.
  bool NeedsProbe(const std::string& uri);
  // Encodes `sample` once to learn the encoder's speed and ratio on this kind of data.
  void Probe(const std::string& uri, std::span<const std::byte> sample, int element_size);

  // What writes report. A plain image write with `options` (it teaches auto the tier's write
  // speed and that plain was chosen):
  void WrotePlain(const std::string& uri, const PackOptions& options, uint64_t bytes,
                  double seconds);
  // Bytes a write stored and the seconds the tier took for them (encoding not counted).
  void Wrote(const std::string& uri, uint64_t bytes, double seconds);
  // Raw bytes/s of one of auto's plain (`compressed` false) or compressed image writes.
  void Moved(const std::string& uri, bool compressed, uint64_t bytes, double seconds);
  // Chunks encoded (raw bytes to stored bytes) in codec mode `mode` (its report name).
  void Encoded(const std::string& uri, uint64_t raw, uint64_t stored, std::string mode);

  PackReport Report(const std::string& uri);

  // Tests only (internal::SetTierLearningForTest, SetTierRatesForTest).
  void SetForTest(const std::string& uri, double write_bps, double encode_bps_thread,
                  double probe_ratio);
  void SetRatesForTest(const std::string& uri, double plain_bps, double compressed_bps);

 private:
  struct TierLearning {
    double write_bps = 0;          // bytes/s the tier took
    double encode_bps_thread = 0;  // raw bytes/s one encoder thread made frames of
    double probe_ratio = 1;        // stored / raw of the probe
    uint64_t raw = 0, stored = 0;  // chunks this process encoded for the tier
    // Raw (image) bytes/s of auto's plain writes and of its compressed, non-incremental ones.
    double plain_bps = 0, compressed_bps = 0;
    std::string mode;
  };
  void Plain(const std::string& uri, std::string mode);

  std::mutex mu_;
  std::map<std::string, TierLearning> tiers_;
};

// Tests only: sets what compression="auto" has learned about the tier at `uri` (its write
// bandwidth and one encoder thread's speed, bytes/s, 0 = not measured yet; the probe's stored /
// raw), so that a test of the per-tier choice does not depend on timing.
void SetTierLearningForTest(const std::string& uri, double write_bps, double encode_bps_thread,
                            double probe_ratio);
// Tests only: the raw bytes per second that auto's plain writes and its compressed
// (non-incremental) writes to `uri` achieved; 0 = not measured yet.
void SetTierRatesForTest(const std::string& uri, double plain_bps, double compressed_bps);

}  // namespace internal
}  // namespace safepoint
