// safepointd: the node agent of one job (include/safepoint/agent.h).
//
//   safepointd --job JOB [--shm-dir DIR] [--no-emergency-flush] [--sidecar] [--idle-exit S]
//
// Training processes start it on demand; `safepoint agent` runs the same code in the
// foreground as a sidecar.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "safepoint/agent.h"

int main(int argc, char** argv) {
  safepoint::AgentOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--job" && i + 1 < argc) {
      o.job = argv[++i];
    } else if (a == "--shm-dir" && i + 1 < argc) {
      o.shm_dir = argv[++i];
    } else if (a == "--no-emergency-flush") {
      o.emergency_flush = false;
    } else if (a == "--sidecar") {
      o.exit_when_idle = false;
    } else if (a == "--idle-exit" && i + 1 < argc) {
      o.idle_exit_seconds = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: safepointd --job JOB [--shm-dir DIR] [--no-emergency-flush] "
                   "[--sidecar] [--idle-exit SECONDS]\n");
      return 2;
    }
  }
  if (o.job.empty()) {
    std::fprintf(stderr, "safepointd: --job is required\n");
    return 2;
  }
  return safepoint::RunAgent(o);
}
