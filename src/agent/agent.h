// The node agent (safepointd): how safepointd and `safepoint agent` (apps/) start one.
//
// One agent per node and job owns the job's snapshots in shared memory: it persists COMPLETE
// snapshots to the storage tier with the commit protocol, commits steps, prunes by retention,
// flushes the newest snapshot of a training process that dies (emergency flush), and keeps the
// snapshots for hot reload. Training processes talk to it over a Unix domain socket in the job
// directory (src/protocol/protocol.h); bulk data never goes through the socket. Only processes
// of the same user are accepted (SO_PEERCRED). A malformed or oversized message closes that
// connection, never the agent.
#pragma once

#include <cstdint>
#include <string>

namespace safepoint {

struct AgentOptions {
  std::string job;
  std::string shm_dir = "/dev/shm";
  bool emergency_flush = true;
  // Exit once every rank that connected has closed cleanly (on-demand agents). A sidecar started
  // with `safepoint agent` keeps running until SIGTERM.
  bool exit_when_idle = true;
  // An on-demand agent with no client and no pending work also exits after this many seconds,
  // keeping the snapshots in shared memory (a restarted process starts a new agent, which adopts
  // them). 0: never.
  double idle_exit_seconds = 60;
  // The log level (trace, debug, info, warn, error, critical, off); empty: $SAFEPOINT_LOG_LEVEL,
  // else info. The log is the agent's stderr (agent.log in the job directory when started on
  // demand).
  std::string log_level;
  // Serve Prometheus metrics on "HOST:PORT" (port 0: a free one) from the start; empty: only
  // once a training process asks for it (Checkpointer(metrics=...), $SAFEPOINT_METRICS_ADDR).
  std::string metrics_address;
  // The JSON-lines event log; empty: events.jsonl in the job directory, unless a training
  // process names another (Checkpointer(event_log=...), $SAFEPOINT_EVENT_LOG).
  std::string event_log;
};

// Runs the agent in this process until it is told to stop (SIGTERM, SIGINT, a shutdown message,
// or every rank closed when exit_when_idle). Returns the process exit status: 0 on a clean exit,
// 3 when another agent already serves the job, 1 on an error (printed to stderr).
int RunAgent(const AgentOptions& options);

}  // namespace safepoint
