// A job's measurement history: what the interval advisor and `safepoint simulate --from` learn
// from, kept with the job's checkpoints so that it survives restarts of the job (on any node).
//
// Who writes it: the node agent that serves rank 0 (src/agent/history_recorder.h), from the
// reports that arrive with the ranks' snapshot notes and from the persists and tier copies it
// does itself. No training process polls for it or writes it (issue 21).
//
// Where: `safepoint-history.jsonl` in the checkpoint directory when it is a local directory
// (a plain path or file://), appended; in an object store (s3://, rados://, ...), which cannot
// append, objects `safepoint-history/<agent start, ns>-<pid>-<n>.jsonl` under the checkpoint
// path, each agent rewriting its newest segment (a new one past kSegmentBytes). Readers
// concatenate the segments in name order. The files live beside the `step-*` directories and
// are never read as a checkpoint (stores list only `step-` names). Older versions wrote an
// object store's history to `$SAFEPOINT_HISTORY_DIR/<job>.history.jsonl` (HistoryPath); that
// file is still read, merged with the segments, but no longer written.
//
// Format: JSON lines. Every line has "t" (Unix seconds) and "ev":
//   {"ev":"start","run":R}                           a process started (Checkpointer created)
//   {"ev":"save","n":N,"seconds":S,"max":M,          N saves since the last such line, median
//    "steps":[A,B],"span":T,                         blocking seconds S (at most one line per
//    "world_size":W,"node_ranks":L,"peers":P}        `save_line_gap` seconds: also a heartbeat);
//                                                    the first and last of their steps and the
//                                                    seconds from the first to the last (how long
//                                                    a step takes); the job's shape as rank 0's
//                                                    agent saw it: W ranks, L of them on rank 0's
//                                                    node, P: copies of each node's snapshots on
//                                                    other nodes (redundancy). Each optional.
//   {"ev":"persist","level":L,"seconds":S,"bytes":B} one step written to level L ("path",
//                                                    "tier 1", ...)
//   {"ev":"restore","source":L,"seconds":S}          one restore from L ("memory", "peer",
//                                                    "path", "tier 1", ...)
//   {"ev":"close"}                                   the process ended cleanly
// A run that has no "close" and is followed by a "start" was interrupted: its end is taken to
// be its last line (heartbeats bound the error by `save_line_gap`), and the gap to the next
// start is its restart time. The learned MTBF is the wall time covered (running plus
// restarting) over the interruptions. Unknown lines are skipped, so later versions may add events.
// A local file is appended with one write(2) per line (O_APPEND; no fsync: a power cut may drop
// the last lines, which only loses samples); a segment is published whole on Sync().
//
// HistoryWriter is not thread-safe (one per agent, called from its main loop).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "safepoint/status.h"

namespace safepoint {
class Storage;
}

namespace safepoint::advisor {

// The history file of a local checkpoint path (see above); for another path the deprecated
// `$SAFEPOINT_HISTORY_DIR/<job>.history.jsonl` when that is set, else "".
std::string HistoryPath(const std::string& checkpoint_path, const std::string& job);
// Whether `checkpoint_path` is a local directory (its history is HistoryPath, appended).
bool HistoryIsLocal(const std::string& checkpoint_path);

inline constexpr std::string_view kHistorySegmentPrefix = "safepoint-history/";
inline constexpr uint64_t kSegmentBytes = 1 << 20;  // a segment is rewritten whole: kept small

// The job's shape, which decides where a failure restores from (a lost node's snapshots from a
// peer's copy only when there are peers). 0: not known.
struct JobShape {
  uint32_t world_size = 0;   // ranks (GPUs) of the job
  uint32_t node_ranks = 0;   // ranks on rank 0's node
  bool peer_copies = false;  // copies of each node's snapshots kept in other nodes' memory
  bool operator==(const JobShape&) const = default;
};

class HistoryWriter {
 public:
  // Appends to `path` (created if missing, with its directory). `save_line_gap`: seconds between
  // "save" lines.
  static Result<HistoryWriter> Open(const std::string& path, double save_line_gap = 10);
  // Keeps the lines in memory and publishes them to `storage` on Sync() as segments named
  // kHistorySegmentPrefix + `segment` + "-<n>.jsonl" (see above).
  static HistoryWriter InStorage(std::shared_ptr<Storage> storage, std::string segment,
                                 double save_line_gap = 10);
  HistoryWriter(HistoryWriter&&) noexcept;
  HistoryWriter& operator=(HistoryWriter&&) noexcept;
  ~HistoryWriter();

  Status RecordStart(uint64_t run);
  // Buffers the sample (of the save of `step`, when given); writes a "save" line when
  // `save_line_gap` passed since the last one.
  Status RecordSave(double blocking_seconds, std::optional<uint64_t> step = std::nullopt);
  // The job's shape, written with the next save lines.
  void SetShape(const JobShape& shape) { shape_ = shape; }
  bool has_shape() const { return shape_.has_value(); }
  // The next RecordSave writes a line.
  bool SaveLineDue() const;
  Status RecordPersist(const std::string& level, double seconds, uint64_t bytes);
  Status RecordRestore(const std::string& source, double seconds);
  // Writes the buffered save samples and a "close" line.
  Status RecordClose();
  Status Flush();  // writes the buffered save samples now
  // Publishes the lines not yet in storage (a segment writer; nothing to do for a local file).
  Status Sync();
  // Lines are waiting for Sync().
  bool unsynced() const { return dirty_; }

  // Sync in two halves, for a caller that publishes off its own thread: the current segment
  // whole when lines wait (nullopt otherwise), counted as published (the writer moves on to a
  // new segment past kSegmentBytes); PublishSegment writes it (retrying a failure is the
  // caller's: a newer take of the same name holds all of its lines).
  struct Segment {
    std::string name;
    std::string data;
  };
  std::optional<Segment> TakeSegment();
  static Status PublishSegment(Storage& storage, const Segment& segment);

  // The file, or the storage's description of the current segment.
  const std::string& path() const { return path_; }

 private:
  HistoryWriter(int fd, std::string path, double gap);
  Status Append(const std::string& line);
  std::string SegmentName() const;
  int fd_ = -1;
  std::string path_;
  double gap_ = 10;
  double last_save_line_ = 0;
  std::vector<double> pending_saves_;
  // The pending saves' steps and times (first and last), for the line's "steps" and "span".
  std::optional<uint64_t> first_step_, last_step_;
  double first_save_t_ = 0, last_save_t_ = 0;
  std::optional<JobShape> shape_;
  // A segment writer: the storage, the segment's stem and number, its lines so far.
  std::shared_ptr<Storage> storage_;
  std::string segment_;
  uint64_t segment_index_ = 0;
  std::string lines_;
  bool dirty_ = false;
};

// Robust summaries of samples: the median and how many there were.
struct Measured {
  double seconds = 0;
  uint64_t samples = 0;
  double bytes = 0;  // persists: the median size of the samples that recorded one, else 0
};

struct HistorySummary {
  std::string path;
  std::optional<Measured> save;             // blocking seconds of a save
  std::map<std::string, Measured> persist;  // by level
  std::map<std::string, Measured> restore;  // by source
  std::optional<Measured> restart;          // gap from an interruption to the restart
  uint64_t runs = 0;
  uint64_t interruptions = 0;
  double uptime_seconds = 0;  // summed over runs (start to last line)
  // (uptime + the restarts' time) / interruptions, when there was one
  std::optional<double> learned_mtbf_seconds;
  std::vector<double> interruption_times;  // Unix seconds
  // From the save lines that recorded them: the median seconds from one save to the next and
  // steps from one save to the next, and the training time of one step without a save,
  // (seconds between saves - a save's blocking time) / steps between saves.
  std::optional<double> save_period_seconds;
  std::optional<double> steps_per_save;
  std::optional<double> step_seconds;
  std::optional<JobShape> shape;  // the newest recorded
};

// Reads and summarizes a history file. NotFound naming the path when it does not exist;
// malformed lines are skipped and counted in `*skipped` when given.
Result<HistorySummary> ReadHistory(const std::string& path, uint64_t* skipped = nullptr);
// Summarizes history lines (`name`: where they came from, for HistorySummary::path). Lines of
// several writers (segments, the legacy file) are taken in the order of their "t".
HistorySummary SummarizeHistory(const std::string& text, const std::string& name,
                                uint64_t* skipped = nullptr);
// The history of the job at `checkpoint_path`, wherever it is kept (see above): the local file,
// or the storage's segments merged with the legacy `$SAFEPOINT_HISTORY_DIR` file. NotFound
// naming where it looked when there is none.
Result<HistorySummary> ReadJobHistory(const std::string& checkpoint_path, const std::string& job,
                                      uint64_t* skipped = nullptr);

// A restore time for `level` that was never measured, estimated from the state's size (the
// median bytes of the checkpoint path's persists) and a measured bandwidth: for "memory", the
// save's copy into shared memory (a reload copies the same bytes back, so about a save's blocking
// time); for the path and the tiers, the level's persist bandwidth (reading back costs about what
// writing did). `how` says so in words, with the size and bandwidth when they were recorded.
// nullopt when the history has no measurement to estimate from.
struct RestoreEstimate {
  double seconds = 0;
  std::string how;  // "estimated: ..."
};
std::optional<RestoreEstimate> EstimateRestore(const HistorySummary& h, const std::string& level);

double NowSeconds();  // Unix time

}  // namespace safepoint::advisor
