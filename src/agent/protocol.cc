// Framing of the agent protocol (include/safepoint/agent.h).
#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "base/bytes.h"
#include "safepoint/agent.h"

namespace safepoint {

using internal::AppendLE;
using internal::LoadLE;

std::string EncodeFrame(MessageType type, std::string_view payload) {
  std::string out;
  out.reserve(kFrameHeaderBytes + payload.size());
  AppendLE<uint32_t>(out, static_cast<uint32_t>(4 + payload.size()));
  AppendLE<uint16_t>(out, kProtocolVersion);
  AppendLE<uint16_t>(out, static_cast<uint16_t>(type));
  out.append(payload);
  return out;
}

void FrameDecoder::Feed(std::span<const std::byte> data) {
  if (pos_ > 0 && pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  }
  buf_.append(reinterpret_cast<const char*>(data.data()), data.size());
}

Result<std::optional<Message>> FrameDecoder::Next() {
  const size_t avail = buf_.size() - pos_;
  if (avail < 4) return std::optional<Message>();
  const auto* p = reinterpret_cast<const std::byte*>(buf_.data() + pos_);
  const uint32_t len = LoadLE<uint32_t>(p);
  if (len < 4 || len > kMaxMessageBytes) {
    return InvalidArgument("protocol error: frame length " + std::to_string(len) +
                           " is out of range (4.." + std::to_string(kMaxMessageBytes) + ")");
  }
  if (avail < 4 + static_cast<size_t>(len)) return std::optional<Message>();
  const uint16_t version = LoadLE<uint16_t>(p + 4);
  const uint16_t type = LoadLE<uint16_t>(p + 6);
  if (version != kProtocolVersion) {
    return InvalidArgument("protocol error: version " + std::to_string(version) +
                           ", this build speaks version " + std::to_string(kProtocolVersion));
  }
  if (type < static_cast<uint16_t>(MessageType::kHello) ||
      type > static_cast<uint16_t>(MessageType::kShutdown)) {
    return InvalidArgument("protocol error: unknown message type " + std::to_string(type));
  }
  Message m;
  m.type = static_cast<MessageType>(type);
  m.payload.assign(buf_.data() + pos_ + kFrameHeaderBytes, len - 4);
  pos_ += 4 + len;
  if (pos_ > (1u << 20) && pos_ * 2 > buf_.size()) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return std::optional<Message>(std::move(m));
}

Status SendMessage(int fd, MessageType type, std::string_view payload, double timeout_s) {
  if (payload.size() + 4 > kMaxMessageBytes) return InvalidArgument("message too large");
  const std::string frame = EncodeFrame(type, payload);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(timeout_s, 0.0));
  size_t off = 0;
  while (off < frame.size()) {
    const ssize_t n = ::send(fd, frame.data() + off, frame.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        int wait_ms = 1000;
        if (timeout_s >= 0) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
              deadline - std::chrono::steady_clock::now());
          if (left.count() <= 0) return Unavailable("the peer does not read its messages");
          wait_ms = static_cast<int>(std::min<int64_t>(left.count(), 1000));
        }
        pollfd pfd{fd, POLLOUT, 0};
        ::poll(&pfd, 1, wait_ms);
        continue;
      }
      return Unavailable(std::string("the safepoint agent connection failed: ") +
                         std::strerror(errno));
    }
    off += static_cast<size_t>(n);
  }
  return Status::OK();
}

Result<Message> ReceiveMessage(int fd, FrameDecoder& decoder, double timeout_s) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(timeout_s, 0.0));
  for (;;) {
    SP_ASSIGN_OR_RETURN(auto m, decoder.Next());
    if (m) return std::move(*m);
    int wait_ms = -1;
    if (timeout_s >= 0) {
      const auto left = deadline - std::chrono::steady_clock::now();
      wait_ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count());
      if (wait_ms <= 0) return Cancelled("timed out waiting for the safepoint agent");
    }
    pollfd pfd{fd, POLLIN, 0};
    const int rc = ::poll(&pfd, 1, wait_ms);
    if (rc < 0 && errno != EINTR) return IOError(std::string("poll: ") + std::strerror(errno));
    if (rc <= 0) continue;
    char buf[64 << 10];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return Unavailable("the safepoint agent closed the connection (did it exit?)");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Unavailable(std::string("the safepoint agent connection failed: ") +
                         std::strerror(errno));
    }
    decoder.Feed({reinterpret_cast<const std::byte*>(buf), static_cast<size_t>(n)});
  }
}

std::string AgentSocketPath(const std::string& job_dir) { return job_dir + "/agent.sock"; }
std::string AgentLockPath(const std::string& job_dir) { return job_dir + "/agent.lock"; }
std::string AgentLogPath(const std::string& job_dir) { return job_dir + "/agent.log"; }

bool AgentAlive(const std::string& job_dir, uint32_t* pid) {
  const std::string path = AgentLockPath(job_dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  bool alive = false;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    alive = errno == EWOULDBLOCK;
  } else {
    ::flock(fd, LOCK_UN);
  }
  if (alive && pid != nullptr) {
    char buf[32] = {0};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    *pid = n > 0 ? static_cast<uint32_t>(std::strtoul(buf, nullptr, 10)) : 0;
  }
  ::close(fd);
  return alive;
}

}  // namespace safepoint
