#include "base/host_port.h"

#include <gtest/gtest.h>

#include "testing/test_util.h"

namespace safepoint::internal::host_port_test {
namespace {

TEST(HostPortTest, ParsesEveryForm) {
  const struct {
    const char* text;
    const char* host;
    uint16_t port;
  } cases[] = {{"10.0.0.7:9400", "10.0.0.7", 9400},
               {"node-3.cluster:65535", "node-3.cluster", 65535},
               {"[fe80::1]:80", "fe80::1", 80},
               {":0", "", 0}};
  for (const auto& c : cases) {
    Result<HostPort> r = ParseHostPort(c.text);
    ASSERT_OK(r.status());
    EXPECT_EQ(r->host, c.host) << c.text;
    EXPECT_EQ(r->port, c.port) << c.text;
  }
}

TEST(HostPortTest, RejectsWhatIsNotHostPortNamingTheText) {
  for (const char* bad :
       {"", "9400", "host:", "host:x", "host:65536", "host:-1", "host:+1", "host: 1", "host:1 ",
        "::1:80", "[]:80", "[::1:80", "a]:80", "host:99999999999999999999"}) {
    Result<HostPort> r = ParseHostPort(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("'" + std::string(bad) + "'"), std::string::npos)
        << r.status().message();
  }
}

TEST(HostPortTest, FormatIsReadBack) {
  EXPECT_EQ(FormatHostPort("10.0.0.7", 9400), "10.0.0.7:9400");
  EXPECT_EQ(FormatHostPort("::1", 80), "[::1]:80");
  for (const char* host : {"10.0.0.7", "::1", "node-3"}) {
    Result<HostPort> r = ParseHostPort(FormatHostPort(host, 1234));
    ASSERT_OK(r.status());
    EXPECT_EQ(r->host, host);
    EXPECT_EQ(r->port, 1234);
  }
}

}  // namespace
}  // namespace safepoint::internal::host_port_test
