// The node agent (safepointd) and the control protocol between training processes and it.
//
// One agent per node and job owns the job's snapshots in shared memory: it persists COMPLETE
// snapshots to the storage tier with the commit protocol, commits steps, prunes by retention,
// flushes the newest snapshot of a training process that dies (emergency flush), and keeps the
// snapshots for hot reload. Training processes talk to it over a Unix domain socket in the job
// directory: versioned, length-prefixed messages (docs/architecture.md, "Agent protocol"); bulk
// data never goes through the socket. Only processes of the same user are accepted
// (SO_PEERCRED). A malformed or oversized message closes that connection, never the agent.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "safepoint/status.h"

namespace safepoint {

inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxMessageBytes = 1 << 20;
inline constexpr size_t kFrameHeaderBytes = 8;  // u32 length, u16 version, u16 type

enum class MessageType : uint16_t {
  kHello = 1,       // client -> agent: who I am, where the job persists
  kHelloReply = 2,
  kSnapshot = 3,    // client -> agent: slot s holds a COMPLETE snapshot of step n
  kStatus = 4,      // client -> agent
  kStatusReply = 5,
  kWait = 6,        // client -> agent: reply once the given step is committed (or failed)
  kWaitReply = 7,
  kClose = 8,       // client -> agent: clean close of a rank
  kCloseReply = 9,
  kError = 10,      // agent -> client: the request was refused
  kShutdown = 11,   // CLI -> agent: flush and exit
};

struct Message {
  MessageType type = MessageType::kError;
  std::string payload;  // a JSON object
};

// Encodes one frame: u32 length of the rest, u16 version, u16 type, payload.
std::string EncodeFrame(MessageType type, std::string_view payload);

// Splits a byte stream into messages; validates every frame header.
class FrameDecoder {
 public:
  void Feed(std::span<const std::byte> data);
  // The next complete message, nullopt when more bytes are needed, or a Corruption /
  // InvalidArgument error for a malformed frame (wrong version, unknown type, oversized).
  Result<std::optional<Message>> Next();
  size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::string buf_;
  size_t pos_ = 0;
};

// Blocking helpers for a connected socket. `timeout_s` < 0 waits forever.
Status SendMessage(int fd, MessageType type, std::string_view payload, double timeout_s = -1);
Result<Message> ReceiveMessage(int fd, FrameDecoder& decoder, double timeout_s);

// Paths inside a job directory.
std::string AgentSocketPath(const std::string& job_dir);
std::string AgentLockPath(const std::string& job_dir);
std::string AgentLogPath(const std::string& job_dir);

// True when an agent holds the job directory's lock (a live agent).
bool AgentAlive(const std::string& job_dir, uint32_t* pid = nullptr);

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
};

// Runs the agent in this process until it is told to stop (SIGTERM, SIGINT, a shutdown message,
// or every rank closed when exit_when_idle). Returns the process exit status: 0 on a clean exit,
// 3 when another agent already serves the job, 1 on an error (printed to stderr).
int RunAgent(const AgentOptions& options);

}  // namespace safepoint
