// log, tag, diff, export and import (apps/cli_versions.h; docs/operations.md, "Versions").
//
// log, tag and diff are C++ over src/checkpoint/versions.h. export and import need PyTorch for
// the torch format, and the safetensors package is the reference for its format, so the CLI
// hands them to the package's Python module `safepoint.interchange` (docs/guide.md says why):
// it runs the Python next to this binary (the one whose environment installed it), or
// $SAFEPOINT_PYTHON.
#include "cli_versions.h"

#include <unistd.h>

#include <climits>
#include <ctime>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "advisor/goodput.h"
#include "base/log.h"
#include "checkpoint/versions.h"
#include "cli_format.h"
#include "cli_store.h"
#include "safepoint/checkpoint.h"

namespace safepoint {
namespace {

using json = nlohmann::ordered_json;

constexpr size_t kMaxLogLocations = 16;  // locations followed through parents

using cli::Dims;
using cli::Fail;
using cli::FormatTime;
using cli::kExitError;
using cli::kExitOk;
using cli::PrintTable;

// A checkpoint that a command reads must exist (opening a missing local directory would create
// it and show nothing).
Result<std::unique_ptr<CheckpointStore>> OpenExisting(const std::string& path) {
  return cli::OpenExistingStore(path);
}

// --- log ---------------------------------------------------------------------------------------

struct LogOptions {
  std::string path;
  uint64_t limit = 0;  // 0: all
  bool json = false;
};

json MetadataJson(const std::string& text) {
  if (text.empty()) return nullptr;
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? json(text) : j;
}

// Appends the steps of `location` (at most `max_step`, newest first) to `out`, and the
// locations their parents lie in to `next`.
Status LogLocation(const std::string& location, std::optional<uint64_t> max_step, json* out,
                   std::map<std::string, uint64_t>* next, uint64_t* budget) {
  SP_ASSIGN_OR_RETURN(auto store, OpenExisting(location));
  std::vector<std::string> problems;
  SP_ASSIGN_OR_RETURN(auto committed, store->ListCommitted(&problems));
  for (const auto& p : problems) spdlog::warn("skipping {}", p);
  std::map<uint64_t, std::vector<std::string>> tags;
  problems.clear();
  SP_ASSIGN_OR_RETURN(auto all_tags, ListTags(*store, &problems));
  for (const auto& p : problems) spdlog::warn("skipping {}", p);
  for (const Tag& t : all_tags) tags[t.step].push_back(t.name);
  const std::string uri = store->storage().uri();
  for (auto it = committed.rbegin(); it != committed.rend() && *budget > 0; ++it) {
    const CommitRecord& c = *it;
    if (max_step && c.step > *max_step) continue;
    --*budget;
    json e = {{"location", uri},
              {"step", c.step},
              {"time", FormatTime(c.commit_time_ns)},
              {"world_size", c.world_size},
              {"bytes", c.total_bytes()}};
    auto meta = ReadStepHeader(*store, c);
    if (!meta.ok()) {
      e["error"] = meta.status().ToString();
      out->push_back(std::move(e));
      continue;
    }
    const Lineage& lin = meta->lineage;
    e["attempt"] = meta->attempt;
    if (lin.has_parent) {
      const bool here = lin.parent_location.empty();
      e["parent"] = {{"step", lin.parent_step}, {"location", here ? uri : lin.parent_location}};
      if (!here) {
        uint64_t& s = (*next)[lin.parent_location];
        s = std::max(s, lin.parent_step);
      }
    } else {
      e["parent"] = nullptr;
    }
    e["tags"] = tags.contains(c.step) ? json(tags[c.step]) : json::array();
    e["metadata"] = MetadataJson(lin.metadata);
    out->push_back(std::move(e));
  }
  return Status::OK();
}

int CmdLog(const LogOptions& o) {
  json entries = json::array();
  std::map<std::string, uint64_t> next;
  uint64_t budget = o.limit == 0 ? UINT64_MAX : o.limit;
  if (Status s = LogLocation(o.path, std::nullopt, &entries, &next, &budget); !s.ok()) {
    return Fail(s);
  }
  // Follow parents into the locations runs were branched from (each location once).
  std::set<std::string> visited = {o.path};
  json notes = json::array();
  while (!next.empty() && visited.size() < kMaxLogLocations && budget > 0) {
    auto [location, step] = *next.begin();
    next.erase(next.begin());
    if (!visited.insert(location).second) continue;
    if (Status s = LogLocation(location, step, &entries, &next, &budget); !s.ok()) {
      notes.push_back({{"location", location}, {"error", s.ToString()}});
      spdlog::warn("cannot follow the lineage into {}: {}", location, s.ToString());
    }
  }
  if (o.json) {
    std::cout << entries.dump(2) << "\n";
    return kExitOk;
  }
  if (entries.empty()) {
    std::cout << "no committed steps in " << o.path << "\n";
    return kExitOk;
  }
  std::string location;
  std::vector<std::vector<std::string>> rows;
  auto flush = [&] {
    if (rows.size() > 1) PrintTable(rows);
    rows.clear();
  };
  for (const json& e : entries) {
    if (e["location"] != location) {
      flush();
      if (!location.empty()) std::cout << "\n";
      location = e["location"];
      std::cout << location << "\n";
      rows.push_back({"STEP", "COMMITTED", "ATTEMPT", "PARENT", "TAGS", "METADATA"});
    }
    std::string parent = "-", tags, metadata, attempt = "-";
    if (e.contains("error")) {
      rows.push_back(
          {std::to_string(e["step"].get<uint64_t>()), e["time"], "?", "?", "", e["error"]});
      continue;
    }
    if (!e["parent"].is_null()) {
      parent = std::to_string(e["parent"]["step"].get<uint64_t>());
      if (e["parent"]["location"] != location) {
        parent += " in " + e["parent"]["location"].get<std::string>();
      }
    }
    // The attempt as --json gives it (decimal): one form to compare and search for.
    if (e["attempt"].get<uint64_t>() != 0) attempt = std::to_string(e["attempt"].get<uint64_t>());
    for (const auto& t : e["tags"]) tags += (tags.empty() ? "" : ",") + t.get<std::string>();
    if (!e["metadata"].is_null()) metadata = e["metadata"].dump();
    rows.push_back(
        {std::to_string(e["step"].get<uint64_t>()), e["time"], attempt, parent, tags, metadata});
  }
  flush();
  return kExitOk;
}

// --- tag ---------------------------------------------------------------------------------------

struct TagOptions {
  std::string path;
  std::vector<std::string> args;  // [STEP] NAME
  bool remove = false;
  bool replace = false;
  bool json = false;
};

int CmdTag(const TagOptions& o) {
  auto store = OpenExisting(o.path);
  if (!store.ok()) return Fail(store.status());
  const std::string uri = (*store)->storage().uri();
  if (o.args.empty()) {  // list
    std::vector<std::string> problems;
    auto tags = ListTags(**store, &problems);
    if (!tags.ok()) return Fail(tags.status());
    for (const auto& p : problems) spdlog::warn("skipping {}", p);
    if (o.json) {
      json out = json::array();
      for (const Tag& t : *tags) {
        out.push_back({{"name", t.name}, {"step", t.step}, {"time", FormatTime(t.create_time_ns)}});
      }
      std::cout << out.dump(2) << "\n";
    } else if (tags->empty()) {
      std::cout << "no tags in " << uri << "\n";
    } else {
      std::vector<std::vector<std::string>> rows = {{"TAG", "STEP", "CREATED"}};
      for (const Tag& t : *tags) {
        rows.push_back({t.name, std::to_string(t.step), FormatTime(t.create_time_ns)});
      }
      PrintTable(rows);
    }
    return kExitOk;
  }
  const std::string name = o.args.back();
  std::optional<uint64_t> step;
  if (o.args.size() == 2) {
    auto s = ResolveStep(**store, o.args[0]);
    if (!s.ok()) return Fail(s.status());
    step = *s;
  }
  if (o.remove) {
    auto tag = ReadTag(**store, name);
    if (!tag.ok()) return Fail(tag.status());
    if (step && tag->step != *step) {
      return Fail(InvalidArgument(uri + ": tag '" + name + "' names step " +
                                  std::to_string(tag->step) + ", not " + std::to_string(*step)));
    }
    if (Status s = DeleteTag(**store, name); !s.ok()) return Fail(s);
    if (o.json) {
      std::cout << json{{"uri", uri}, {"tag", name}, {"step", tag->step}, {"deleted", true}}.dump(2)
                << "\n";
    } else {
      std::cout << "deleted tag " << name << " (step " << tag->step << ") from " << uri << "\n";
    }
    return kExitOk;
  }
  if (!step) {
    return Fail(
        InvalidArgument("tag needs STEP and NAME (or NAME with --delete, or neither to "
                        "list the tags)"));
  }
  Tag tag;
  tag.name = name;
  tag.step = *step;
  if (Status s = WriteTag(**store, tag, o.replace); !s.ok()) {
    if (s.code() != StatusCode::kAlreadyExists) return Fail(s);
    // The tag names another step: say how to move it.
    auto existing = ReadTag(**store, name);
    const std::string other =
        existing.ok() ? "step " + std::to_string(existing->step) : std::string("another step");
    return Fail(AlreadyExists(uri + ": tag '" + name + "' already names " + other +
                              "; pass --replace to move it to step " + std::to_string(*step) +
                              " (or delete it first: safepoint tag " + o.path + " " + name +
                              " --delete)"));
  }
  if (o.json) {
    std::cout << json{{"uri", uri}, {"tag", name}, {"step", *step}}.dump(2) << "\n";
  } else {
    std::cout << "tagged step " << *step << " of " << uri << " as " << name << "\n";
  }
  return kExitOk;
}

// --- diff --------------------------------------------------------------------------------------

struct DiffCmdOptions {
  std::string path, a, b;
  bool all = false;
  bool json = false;
};

int CmdDiff(const DiffCmdOptions& o) {
  auto store = OpenExisting(o.path);
  if (!store.ok()) return Fail(store.status());
  auto a = ResolveStep(**store, o.a);
  if (!a.ok()) return Fail(a.status());
  auto b = ResolveStep(**store, o.b);
  if (!b.ok()) return Fail(b.status());
  auto diffs = DiffSteps(**store, *a, **store, *b);
  if (!diffs.ok()) return Fail(diffs.status());
  std::map<std::string, uint64_t> counts;
  for (const auto& k : {"changed", "added", "removed", "reshaped", "same"}) counts[k] = 0;
  for (const TensorDiff& d : *diffs) ++counts[std::string(DiffKindName(d.kind))];
  if (o.json) {
    json tensors = json::array();
    for (const TensorDiff& d : *diffs) {
      if (d.kind == TensorDiff::Kind::kSame && !o.all) continue;
      json j = {{"name", d.name}, {"change", DiffKindName(d.kind)}};
      if (d.kind != TensorDiff::Kind::kAdded) {
        j["dtype_a"] = DTypeName(d.dtype_a);
        j["shape_a"] = d.shape_a;
      }
      if (d.kind != TensorDiff::Kind::kRemoved) {
        j["dtype_b"] = DTypeName(d.dtype_b);
        j["shape_b"] = d.shape_b;
      }
      if (d.kind == TensorDiff::Kind::kChanged || d.kind == TensorDiff::Kind::kSame) {
        j["elements"] = d.elements;
        j["changed"] = d.changed;
        j["max_abs"] = d.max_abs ? json(*d.max_abs) : json(nullptr);
        if (d.max_abs && std::isinf(*d.max_abs)) j["max_abs"] = "inf";
      }
      tensors.push_back(std::move(j));
    }
    std::cout << json{{"uri", (*store)->storage().uri()},
                      {"a", *a},
                      {"b", *b},
                      {"summary", counts},
                      {"tensors", tensors}}
                     .dump(2)
              << "\n";
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"TENSOR", "CHANGE", "DTYPE", "SHAPE", "CHANGED", "MAX_ABS_DIFF"}};
  for (const TensorDiff& d : *diffs) {
    if (d.kind == TensorDiff::Kind::kSame && !o.all) continue;
    std::string dtype, shape, changed, max_abs;
    switch (d.kind) {
      case TensorDiff::Kind::kAdded:
        dtype = DTypeName(d.dtype_b);
        shape = Dims(d.shape_b);
        break;
      case TensorDiff::Kind::kRemoved:
        dtype = DTypeName(d.dtype_a);
        shape = Dims(d.shape_a);
        break;
      case TensorDiff::Kind::kReshaped:
        dtype = std::string(DTypeName(d.dtype_a)) + " -> " + std::string(DTypeName(d.dtype_b));
        shape = Dims(d.shape_a) + " -> " + Dims(d.shape_b);
        break;
      default:
        dtype = DTypeName(d.dtype_a);
        shape = Dims(d.shape_a);
        changed = std::to_string(d.changed) + "/" + std::to_string(d.elements);
        if (d.max_abs) {
          char buf[32];
          std::snprintf(buf, sizeof(buf), "%.6g", *d.max_abs);
          max_abs = buf;
        }
    }
    rows.push_back({d.name, std::string(DiffKindName(d.kind)), dtype, shape, changed, max_abs});
  }
  std::cout << "step " << *a << " -> step " << *b << " of " << (*store)->storage().uri() << ": "
            << counts["changed"] << " changed, " << counts["added"] << " added, "
            << counts["removed"] << " removed, " << counts["reshaped"] << " reshaped, "
            << counts["same"] << " unchanged\n";
  if (rows.size() > 1) {
    std::cout << "\n";
    PrintTable(rows);
  }
  return kExitOk;
}

// --- export / import (Python) ------------------------------------------------------------------

std::string PythonInterpreter() {
  if (const char* p = std::getenv("SAFEPOINT_PYTHON"); p != nullptr && *p != '\0') return p;
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    dir.resize(dir.rfind('/'));
    for (const char* name : {"/python3", "/python"}) {
      if (::access((dir + name).c_str(), X_OK) == 0) return dir + name;
    }
  }
  return "python3";
}

int RunInterchange(const std::vector<std::string>& args) {
  const std::string python = PythonInterpreter();
  std::vector<std::string> argv = {python, "-m", "safepoint.interchange"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c;
  for (auto& s : argv) c.push_back(s.data());
  c.push_back(nullptr);
  std::cout.flush();
  ::execvp(python.c_str(), c.data());
  return Fail(ErrnoStatus("run the Python interpreter for safepoint.interchange", python, errno));
}

struct ExportOptions {
  std::string path, out, format, select, tag, max_shard_size;
  std::optional<uint64_t> step;
  bool json = false;
};

struct ImportOptions {
  std::string source, destination, prefix = "model";
  uint64_t step = 0;
  bool overwrite = false;
  bool json = false;
};

}  // namespace

std::function<std::optional<int>()> AddVersionCommands(CLI::App& app) {
  auto log = std::make_shared<LogOptions>();
  auto tag = std::make_shared<TagOptions>();
  auto diff = std::make_shared<DiffCmdOptions>();
  auto exp = std::make_shared<ExportOptions>();
  auto imp = std::make_shared<ImportOptions>();
  const char* path_help = "checkpoint directory: a path or a storage URI (file://...)";

  CLI::App* log_cmd = app.add_subcommand(
      "log", "the lineage of the committed steps, newest first, following parents");
  log_cmd->add_option("PATH", log->path, path_help)->type_name("")->required();
  log_cmd->add_option("--limit", log->limit, "show at most N steps")->type_name("N");
  log_cmd->add_flag("--json", log->json, "a JSON array of the steps");

  CLI::App* tag_cmd = app.add_subcommand(
      "tag", "name a step (kept past retention); --delete removes a tag; PATH alone lists them");
  tag_cmd->add_option("PATH", tag->path, path_help)->type_name("")->required();
  tag_cmd->add_option("STEP_AND_NAME", tag->args, "STEP (N, step-N or a tag) and NAME")
      ->type_name("[STEP] NAME")
      ->expected(0, 2);
  tag_cmd->add_flag("--delete", tag->remove, "delete the tag NAME (of STEP, when given)");
  tag_cmd->add_flag("--replace", tag->replace, "move an existing tag NAME to STEP");
  tag_cmd->add_flag("--json", tag->json, "JSON instead of text");

  CLI::App* diff_cmd =
      app.add_subcommand("diff", "which tensors changed between two steps, and by how much");
  diff_cmd->add_option("PATH", diff->path, path_help)->type_name("")->required();
  diff_cmd->add_option("A", diff->a, "a step: N, step-N or a tag")->type_name("")->required();
  diff_cmd->add_option("B", diff->b, "another step")->type_name("")->required();
  diff_cmd->add_flag("--all", diff->all, "also list the tensors that did not change");
  diff_cmd->add_flag("--json", diff->json, "JSON instead of a table");

  CLI::App* export_cmd = app.add_subcommand(
      "export", "write a step's tensors, as full tensors, to a safetensors or torch file");
  export_cmd->add_option("PATH", exp->path, path_help)->type_name("")->required();
  export_cmd->add_option("OUT", exp->out, "the file to write")->type_name("")->required();
  CLI::Option* export_step =
      export_cmd->add_option("--step", exp->step, "the step (default: the newest)")->type_name("N");
  export_cmd->add_option("--tag", exp->tag, "the step a tag names")
      ->type_name("T")
      ->excludes(export_step);
  export_cmd->add_option("--format", exp->format, "safetensors or torch")
      ->type_name("F")
      ->required()
      ->check(CLI::IsMember({"safetensors", "torch"}));
  export_cmd
      ->add_option("--select", exp->select,
                   "only the tensors under PREFIX (e.g. model), named without it")
      ->type_name("PREFIX");
  export_cmd
      ->add_option(
          "--max-shard-size", exp->max_shard_size,
          "safetensors only: OUT is a new or empty directory of Hugging Face shards of at most "
          "SIZE (e.g. 5GB, 512MiB) each, with model.safetensors.index.json")
      ->type_name("SIZE");
  export_cmd->add_flag("--json", exp->json, "a JSON report instead of text");

  CLI::App* import_cmd = app.add_subcommand(
      "import", "turn a safetensors file or a Hugging Face model directory into a step");
  import_cmd->add_option("SRC", imp->source, "a .safetensors file or a directory of them")
      ->type_name("")
      ->required();
  import_cmd->add_option("DST", imp->destination, path_help)->type_name("")->required();
  import_cmd->add_option("--step", imp->step, "the step to commit")->type_name("N")->required();
  import_cmd
      ->add_option("--prefix", imp->prefix,
                   "the key the tensors go under in the state (default: model; '' for "
                   "the top level)")
      ->type_name("P");
  import_cmd->add_flag("--overwrite", imp->overwrite, "replace the step if it is committed");
  import_cmd->add_flag("--json", imp->json, "a JSON report instead of text");

  for (CLI::App* cmd : {log_cmd, tag_cmd, diff_cmd, export_cmd, import_cmd}) {
    cmd->group("Commands");
  }

  return [=]() -> std::optional<int> {
    if (log_cmd->parsed()) return CmdLog(*log);
    if (tag_cmd->parsed()) return CmdTag(*tag);
    if (diff_cmd->parsed()) return CmdDiff(*diff);
    if (export_cmd->parsed()) {
      std::vector<std::string> args = {"export", exp->path, exp->out, "--format", exp->format};
      if (exp->step) args.insert(args.end(), {"--step", std::to_string(*exp->step)});
      if (!exp->tag.empty()) args.insert(args.end(), {"--tag", exp->tag});
      if (!exp->select.empty()) args.insert(args.end(), {"--select", exp->select});
      if (!exp->max_shard_size.empty()) {
        Result<double> bytes = advisor::ParseBytes(exp->max_shard_size);
        if (!bytes.ok() || *bytes < 1 || *bytes > 1e18) {
          return Fail(InvalidArgument("--max-shard-size: '" + exp->max_shard_size +
                                      "' is not a size such as 5GB or 512MiB"));
        }
        args.insert(args.end(),
                    {"--max-shard-bytes", std::to_string(static_cast<uint64_t>(*bytes))});
      }
      if (exp->json) args.push_back("--json");
      return RunInterchange(args);
    }
    if (import_cmd->parsed()) {
      std::vector<std::string> args = {
          "import",   imp->source, imp->destination, "--step", std::to_string(imp->step),
          "--prefix", imp->prefix};
      if (imp->overwrite) args.push_back("--overwrite");
      if (imp->json) args.push_back("--json");
      return RunInterchange(args);
    }
    return std::nullopt;
  };
}

}  // namespace safepoint
