// An example in every command's --help (apps/cli_examples.cc).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace safepoint::cli {

// Puts each listed command's example above `footer` in that command's help ("Example:" and the
// command lines), for every command of `app` (call it once all commands are added). A command
// without an example is a bug that tests/python/test_cli.py catches.
void AddExamples(CLI::App& app, const std::string& footer);

}  // namespace safepoint::cli
