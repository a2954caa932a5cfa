// Opening the checkpoint a command reads, and picking its step (cli_store.h).
#include "cli_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "base/log.h"
#include "base/unique_fd.h"

namespace safepoint::cli {

void ReportProblems(const std::vector<std::string>& problems) {
  for (const auto& p : problems) spdlog::warn("skipping {}", p);
}

Status CheckDirectory(const std::string& path, const std::string& what) {
  internal::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd) return Status::OK();
  const int err = errno;
  if (err == ENOENT) return NotFound(path + ": no such " + what);
  if (err == ENOTDIR) return InvalidArgument(path + ": not a directory");
  return ErrnoStatus("open " + what, path, err);
}

std::optional<std::string> LocalDirectory(std::string_view path) {
  constexpr std::string_view kFile = "file://";
  if (path.starts_with(kFile)) {
    path.remove_prefix(kFile.size());
    if (path.starts_with("localhost/")) path.remove_prefix(std::string_view("localhost").size());
    if (!path.starts_with('/')) return std::nullopt;  // not a valid file:// URI: storage says so
    return std::string(path);
  }
  if (path.find("://") != std::string_view::npos) return std::nullopt;
  return std::string(path);
}

Result<std::unique_ptr<CheckpointStore>> OpenExistingStore(const std::string& path) {
  if (auto dir = LocalDirectory(path)) {
    SP_RETURN_IF_ERROR(CheckDirectory(*dir, "checkpoint directory"));
  }
  return OpenCheckpointStore(path);
}

std::string CommittedStepsNote(const std::vector<CommitRecord>& committed) {
  if (committed.empty()) return " (no committed steps)";
  constexpr size_t kShown = 10;  // at each end of a long list
  std::string m = " (committed steps:";
  for (size_t i = 0; i < committed.size(); ++i) {
    if (committed.size() > 2 * kShown && i == kShown) {
      m += " ...";
      i = committed.size() - kShown;
    }
    m += " " + std::to_string(committed[i].step);
  }
  if (committed.size() > 2 * kShown) m += "; " + std::to_string(committed.size()) + " in all";
  return m + ")";
}

Result<CommitRecord> PickStep(CheckpointStore& store, std::optional<uint64_t> step) {
  std::vector<std::string> problems;
  if (step) {
    auto record = store.ReadCommit(*step);
    if (record.ok() || record.status().code() != StatusCode::kNotFound) return record;
    auto committed = store.ListCommitted(&problems);
    if (!committed.ok()) return record;
    return NotFound(store.storage().uri() + ": step " + std::to_string(*step) +
                    " is not committed" + CommittedStepsNote(*committed));
  }
  SP_ASSIGN_OR_RETURN(auto committed, store.ListCommitted(&problems));
  ReportProblems(problems);
  if (committed.empty()) return NotFound(store.storage().uri() + ": no committed checkpoint");
  return committed.back();
}

}  // namespace safepoint::cli
