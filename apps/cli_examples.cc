// The examples of the commands' --help (cli_examples.h): one place, so that every command has
// one and they read alike. Each line is a command a user can paste (paths are placeholders).
#include "cli_examples.h"

#include <map>

namespace safepoint::cli {

namespace {

const std::map<std::string, std::string>& Examples() {
  static const std::map<std::string, std::string> examples = {
      {"ls", "safepoint ls /ckpt/run1\n  safepoint ls s3://bucket/run1 --json"},
      {"inspect", "safepoint inspect /ckpt/run1 --step 100 --rank 0"},
      {"verify",
       "safepoint verify /ckpt/run1 --all\n  safepoint verify s3://bucket/run1 --step 100"},
      {"cp", "safepoint cp /ckpt/run1 s3://bucket/run1 --all --compression auto"},
      {"rm", "safepoint rm /ckpt/run1 --step 100"},
      {"agent", "safepoint agent --job run1 --metrics 0.0.0.0:9400"},
      {"status", "safepoint status\n  safepoint status --watch --interval 5"},
      {"gc", "safepoint gc --dry-run"},
      {"chunk-gc", "safepoint chunk-gc /ckpt/run1"},
      {"log", "safepoint log /ckpt/run1 --limit 10"},
      {"tag", "safepoint tag /ckpt/run1 100 before-lr-change\n  safepoint tag /ckpt/run1"},
      {"diff", "safepoint diff /ckpt/run1 100 before-lr-change"},
      {"export",
       "safepoint export /ckpt/run1 model.safetensors --format safetensors --select model"},
      {"import", "safepoint import model.safetensors /ckpt/run2 --step 0"},
      {"advise", "safepoint advise /ckpt/run1\n  safepoint advise /ckpt/run1 --mtbf 3h --json"},
      {"simulate",
       "safepoint simulate --from /ckpt/run1 --gpus 512 --node-mtbf 30d\n"
       "  safepoint simulate --mtbf 3h --state-per-gpu 16GiB --memory-bandwidth 10GB "
       "--storage-bandwidth 20GB"},
  };
  return examples;
}

}  // namespace

void AddExamples(CLI::App& app, const std::string& footer) {
  for (CLI::App* cmd : app.get_subcommands(nullptr)) {
    auto it = Examples().find(cmd->get_name());
    if (it == Examples().end()) continue;
    cmd->footer((it->second.find('\n') == std::string::npos ? "Example:\n  " : "Examples:\n  ") +
                it->second + "\n\n" + footer);
  }
}

}  // namespace safepoint::cli
