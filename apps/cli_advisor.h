// `safepoint advise` and `safepoint simulate` (apps/cli_advisor.cc): the checkpoint-interval
// advisor and the goodput simulator of src/advisor, on the command line.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <optional>

namespace safepoint::cli {

class AdvisorCommands {
 public:
  // Adds the two commands to `app` (before it parses).
  explicit AdvisorCommands(CLI::App& app);
  ~AdvisorCommands();

  // After parsing: the exit status of the command given, or nullopt when it was neither.
  std::optional<int> Run() const;

  struct Options;  // the parsed flags (cli_advisor.cc)

 private:
  std::unique_ptr<Options> o_;
  CLI::App* advise_ = nullptr;
  CLI::App* simulate_ = nullptr;
};

}  // namespace safepoint::cli
