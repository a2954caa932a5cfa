// The agent's HTTP endpoint for Prometheus (src/agent/metrics_server.h), against a real client.
#include "agent/metrics_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include "agent/metrics.h"
#include "testing/test_util.h"

namespace safepoint::agent::metrics_server_test {
namespace {

TEST(ListenAddressTest, ParsesHostPortForms) {
  std::string host;
  int port = -1;
  ASSERT_OK(ParseListenAddress("127.0.0.1:9400", &host, &port));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 9400);
  ASSERT_OK(ParseListenAddress(":0", &host, &port));
  EXPECT_EQ(host, "0.0.0.0");
  EXPECT_EQ(port, 0);
  ASSERT_OK(ParseListenAddress("[::1]:80", &host, &port));
  EXPECT_EQ(host, "::1");
  for (const char* bad : {"9400", "host:", "host:x", "host:65536", "::1:80", "h:-1"}) {
    Status s = ParseListenAddress(bad, &host, &port);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s.message();
  }
}

TEST(MetricsServerTest, ServesTheRegistryOnAFreePort) {
  MetricsRegistry registry(Labels{{"safepoint_job", "j"}});
  ASSERT_TRUE(registry.Declare("safepoint_saves_total", MetricType::kCounter, "Saves."));
  registry.Add("safepoint_saves_total", {{"rank", "0"}}, 2);
  MetricsServer server;
  ASSERT_OK(server.Start("127.0.0.1:0", &registry));
  ASSERT_TRUE(server.running());
  const std::string prefix = "http://127.0.0.1:";
  ASSERT_EQ(server.url().rfind(prefix, 0), 0u) << server.url();
  const int port = std::stoi(server.url().substr(prefix.size()));
  EXPECT_GT(port, 0);

  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_NE(res->body.find("safepoint_saves_total{safepoint_job=\"j\",rank=\"0\"} 2\n"),
            std::string::npos)
      << res->body;
  // Updates show in the next scrape.
  registry.Add("safepoint_saves_total", {{"rank", "0"}});
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("} 3\n"), std::string::npos) << res->body;
  res = client.Get("/nothing");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);

  // A second server cannot take the same port: a clear error naming the address.
  MetricsServer second;
  const std::string same = "127.0.0.1:" + std::to_string(port);
  Status s = second.Start(same, &registry);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find(same), std::string::npos) << s.message();
  EXPECT_FALSE(second.running());

  server.Stop();
  EXPECT_FALSE(server.running());
  EXPECT_FALSE(client.Get("/metrics"));  // nothing listens any more
}

}  // namespace
}  // namespace safepoint::agent::metrics_server_test
