// MetricsServer: serves the agent's metrics over HTTP for Prometheus (docs/operations.md,
// "Metrics").
//
// GET /metrics answers the registry's text exposition (Content-Type text/plain; version=0.0.4);
// GET / a one-line pointer to it; anything else 404. The server is cpp-httplib (Debian
// libcpp-httplib-dev) listening on its own thread with a small pool of handler threads; handlers
// only read the registry (src/agent/metrics.h), never the agent's state.
//
// Addresses: "HOST:PORT", "[V6HOST]:PORT" or ":PORT" (every interface); port 0 picks a free
// port, which url() then names.
//
// Threads: Start and Stop from one thread (the agent's loop); url() from that thread too.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "safepoint/status.h"

namespace httplib {
class Server;
}

namespace safepoint::agent {

class MetricsRegistry;

// Splits "HOST:PORT" ("[::1]:PORT", ":PORT": host "0.0.0.0") with internal::ParseHostPort
// (src/base/host_port.h). InvalidArgument naming `address`.
Status ParseListenAddress(const std::string& address, std::string* host, int* port);

class MetricsServer {
 public:
  MetricsServer();
  ~MetricsServer();  // Stop()
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Listens on `address` and serves `registry` (which must outlive the server). Unavailable when
  // the address cannot be bound (in use, no such interface), naming the address and the cause.
  Status Start(const std::string& address, const MetricsRegistry* registry);
  void Stop();
  bool running() const { return thread_.joinable(); }
  const std::string& address() const { return address_; }  // as asked
  // "http://HOST:PORT/metrics" with the port actually bound (the host name for 0.0.0.0 / ::).
  const std::string& url() const { return url_; }

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string address_, url_;
};

}  // namespace safepoint::agent
