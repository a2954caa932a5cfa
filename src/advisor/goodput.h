// The goodput simulator (`safepoint simulate`, docs/guide.md "The goodput simulator").
//
// The model. Training checkpoints with period P (start of one save to the start of the next):
// P - C seconds of training, then a save that blocks training for C seconds. Failures arrive as a
// Poisson process over wall time (rate lambda = sum of the rates of the failure modes), also
// during saves and recoveries. A failure of mode k loses the work since the newest checkpoint
// the mode can restore from and costs a recovery of D_k seconds (detection + restart + restore +
// the work lost beyond the newest checkpoint when the mode restores from an older, durable one),
// which must itself run D_k seconds without a failure; a failure during a recovery starts the
// recovery of its own mode. Goodput is training time kept over wall time.
//
// Analytic: a period completes after (e^{lambda P} - 1)(1/lambda + V) seconds on average, where
// V = a / (1 - b) is the mean time from a failure to the end of its recovery,
// a = sum_k p_k (1 - e^{-lambda D_k}) / lambda and b = sum_k p_k (1 - e^{-lambda D_k}), p_k the
// share of mode k (with one mode this is Daly's e^{lambda D}(e^{lambda P} - 1)/lambda). Goodput
// = (P - C) / that. Monte-Carlo draws the same process event by event (seeded) and reports the
// goodput and its standard error; the two agree within the error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::advisor {

struct FailureMode {
  std::string name;             // "process crash", "node loss"
  double rate_per_second = 0;   // lambda_k
  double recovery_seconds = 0;  // D_k at the strategy's interval
};

// A checkpointing strategy at one interval, reduced to the model above.
struct StrategyAtInterval {
  std::string name;
  double period_seconds = 0;    // P
  double blocking_seconds = 0;  // C (< P)
  std::vector<FailureMode> modes;
};

// Expected goodput in [0, 1]; 0 when P <= C.
double AnalyticGoodput(const StrategyAtInterval& s);

struct MonteCarloResult {
  double goodput = 0;
  double standard_error = 0;  // from 32 batches of equal wall time
  uint64_t failures = 0;
  double wall_seconds = 0;
};

// Simulates `horizon_seconds` of wall time (split into 32 batches for the error), seeded.
MonteCarloResult MonteCarloGoodput(const StrategyAtInterval& s, double horizon_seconds,
                                   uint64_t seed);

// What the model takes (`safepoint simulate`, `safepoint advise`, persist_every="auto"; plan.h):
// the job's shape, its failure rate and its measured costs.
struct SimulationInputs {
  // The job's shape (a job's history records it; plan.h, InputsFromHistory).
  uint32_t gpus = 1;                // ranks of the job
  uint32_t gpus_per_node = 8;       // the job has ceil(gpus / gpus_per_node) nodes
  double mtbf_seconds = 0;          // of the whole job (any node's failure stops it)
  double node_loss_fraction = 0.2;  // of the failures, the share that loses a node's memory
  // safepoint keeps copies of each node's snapshot on other nodes (redundancy): a lost node's
  // snapshots come back from a peer. Needs at least two nodes.
  bool peer_copies = false;
  // The training time of one step without a save (0: not known): turns intervals into steps.
  double step_seconds = 0;
  // Costs, seconds (per save of the whole job; ranks save in parallel).
  double snapshot_seconds = 0;         // safepoint: blocking time of a snapshot into memory
  double persist_seconds = 0;          // writing one step to durable storage in the background
  double restart_seconds = 0;          // detecting a failure and restarting the processes
  double restore_memory_seconds = 0;   // hot reload from this node's memory
  double restore_peer_seconds = 0;     // from a peer's copy
  double restore_storage_seconds = 0;  // from durable storage
  double sync_save_seconds = 0;        // a synchronous save (default: persist_seconds)
  double dcp_blocking_seconds = 0;     // DCP async: staging to host memory (default: snapshot)
};

// A cluster described by sizes and speeds instead of measured seconds (what-if runs for another
// scale). Zero means not given.
struct ClusterSpeeds {
  double state_bytes_per_gpu = 0;
  double memory_bytes_per_second = 0;         // per GPU: the snapshot copy and a hot reload
  double storage_write_bytes_per_second = 0;  // aggregate: every GPU's state shares it
  double storage_read_bytes_per_second = 0;   // aggregate (default: the write speed)
  double network_bytes_per_second = 0;        // per node: a lost node's state from its peers
};

// Sets the costs that the speeds determine: snapshot = restore from memory = state / memory
// speed; persist = restore from storage = gpus x state / storage speed (read speed for the
// restore); restore from a peer = gpus per node x state / network speed. Costs whose speed is
// not given are left as they are.
void DeriveCosts(const ClusterSpeeds& speeds, SimulationInputs* in);

// Parses a byte count or a rate in bytes per second: a number with an optional K, M, G, T
// (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024), and an optional trailing B or B/s
// ("16GiB", "25G", "1.5TB/s").
Result<double> ParseBytes(const std::string& text);

uint32_t Nodes(const SimulationInputs& in);  // ceil(gpus / gpus_per_node)

// Fills the defaults of costs not given (0): a synchronous save = the persist time; DCP's
// staging = the snapshot time; a restore from memory = the snapshot time (a reload copies the
// same bytes back); from storage = the persist time (reading back costs about what writing
// did); from a peer = the restore from storage. Checks: InvalidArgument naming the value
// otherwise (also peer copies on a job of one node: a node has no peer).
Result<SimulationInputs> CompleteInputs(SimulationInputs in);

// How many snapshots apart storage takes them when it takes them as often as it can: a persist
// of `persist_seconds` every `period_seconds`: ceil(persist / period), at least 1. A persist
// costs training nothing (the agent writes in the background), so persisting as often as storage
// accepts steps is what the model finds best (a node loss without peers loses the work since the
// newest persisted step); persist_every="auto" follows it.
uint64_t PersistEverySaves(double persist_seconds, double period_seconds);

// The three strategies at checkpoint period `period_seconds`:
//  "safepoint": blocking = snapshot; a process crash restores from memory; a node loss from a
//    peer's copy (peer_copies) or else from storage, which holds every m-th snapshot
//    (m = PersistEverySaves(persist, P)) and lags the newest by (m - 1) P / 2 + persist on
//    average;
//  "sync": blocking = a synchronous save; every failure restores from storage;
//  "dcp-async": blocking = staging, plus waiting for the previous upload when the period is
//    shorter than it; every failure restores from storage, which lags by the upload time.
std::vector<StrategyAtInterval> Strategies(const SimulationInputs& in, double period_seconds);

// The period in [lo, hi] that maximizes AnalyticGoodput of strategy `index` of Strategies()
// (golden-section search on log(period)).
double OptimalPeriod(const SimulationInputs& in, size_t index, double lo, double hi);

}  // namespace safepoint::advisor
