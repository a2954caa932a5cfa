// The agent's HTTP endpoint for Prometheus (src/agent/metrics_server.h).
#include "agent/metrics_server.h"

#include <httplib.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstring>

#include "agent/metrics.h"

namespace safepoint::agent {

Status ParseListenAddress(const std::string& address, std::string* host, int* port) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("metrics address '" + address + "': " + why +
                           " (expected HOST:PORT, [IPV6]:PORT or :PORT; port 0 picks a free one)");
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  std::string h = address.substr(0, colon);
  const std::string p = address.substr(colon + 1);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
  } else if (h.find(':') != std::string::npos) {
    return bad("an IPv6 host must be in brackets");
  }
  int n = -1;
  const auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), n);
  if (p.empty() || ec != std::errc() || ptr != p.data() + p.size() || n < 0 || n > 65535) {
    return bad("the port is not a number in [0, 65535]");
  }
  *host = h.empty() ? "0.0.0.0" : h;
  *port = n;
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
  if (url_host.find(':') != std::string::npos) url_host = "[" + url_host + "]";
  address_ = address;
  url_ = "http://" + url_host + ":" + std::to_string(bound) + "/metrics";
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
