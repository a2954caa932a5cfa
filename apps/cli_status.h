// `safepoint status [--shm-dir DIR] [--json]` (apps/cli_status.cc): this node's jobs, their
// agents, snapshots and work.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace safepoint::cli {

int CmdStatus(const std::string& shm_dir, bool json);

// "training process 12" or "training processes 12, 34" (status and gc).
std::string TrainingProcesses(const std::vector<uint32_t>& pids);

// The framework whose checkpoints a safepoint directory keeps, for a job's name that says
// nothing (an integration's default path is <its checkpoint directory>/safepoint): "Lightning"
// (its .ckpt pointer files beside it), "DeepSpeed" (its `latest` file or global_stepN
// directories beside it), else "".
std::string FrameworkOf(const std::string& checkpoint_path);

}  // namespace safepoint::cli
