// scale_driver: K ranks of one simulated node, as threads, driving the real client library
// (bench/scale.py runs one per node; docs/benchmarks.md, "Scale"). No torch: what it measures is
// the agents' and the storage's side of saves, commits and restores, not the Python layer.
//
//   scale_driver save    --storage URI --job JOB --shm-dir DIR --agent SAFEPOINTD
//                        --world W --rank-base B --ranks K --steps S --bytes N --keep KEEP
//                        [--peers DIR --node-index I --nodes N]
//   scale_driver restore --storage URI --world W --rank-base B --ranks K
//   scale_driver restore ... --step S   (every rank loads step S: a lookup shared by the job)
//   scale_driver restore ... --record FILE  (every rank loads the step of the COMMIT record the
//                                            job's lookup read: newest --record-out FILE)
//   scale_driver newest  --storage URI [--record-out FILE]   (the job's one lookup of the newest
//                                            committed step; its COMMIT record's bytes to FILE)
//   scale_driver commits --storage URI
//
// save: each rank connects a SnapshotClient (the agent of DIR started on demand, as a training
// process starts it) and saves steps 1..S of a state of one float32 tensor of N bytes whose
// contents depend on (rank, step), each save persisted. The ranks save step s together (a
// pool of threads over the ranks, step by step, as a training loop would), then every rank
// waits for the last step to commit (SnapshotClient::Wait). The agent's status (its
// storage_requests: the node's requests) is read once every wait returned, then every client
// closes cleanly. Prints one JSON object.
//
// With --peers (several nodes), the nodes' agents get the membership the Python layer gives them
// at every Checkpointer start (safepoint/_replication.py, join_commit_relay), so that they commit
// over the commit relay: each node's first rank asks its agent for its peer service address and
// writes it to DIR/addr-I; once every node's is there, it gives the agent the membership
// (redundancy none) and writes DIR/ready-I; the saves start once every node is ready (the
// Python layer's barrier).
//
// restore: each rank loads its shard of the newest committed step through LoadShard (what
// safepoint.load calls for one rank's shard), one rank after another so that the storage
// requests of each (this process's counters, include/safepoint/storage.h) are exact, and checks
// the contents. With --record, the step of the COMMIT record the job's one lookup read (newest
// --record-out), each rank loading its image against that record without reading the COMMIT
// object (LoadShard with a record). Prints one JSON object: per-rank requests and the sum.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "agent/status.h"
#include "safepoint/checkpoint.h"
#include "safepoint/client.h"
#include "safepoint/extras.h"
#include "safepoint/replication.h"
#include "safepoint/storage.h"

namespace {

using json = nlohmann::json;
using namespace safepoint;

struct Args {
  std::string mode, storage, job, shm_dir = "/dev/shm", agent, event_log, peers;
  std::string record, record_out;  // restore --record, newest --record-out
  uint32_t world = 1, rank_base = 0, ranks = 1, steps = 3, keep = 2, threads = 0;
  uint32_t node_index = 0, nodes = 1;
  uint64_t bytes = 1 << 20;
  int64_t step = -1;  // restore: the step to load (-1: each rank finds the newest itself)
  double timeout_s = 600;
};

[[noreturn]] void Die(const std::string& what) {
  std::cerr << "scale_driver: " << what << "\n";
  std::exit(1);
}

Args Parse(int argc, char** argv) {
  Args a;
  if (argc < 2) Die("usage: scale_driver save|restore --storage URI ...");
  a.mode = argv[1];
  for (int i = 2; i < argc; i += 2) {
    if (i + 1 >= argc) Die(std::string("missing the value of ") + argv[i]);
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--storage")
      a.storage = v;
    else if (k == "--job")
      a.job = v;
    else if (k == "--shm-dir")
      a.shm_dir = v;
    else if (k == "--agent")
      a.agent = v;
    else if (k == "--event-log")
      a.event_log = v;
    else if (k == "--world")
      a.world = std::stoul(v);
    else if (k == "--rank-base")
      a.rank_base = std::stoul(v);
    else if (k == "--ranks")
      a.ranks = std::stoul(v);
    else if (k == "--steps")
      a.steps = std::stoul(v);
    else if (k == "--keep")
      a.keep = std::stoul(v);
    else if (k == "--bytes")
      a.bytes = std::stoull(v);
    else if (k == "--threads")
      a.threads = std::stoul(v);
    else if (k == "--timeout")
      a.timeout_s = std::stod(v);
    else if (k == "--step")
      a.step = std::stoll(v);
    else if (k == "--peers")
      a.peers = v;
    else if (k == "--record")
      a.record = v;
    else if (k == "--record-out")
      a.record_out = v;
    else if (k == "--node-index")
      a.node_index = std::stoul(v);
    else if (k == "--nodes")
      a.nodes = std::stoul(v);
    else
      Die("unknown option " + k);
  }
  if (a.storage.empty()) Die("--storage is required");
  if (a.mode == "commits" || a.mode == "newest") return a;
  if (a.ranks == 0 || a.rank_base + a.ranks > a.world) Die("ranks outside the world");
  if (a.bytes < 4 || a.bytes % 4 != 0) Die("--bytes must be a positive multiple of 4");
  return a;
}

// The state of `rank` at `step`: float32 words derived from both, so that every step's image
// differs and a restore can check it read its own rank's newest step.
void Fill(std::vector<float>& v, uint32_t rank, uint64_t step) {
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<float>((rank * 131 + step * 7 + i) % 1000003);
  }
}

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Runs fn(i) for i in [0, n) on `threads` threads.
template <typename F>
void ParallelFor(uint32_t n, uint32_t threads, F fn) {
  std::atomic<uint32_t> next{0};
  std::vector<std::thread> pool;
  for (uint32_t t = 0; t < std::min(threads, n); ++t) {
    pool.emplace_back([&] {
      for (uint32_t i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  }
  for (auto& t : pool) t.join();
}

json Counts(const StorageRequestCounts& c) { return agent::StorageRequestCountsJson(c); }

StorageRequestCounts Total() {
  StorageRequestCounts t;
  for (const auto& [scheme, c] : StorageRequestCountsByScheme()) {
    t.list += c.list, t.head += c.head, t.get += c.get, t.create += c.create;
    t.write += c.write, t.put += c.put, t.del += c.del, t.cleanup += c.cleanup;
    t.metadata_bytes += c.metadata_bytes, t.data_bytes_read += c.data_bytes_read;
    t.data_bytes_written += c.data_bytes_written;
  }
  return t;
}

StorageRequestCounts Minus(const StorageRequestCounts& a, const StorageRequestCounts& b) {
  StorageRequestCounts d;
  d.list = a.list - b.list, d.head = a.head - b.head, d.get = a.get - b.get;
  d.create = a.create - b.create, d.write = a.write - b.write, d.put = a.put - b.put;
  d.del = a.del - b.del, d.cleanup = a.cleanup - b.cleanup;
  d.metadata_bytes = a.metadata_bytes - b.metadata_bytes;
  d.data_bytes_read = a.data_bytes_read - b.data_bytes_read;
  d.data_bytes_written = a.data_bytes_written - b.data_bytes_written;
  return d;
}

// Writes `text` to `path` at once (a temporary, then a rename).
void Publish(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) Die("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) Die("cannot rename " + tmp);
}

// Waits until DIR/<prefix>-0 .. -(nodes-1) exist; returns their contents.
std::vector<std::string> AwaitAll(const Args& a, const std::string& prefix) {
  std::vector<std::string> out(a.nodes);
  const double deadline = Now() + a.timeout_s;
  for (uint32_t i = 0; i < a.nodes; ++i) {
    const std::string path = a.peers + "/" + prefix + "-" + std::to_string(i);
    for (;;) {
      std::ifstream f(path);
      if (f) {
        std::getline(f, out[i]);
        break;
      }
      if (Now() > deadline) Die("node " + std::to_string(i) + " never wrote " + path);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return out;
}

// The membership the Python layer gives the agents for the commit relay (see the top).
void JoinRelay(const Args& a, SnapshotClient& client) {
  const std::string node = "node" + std::to_string(a.node_index);
  auto address = client.PeerSetup(node, "127.0.0.1", 30);
  if (!address.ok()) Die("peer setup: " + address.status().ToString());
  Publish(a.peers + "/addr-" + std::to_string(a.node_index), *address);
  std::vector<PeerNode> nodes;
  const std::vector<std::string> addresses = AwaitAll(a, "addr");
  for (uint32_t i = 0; i < a.nodes; ++i)
    nodes.push_back({"node" + std::to_string(i), addresses[i]});
  // A fixed secret: the bench's agents listen on the loopback only.
  Status s = client.SetMembership(
      Membership{"scale", a.node_index, nodes, "none", std::string(64, '5'), 0});
  if (!s.ok()) Die("membership: " + s.ToString());
  Publish(a.peers + "/ready-" + std::to_string(a.node_index), "ready");
  AwaitAll(a, "ready");
}

int Save(const Args& a) {
  const uint32_t threads = a.threads ? a.threads : std::min<uint32_t>(a.ranks, 16);
  std::vector<std::unique_ptr<SnapshotClient>> clients(a.ranks);
  std::vector<std::vector<float>> state(a.ranks, std::vector<float>(a.bytes / 4));
  std::mutex mu;
  std::string error;
  auto fail = [&](uint32_t i, const std::string& what, const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.empty()) {
      error = "rank " + std::to_string(a.rank_base + i) + ": " + what + ": " + s.ToString();
    }
  };
  const double t0 = Now();
  ParallelFor(a.ranks, threads, [&](uint32_t i) {
    ClientOptions o;
    o.storage = a.storage;
    o.job = a.job;
    o.shm_dir = a.shm_dir;
    o.rank = a.rank_base + i;
    o.world_size = a.world;
    o.keep = a.keep;
    o.agent_binary = a.agent;
    o.event_log = a.event_log;  // outside the job directory, which the agent removes at exit
    o.agent_start_timeout_s = 120;
    o.copy_threads = 1;
    o.attempt = 1;  // one save attempt shared by every rank of the run
    auto c = SnapshotClient::Connect(o);
    if (!c.ok()) return fail(i, "connect", c.status());
    clients[i] = std::move(*c);
  });
  if (!error.empty()) Die(error);
  if (!a.peers.empty() && a.nodes > 1) JoinRelay(a, *clients[0]);
  const double connected = Now();
  std::vector<double> step_saved(a.steps + 1, 0);  // when the last rank's save of step s returned
  for (uint64_t step = 1; step <= a.steps; ++step) {
    ParallelFor(a.ranks, threads, [&](uint32_t i) {
      Fill(state[i], a.rank_base + i, step);
      TensorSource t;
      t.spec.name = "w";
      t.spec.dtype = DType::kFloat32;
      t.spec.shape = {state[i].size()};
      t.data = state[i].data();
      t.nbytes = a.bytes;
      std::vector<TensorSource> tensors;
      tensors.push_back(std::move(t));
      auto extras = EncodeExtras(Value(static_cast<int64_t>(step)));
      if (!extras.ok()) return fail(i, "extras", extras.status());
      auto r = clients[i]->Save(step, std::move(tensors), *extras, /*persist=*/true);
      if (!r.ok()) return fail(i, "save of step " + std::to_string(step), r.status());
      if (!r->agent_error.empty()) fail(i, "notify", InvalidArgument(r->agent_error));
    });
    if (!error.empty()) Die(error);
    step_saved[step] = Now();
  }
  ParallelFor(a.ranks, threads, [&](uint32_t i) {
    Status s = clients[i]->Wait(a.timeout_s);
    if (!s.ok()) fail(i, "wait", s);
  });
  if (!error.empty()) Die(error);
  const double waited = Now();
  auto status = clients[0]->AgentStatus();
  if (!status.ok()) Die("agent status: " + status.status().ToString());
  ParallelFor(a.ranks, threads, [&](uint32_t i) {
    Status s = clients[i]->Close(a.timeout_s);
    if (!s.ok()) fail(i, "close", s);
    clients[i].reset();
  });
  if (!error.empty()) Die(error);
  json out = {{"mode", "save"},
              {"rank_base", a.rank_base},
              {"ranks", a.ranks},
              {"world", a.world},
              {"steps", a.steps},
              {"bytes", a.bytes},
              {"start", t0},
              {"connected", connected},
              {"last_step_saved", step_saved[a.steps]},
              {"waited", waited},
              {"closed", Now()},
              {"agent_status", json::parse(*status)},
              {"process_requests", Counts(Total())}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int Restore(const Args& a) {
  auto store = OpenCheckpointStore(a.storage);
  if (!store.ok()) Die("open " + a.storage + ": " + store.status().ToString());
  json per_rank = json::array();
  StorageRequestCounts sum;
  std::vector<float> want(a.bytes / 4);
  std::map<uint64_t, uint32_t> steps;
  // --record: the COMMIT record the job's lookup read, handed to every rank (a collective's
  // bytes in a real job; a file here, read outside the counted storage). Each rank decodes it,
  // which checks its CRC, and loads its image against it.
  std::optional<CommitRecord> handed;
  if (!a.record.empty()) {
    std::ifstream f(a.record, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (!f && !f.eof()) Die("cannot read " + a.record);
    auto record =
        DecodeCommitRecord(std::as_bytes(std::span(bytes.data(), bytes.size())), a.record);
    if (!record.ok()) Die("the handed COMMIT record: " + record.status().ToString());
    handed = std::move(record).value();
  }
  const double t0 = Now();
  double slowest = 0;
  for (uint32_t i = 0; i < a.ranks; ++i) {
    const uint32_t rank = a.rank_base + i;
    const StorageRequestCounts before = Total();
    const double r0 = Now();
    // Each rank opens the checkpoint directory itself, as a restarted process does.
    auto own = OpenCheckpointStore(a.storage);
    if (!own.ok()) Die("open " + a.storage + ": " + own.status().ToString());
    auto shard =
        handed ? LoadShard(**own, *handed, rank)
               : LoadShard(**own,
                           a.step < 0 ? std::nullopt
                                      : std::optional<uint64_t>(static_cast<uint64_t>(a.step)),
                           rank);
    if (!shard.ok()) Die("rank " + std::to_string(rank) + ": load: " + shard.status().ToString());
    const double seconds = Now() - r0;
    const StorageRequestCounts d = Minus(Total(), before);
    slowest = std::max(slowest, seconds);
    const auto& tensors = shard->reader.tensors();
    if (tensors.size() != 1 || tensors[0].nbytes != a.bytes) {
      Die("rank " + std::to_string(rank) + ": the image holds another state");
    }
    want.resize(a.bytes / 4);
    Fill(want, rank, shard->commit.step);
    if (std::memcmp(shard->reader.tensor_data(0).data(), want.data(), a.bytes) != 0) {
      Die("rank " + std::to_string(rank) + ": step " + std::to_string(shard->commit.step) +
          " holds other bytes than that step's save");
    }
    const auto* saved_step = std::get_if<int64_t>(&shard->extras.v);
    if (saved_step == nullptr || static_cast<uint64_t>(*saved_step) != shard->commit.step) {
      Die("rank " + std::to_string(rank) + ": the extras are not the step's");
    }
    ++steps[shard->commit.step];
    sum.list += d.list, sum.head += d.head, sum.get += d.get, sum.create += d.create;
    sum.write += d.write, sum.put += d.put, sum.del += d.del, sum.cleanup += d.cleanup;
    sum.metadata_bytes += d.metadata_bytes, sum.data_bytes_read += d.data_bytes_read;
    sum.data_bytes_written += d.data_bytes_written;
    json r = Counts(d);
    r["rank"] = rank;
    r["step"] = shard->commit.step;
    r["seconds"] = seconds;
    per_rank.push_back(std::move(r));
  }
  json step_counts = json::object();
  for (const auto& [s, n] : steps) step_counts[std::to_string(s)] = n;
  json out = {{"mode", "restore"},    {"rank_base", a.rank_base}, {"ranks", a.ranks},
              {"world", a.world},     {"seconds", Now() - t0},    {"slowest_rank_seconds", slowest},
              {"steps", step_counts}, {"total", Counts(sum)},     {"per_rank", per_rank}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// What one process (a job's first rank) asks of storage to find the newest committed step with
// the library's primitives (StepsWithCommit: one List; NewestCommitted: one COMMIT read where
// the newest is intact): the lookup a job makes once and shares with its ranks, which then load
// that step (restore --step).
int Newest(const Args& a) {
  const StorageRequestCounts before = Total();
  const double t0 = Now();
  auto store = OpenCheckpointStore(a.storage);
  if (!store.ok()) Die("open " + a.storage + ": " + store.status().ToString());
  auto steps = (*store)->StepsWithCommit();
  if (!steps.ok()) Die("list: " + steps.status().ToString());
  auto newest = (*store)->NewestCommitted(*steps);
  if (!newest.ok()) Die("newest: " + newest.status().ToString());
  if (!*newest) Die("no committed step");
  const double seconds = Now() - t0;
  if (!a.record_out.empty()) Publish(a.record_out, EncodeCommitRecord(**newest));
  std::cout << json{{"mode", "newest"},
                    {"step", (*newest)->step},
                    {"seconds", seconds},
                    {"total", Counts(Minus(Total(), before))}}
                   .dump()
            << std::endl;
  return 0;
}

// The committed steps with their records' commit times (CheckpointStore::ListCommitted), for
// the harness's timing; not part of any measured request count.
int Commits(const Args& a) {
  auto store = OpenCheckpointStore(a.storage);
  if (!store.ok()) Die("open " + a.storage + ": " + store.status().ToString());
  auto records = (*store)->ListCommitted();
  if (!records.ok()) Die("list: " + records.status().ToString());
  json out = json::array();
  for (const auto& r : *records) {
    out.push_back({{"step", r.step},
                   {"world_size", r.world_size},
                   {"commit_time_ns", r.commit_time_ns},
                   {"generation", r.generation},
                   {"bytes", r.total_bytes()}});
  }
  std::cout << json{{"mode", "commits"}, {"commits", out}}.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Thousands of ranks per node: each client holds a socket and its slot files. The agent it
  // starts inherits the raised limit.
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
  }
  const Args a = Parse(argc, argv);
  if (a.mode == "save") return Save(a);
  if (a.mode == "restore") return Restore(a);
  if (a.mode == "commits") return Commits(a);
  if (a.mode == "newest") return Newest(a);
  Die("unknown mode " + a.mode + " (save or restore)");
}
