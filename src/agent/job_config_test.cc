// job.json: a job's configuration, with its storage tiers, as a later agent reads it back.
#include "agent/job_config.h"

#include <gtest/gtest.h>

#include "protocol/protocol.h"
#include "testing/test_util.h"

namespace safepoint::agent::job_config_test {
namespace {

using protocol::HelloRequest;
using protocol::JobConfigPath;
using test::TempDir;

TEST(JobConfigTest, TiersRoundTrip) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  JobConfig config{"/nvme/run1",
                   8,
                   2,
                   {{"file:///shared/run1", 100, 0, 5}, {"s3://bucket/run1", 500, 3600.5, 20}}};
  ASSERT_OK(WriteJobConfig(dir.path(), config));
  ASSERT_OK_AND_ASSIGN(auto read, ReadJobConfig(dir.path()));
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(*read, config);
  // A job without tiers writes none and reads back none (job.json of earlier versions too).
  JobConfig plain{"/nvme/run2", 1, 3, {}};
  ASSERT_OK(WriteJobConfig(dir.path(), plain));
  const auto text = test::ReadFileToString(JobConfigPath(dir.path()));
  ASSERT_TRUE(text.has_value());
  EXPECT_EQ(text->find("tiers"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(read, ReadJobConfig(dir.path()));
  EXPECT_EQ(*read, plain);
}

TEST(JobConfigTest, TiersThatDoNotParseAreCorruptionNamingTheFile) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = JobConfigPath(dir.path());
  for (const char* tiers : {R"("x")", R"([{"uri": "/a", "every": 1, "keep": 1}])",
                            R"([{"uri": 7, "every": 1, "every_seconds": 0, "keep": 1}])",
                            R"([{"uri": "/a", "every": -1, "every_seconds": 0, "keep": 1}])"}) {
    ASSERT_TRUE(test::WriteStringToFile(
        path,
        std::string(R"({"storage": "/p", "world_size": 1, "keep": 1, "tiers": )") + tiers + "}"));
    auto read = ReadJobConfig(dir.path());
    ASSERT_FALSE(read.ok()) << tiers;
    EXPECT_EQ(read.status().code(), StatusCode::kCorruption) << tiers;
    EXPECT_NE(read.status().message().find(path), std::string::npos) << read.status().ToString();
    EXPECT_NE(read.status().message().find("tiers"), std::string::npos) << read.status().ToString();
  }
}

TEST(HelloTiersTest, TiersTravelInTheHelloAndBadOnesAreProtocolErrors) {
  HelloRequest hello;
  hello.storage = "/p";
  hello.tiers = {{"s3://b/run", 10, 0, 4}};
  HelloRequest back;
  ASSERT_OK(Decode(Encode(hello), &back));
  EXPECT_EQ(back.tiers, hello.tiers);
  HelloRequest none;
  ASSERT_OK(Decode(Encode(HelloRequest{}), &none));
  EXPECT_TRUE(none.tiers.empty());
  const std::string bad =
      R"({"rank": 0, "world_size": 1, "storage": "/p", "keep": 1, "tiers": [{"uri": "/a"}]})";
  Status s = Decode(bad, &back);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("every"), std::string::npos) << s.ToString();
}

TEST(JobConfigTest, LayoutsOfPathAndTiersRoundTripAndTravelInTheHello) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  JobConfig config{"/nvme/run1", 1,   2, {{"file:///shared/run1", 100, 0, 5, "zstd", true}},
                   "auto",       true};
  ASSERT_OK(WriteJobConfig(dir.path(), config));
  ASSERT_OK_AND_ASSIGN(auto read, ReadJobConfig(dir.path()));
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(*read, config);
  HelloRequest hello;
  hello.storage = "/p";
  hello.compression = "planes";
  hello.incremental = true;
  hello.tiers = {{"s3://b/run", 10, 0, 4, "auto", true}};
  HelloRequest back;
  ASSERT_OK(Decode(Encode(hello), &back));
  EXPECT_EQ(back.tiers, hello.tiers);
  EXPECT_EQ(back.compression, "planes");
  EXPECT_TRUE(back.incremental);
  // A hello or job.json of a version without layouts: the plain layout.
  ASSERT_OK(Decode(R"({"rank": 0, "world_size": 1, "storage": "/p", "keep": 1})", &back));
  EXPECT_EQ(back.compression, "none");
  EXPECT_FALSE(back.incremental);
  EXPECT_FALSE(ValidateTiers("/p", std::vector<TierSpec>{{"/t", 0, 0, 1, "gzip", false}}).ok());
}

}  // namespace
}  // namespace safepoint::agent::job_config_test
