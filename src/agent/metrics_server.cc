// The agent's HTTP endpoint for Prometheus (src/agent/metrics_server.h).
#include "agent/metrics_server.h"

#include <httplib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

#include "agent/metrics.h"
#include "base/host_port.h"

namespace safepoint::agent {

Status ParseListenAddress(const std::string& address, std::string* host, int* port) {
  Result<internal::HostPort> hp = internal::ParseHostPort(address);
  if (!hp.ok())
    return InvalidArgument("metrics " + hp.status().message() +
                           "; :PORT listens on every interface, port 0 picks a free one");
  *host = hp->host.empty() ? "0.0.0.0" : hp->host;
  *port = hp->port;
  return Status::OK();
}

MetricsServer::MetricsServer() = default;

MetricsServer::~MetricsServer() { Stop(); }

Status MetricsServer::Start(const std::string& address, const MetricsRegistry* registry) {
  Stop();
  std::string host;
  int port = 0;
  SP_RETURN_IF_ERROR(ParseListenAddress(address, &host, &port));
  auto server = std::make_unique<httplib::Server>();
  server->new_task_queue = [] { return new httplib::ThreadPool(2); };
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would let a second agent
  // bind the same port and the kernel split the scrapes between two jobs.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server->set_keep_alive_timeout(5);
  server->set_read_timeout(std::chrono::seconds(5));
  server->set_write_timeout(std::chrono::seconds(5));
  server->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("safepoint agent: metrics at /metrics\n", "text/plain; charset=utf-8");
  });
  errno = 0;
  int bound = port;
  if (port == 0) {
    bound = server->bind_to_any_port(host);
    if (bound < 0) bound = 0;
  } else if (!server->bind_to_port(host, port)) {
    bound = 0;
  }
  if (bound <= 0) {
    const int err = errno;
    return Unavailable("metrics address " + address + ": cannot listen on " + host + ":" +
                       std::to_string(port) +
                       (err ? std::string(" (") + std::strerror(err) + ")"
                            : std::string(" (in use or no such host)")));
  }
  server_ = std::move(server);
  thread_ = std::thread([s = server_.get()] { s->listen_after_bind(); });
  // stop() before the listen loop runs would be lost: wait until it runs.
  for (int i = 0; i < 2000 && !server_->is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::string url_host = host;
  if (host == "0.0.0.0" || host == "::") {
    char name[HOST_NAME_MAX + 1] = {};
    url_host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
  }
  address_ = address;
  url_ = "http://" + internal::FormatHostPort(url_host, static_cast<uint16_t>(bound)) + "/metrics";
  return Status::OK();
}

void MetricsServer::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
  server_.reset();
  url_.clear();
  address_.clear();
}

}  // namespace safepoint::agent
