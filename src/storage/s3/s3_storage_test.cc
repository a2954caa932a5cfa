// Tests of the s3:// backend beyond the conformance suite: SigV4 against AWS's published example,
// configuration lookup, URI options, and, against a real RADOS Gateway (SAFEPOINT_TEST_S3_URI,
// skipped when unset), exclusive publish, wrong credentials, multipart leftovers, and a gateway
// that stalls (SIGSTOP) or is killed and restarted mid-download. The fault tests start a private
// radosgw of their own on the test cluster (SAFEPOINT_TEST_CEPH_DIR) so that stopping it never
// disturbs other tests that share the cluster's gateway.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/extras.h"
#include "safepoint/storage.h"
#include "storage/cancellable.h"
#include "storage/s3/s3_client.h"
#include "testing/test_util.h"

namespace safepoint::s3_storage_test {
namespace {

using test::PatternBytes;
using test::TempDir;

// Sets environment variables for the test's lifetime (each gtest case runs in its own process
// under ctest, but restoring keeps `safepoint_tests` runs of several cases correct too).
class ScopedEnv {
 public:
  void Set(const char* name, const std::string& value) {
    Save(name);
    setenv(name, value.c_str(), 1);
  }
  void Unset(const char* name) {
    Save(name);
    unsetenv(name);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second.has_value) {
        setenv(it->first.c_str(), it->second.value.c_str(), 1);
      } else {
        unsetenv(it->first.c_str());
      }
    }
  }

 private:
  struct Old {
    bool has_value;
    std::string value;
  };
  void Save(const char* name) {
    const char* v = std::getenv(name);
    saved_.emplace_back(name, Old{v != nullptr, v ? v : ""});
  }
  std::vector<std::pair<std::string, Old>> saved_;
};

void ClearAwsEnv(ScopedEnv& env) {
  for (const char* v :
       {"AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
        "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "SAFEPOINT_STORAGE_TIMEOUT"}) {
    env.Unset(v);
  }
}

// Credentials that sign requests to `endpoint` (no server needs to accept them).
void UseTestCredentials(ScopedEnv& env, const std::string& endpoint) {
  ClearAwsEnv(env);
  env.Set("AWS_ENDPOINT_URL", endpoint);
  env.Set("AWS_ACCESS_KEY_ID", "k");
  env.Set("AWS_SECRET_ACCESS_KEY", "s");
}

// A loopback port that nobody listens on (bound, read back and closed); 0 when none was bound.
int FreeLoopbackPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                     getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  return bound ? ntohs(a.sin_port) : 0;
}

// Whether `s` is an error of `code` whose message mentions each of `mentions`.
::testing::AssertionResult IsError(const Status& s, StatusCode code,
                                   std::initializer_list<std::string_view> mentions) {
  if (s.code() != code) return ::testing::AssertionFailure() << "wrong code: " << s.ToString();
  for (std::string_view m : mentions) {
    if (s.message().find(m) == std::string::npos) {
      return ::testing::AssertionFailure() << "\"" << m << "\" not in: " << s.ToString();
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- without a server ---------------------------------------------------------------------------

TEST(S3SigV4Test, MatchesAwsPublishedGetObjectExample) {
  // "Example: GET Object" of the AWS S3 API reference (Signature Version 4, header auth).
  s3::S3Config c;
  c.region = "us-east-1";
  c.access_key = "AKIAIOSFODNN7EXAMPLE";
  c.secret_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
  const std::string empty_hash = s3::Sha256Hex({});
  EXPECT_EQ(empty_hash, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const std::string auth = s3::SigV4Authorization(c, "GET", "/test.txt", "",
                                                  {{"Host", "examplebucket.s3.amazonaws.com"},
                                                   {"Range", "bytes=0-9"},
                                                   {"x-amz-content-sha256", empty_hash},
                                                   {"x-amz-date", "20130524T000000Z"}},
                                                  empty_hash, "20130524T000000Z");
  EXPECT_EQ(auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(S3SigV4Test, UriEncodingKeepsUnreservedAndSlashes) {
  EXPECT_EQ(s3::UriEncode("a b/c~d_e.f-g+h=", true), "a%20b/c~d_e.f-g%2Bh%3D");
  EXPECT_EQ(s3::UriEncode("a/b", false), "a%2Fb");
}

TEST(S3ClientTest, AddressingFollowsTheEndpoint) {
  s3::S3Config aws;
  aws.region = "eu-west-1";
  EXPECT_EQ(s3::S3Client(aws, "ckpt").Url("run 1/step-1/COMMIT", "uploadId=x"),
            "https://ckpt.s3.eu-west-1.amazonaws.com/run%201/step-1/COMMIT?uploadId=x");
  EXPECT_EQ(s3::S3Client(aws, "my.ckpt").Url("k", ""),
            "https://s3.eu-west-1.amazonaws.com/my.ckpt/k");
  s3::S3Config rgw = aws;
  rgw.endpoint = "http://127.0.0.1:7480";
  rgw.path_style = true;
  EXPECT_EQ(s3::S3Client(rgw, "ckpt").Url("a/b", ""), "http://127.0.0.1:7480/ckpt/a/b");
}

TEST(S3XmlTest, ElementsAndEntities) {
  const std::string xml =
      "<R><Contents><Key>a&amp;b&lt;c&#x41;&#66;</Key><Size>3</Size></Contents>"
      "<Contents><Key>d</Key></Contents><IsTruncated>false</IsTruncated></R>";
  auto contents = s3::XmlElements(xml, "Contents");
  ASSERT_EQ(contents.size(), 2u);
  EXPECT_EQ(s3::XmlText(contents[0], "Key"), "a&b<cAB");
  EXPECT_EQ(s3::XmlText(contents[1], "Key"), "d");
  EXPECT_EQ(s3::XmlText(xml, "IsTruncated"), "false");
  EXPECT_EQ(s3::XmlText(xml, "Missing"), "");
  EXPECT_EQ(s3::ParseIso8601Ns("2013-05-24T00:00:01.500Z"), 1369353601500000000);
}

TEST(S3ConfigTest, EnvironmentWinsThenCredentialsFileThenConfigFile) {
  ScopedEnv env;
  ClearAwsEnv(env);
  TempDir dir;
  const std::string creds = dir.path() + "/credentials";
  const std::string config = dir.path() + "/config";
  std::ofstream(creds) << "[default]\naws_access_key_id = DEFAULTKEY\naws_secret_access_key = d\n"
                          "[dev]\naws_access_key_id=DEVKEY\naws_secret_access_key=devsecret\n"
                          "aws_session_token = devtoken\n";
  std::ofstream(config)
      << "[default]\nregion = eu-west-1\n"
         "[profile dev]\nregion = eu-north-1\nendpoint_url = http://10.0.0.1:7480/\n"
         "s3 =\n  addressing_style = path\n";
  env.Set("AWS_SHARED_CREDENTIALS_FILE", creds);
  env.Set("AWS_CONFIG_FILE", config);

  auto c = s3::ResolveS3Config();
  ASSERT_OK(c);
  EXPECT_EQ(c->access_key, "DEFAULTKEY");
  EXPECT_EQ(c->region, "eu-west-1");
  EXPECT_EQ(c->endpoint, "");
  EXPECT_FALSE(c->path_style);  // AWS itself: virtual-host addressing

  env.Set("AWS_PROFILE", "dev");
  c = s3::ResolveS3Config();
  ASSERT_OK(c);
  EXPECT_EQ(c->access_key, "DEVKEY");
  EXPECT_EQ(c->secret_key, "devsecret");
  EXPECT_EQ(c->session_token, "devtoken");
  EXPECT_EQ(c->region, "eu-north-1");
  EXPECT_EQ(c->endpoint, "http://10.0.0.1:7480");
  EXPECT_TRUE(c->path_style);

  env.Set("AWS_ACCESS_KEY_ID", "ENVKEY");
  env.Set("AWS_SECRET_ACCESS_KEY", "envsecret");
  env.Set("AWS_REGION", "ap-south-1");
  env.Set("AWS_ENDPOINT_URL", "https://minio.example:9000");
  env.Set("SAFEPOINT_STORAGE_TIMEOUT", "7.5");
  c = s3::ResolveS3Config();
  ASSERT_OK(c);
  EXPECT_EQ(c->access_key, "ENVKEY");
  EXPECT_EQ(c->session_token, "");  // not mixed with the profile's
  EXPECT_EQ(c->region, "ap-south-1");
  EXPECT_EQ(c->endpoint, "https://minio.example:9000");
  EXPECT_EQ(c->timeout_s, 7.5);
  env.Set("AWS_ENDPOINT_URL_S3", "http://s3only:1");
  c = s3::ResolveS3Config();
  ASSERT_OK(c);
  EXPECT_EQ(c->endpoint, "http://s3only:1");
}

TEST(S3ConfigTest, MissingCredentialsOrRegionNameWhatIsMissing) {
  ScopedEnv env;
  ClearAwsEnv(env);
  TempDir dir;
  env.Set("HOME", dir.path());  // no ~/.aws
  env.Set("AWS_REGION", "us-east-1");
  auto c = s3::ResolveS3Config();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("AWS_ACCESS_KEY_ID"), std::string::npos)
      << c.status().ToString();
  EXPECT_NE(c.status().message().find(dir.path() + "/.aws/credentials"), std::string::npos)
      << c.status().ToString();

  env.Unset("AWS_REGION");
  env.Set("AWS_ACCESS_KEY_ID", "k");
  env.Set("AWS_SECRET_ACCESS_KEY", "s");
  c = s3::ResolveS3Config();
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("AWS_REGION"), std::string::npos) << c.status().ToString();
  // An endpoint (RGW, MinIO) without a region signs for us-east-1, as the SDKs do.
  env.Set("AWS_ENDPOINT_URL", "http://127.0.0.1:1");
  c = s3::ResolveS3Config();
  ASSERT_OK(c);
  EXPECT_EQ(c->region, "us-east-1");

  auto opened = OpenStorage("s3://bucket/prefix");
  ASSERT_OK(opened);
  env.Unset("AWS_ACCESS_KEY_ID");
  opened = OpenStorage("s3://bucket/prefix");
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("s3://bucket/prefix"), std::string::npos);
  EXPECT_NE(opened.status().message().find("no credentials"), std::string::npos);
}

TEST(S3UriTest, OptionsAreParsedAndUnknownOnesRejected) {
  ScopedEnv env;
  UseTestCredentials(env, "http://127.0.0.1:1");
  auto s = OpenStorage("s3://bucket/a/b/?timeout=2.5&retries=0&part_size=8M&connections=3");
  ASSERT_OK(s);
  EXPECT_EQ((*s)->uri(), "s3://bucket/a/b");
  EXPECT_EQ((*s)->Describe("step-1/x"), "s3://bucket/a/b/step-1/x");
  auto root = OpenStorage("s3://bucket");
  ASSERT_OK(root);
  EXPECT_EQ((*root)->Describe("x"), "s3://bucket/x");
  for (const char* bad :
       {"s3://bucket/p?color=red", "s3://bucket/p?part_size=1M", "s3://bucket/p?timeout=0",
        "s3://bucket/p?retries=x", "s3:///prefix", "s3://bucket/a/../b",
        "s3://bucket/p?part_size=6G", "s3://bucket/p?part_size=16X", "s3://bucket/p?retries=101",
        "s3://bucket/p?connections=0", "s3://bucket/p?connections=+4",
        "s3://bucket/p?connections=4x"}) {
    auto r = OpenStorage(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
}

TEST(S3UriTest, ConnectionRefusedIsUnavailableAfterTheRetries) {
  ScopedEnv env;
  const int port = FreeLoopbackPort();
  ASSERT_NE(port, 0);
  UseTestCredentials(env, "http://127.0.0.1:" + std::to_string(port));
  auto s = OpenStorage("s3://bucket/p?retries=2&timeout=5");
  ASSERT_OK(s);
  auto r = (*s)->Open("obj");
  ASSERT_FALSE(r.ok());
  // Names the object and the server that could not be reached.
  EXPECT_TRUE(IsError(r.status(), StatusCode::kUnavailable,
                      {"s3://bucket/p/obj", "after 3 attempts",
                       "(endpoint http://127.0.0.1:" + std::to_string(port) + ")"}));
}

// A loopback HTTP server that answers the i-th connection with responses[i] and closes it: for
// the client's retry policy, which a real gateway cannot be made to exercise on demand (the S3
// semantics themselves are tested against radosgw below). Requests must have no body. An empty
// response stalls: the connection is held open, unanswered, until the server is destroyed.
class CannedHttpServer {
 public:
  explicit CannedHttpServer(std::vector<std::string> responses) : responses_(std::move(responses)) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      return;
    }
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~CannedHttpServer() {
    stop_ = true;              // ends a stall
    shutdown(fd_, SHUT_RDWR);  // wakes accept()
    if (thread_.joinable()) thread_.join();
    close(fd_);
  }

  // 0 when the server could not listen.
  int port() const { return port_; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return requests_.load(); }

 private:
  void Serve() {
    for (const std::string& response : responses_) {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::string request;
      char buf[4096];
      while (request.find("\r\n\r\n") == std::string::npos) {
        const ssize_t n = read(c, buf, sizeof(buf));
        if (n <= 0) break;
        request.append(buf, static_cast<size_t>(n));
      }
      ++requests_;
      while (response.empty() && !stop_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      for (size_t sent = 0; sent < response.size();) {
        const ssize_t n = write(c, response.data() + sent, response.size() - sent);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
      }
      close(c);
    }
  }

  const std::vector<std::string> responses_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> requests_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::string HeadAnswer(const std::string& status_line, const std::string& headers = "") {
  return "HTTP/1.1 " + status_line + "\r\n" + headers + "Connection: close\r\n\r\n";
}

// The S3 storage at `uri` served by `server`, with test credentials set in `env` (which must
// outlive it).
void OpenOnServer(const CannedHttpServer& server, ScopedEnv& env, const std::string& uri,
                  std::unique_ptr<Storage>* storage) {
  ASSERT_NE(server.port(), 0);
  UseTestCredentials(env, server.endpoint());
  auto s = OpenStorage(uri);
  ASSERT_OK(s);
  *storage = std::move(*s);
}

// A request to a gateway that stalls ends as soon as its storage's requests are cancelled (the
// agent's tier shutdown after its grace period), without waiting out its timeout or retrying;
// later requests fail at once without being sent.
TEST(S3ClientTest, CancellingEndsAStalledRequestAtOnceAndFailsLaterOnes) {
  CannedHttpServer server({""});
  ScopedEnv env;
  std::unique_ptr<Storage> s;
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=4&timeout=600", &s));
  Status stalled;
  std::thread request([&] { stalled = s->Open("obj").status(); });
  while (server.requests() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  internal::CancelStorageRequests(*s);
  request.join();
  EXPECT_TRUE(IsError(stalled, StatusCode::kCancelled, {"s3://bucket/p/obj", "cancelled"}))
      << stalled.ToString();
  EXPECT_EQ(server.requests(), 1);
  EXPECT_EQ(s->Open("obj").status().code(), StatusCode::kCancelled);
  EXPECT_EQ(server.requests(), 1);
}

TEST(S3ClientTest, ServerErrorsAndThrottlingAreRetriedUntilAnAnswerComes) {
  CannedHttpServer server({HeadAnswer("503 Slow Down", "Content-Length: 0\r\n"),
                           HeadAnswer("500 Internal Server Error", "Content-Length: 0\r\n"),
                           HeadAnswer("429 Too Many Requests", "Content-Length: 0\r\n"),
                           HeadAnswer("200 OK", "Content-Length: 1234\r\nETag: \"e1\"\r\n")});
  ScopedEnv env;
  std::unique_ptr<Storage> s;
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=3&timeout=5", &s));
  auto r = s->Open("obj");
  ASSERT_OK(r);
  EXPECT_EQ((*r)->size(), 1234u);
  EXPECT_EQ(server.requests(), 4);
}

// A trace file that cannot be opened is said once (the requests go on, untraced).
TEST(S3ClientTest, ATraceFileThatCannotBeOpenedIsWarnedAbout) {
  TempDir dir;
  const std::string trace = dir.path() + "/no-such-dir/s3.trace";
  CannedHttpServer server({HeadAnswer("200 OK", "Content-Length: 7\r\nETag: \"e1\"\r\n")});
  ScopedEnv env;
  env.Set("SAFEPOINT_S3_TRACE", trace);
  std::unique_ptr<Storage> s;
  // The library's log (spdlog's default logger: stdout here; the agent's goes to its log).
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=3&timeout=5", &s));
  const std::string err =
      testing::internal::GetCapturedStderr() + testing::internal::GetCapturedStdout();
  ASSERT_OK(s->Open("obj"));
  EXPECT_NE(
      err.find("SAFEPOINT_S3_TRACE=" + trace + ": cannot open it (No such file or directory)"),
      std::string::npos)
      << err;
}

// With SAFEPOINT_S3_TRACE set, every attempt (a retried one too) is one line of the trace: the
// method, the status, the connection (a new one each time here: the server closes it) and the
// object's key; without it, nothing is written.
TEST(S3ClientTest, TheRequestTraceHasOneLinePerAttemptOnlyWhenAskedFor) {
  TempDir dir;
  const std::string trace = dir.path() + "/s3.trace";
  {
    CannedHttpServer server({HeadAnswer("503 Slow Down", "Content-Length: 0\r\n"),
                             HeadAnswer("200 OK", "Content-Length: 7\r\nETag: \"e1\"\r\n")});
    ScopedEnv env;
    env.Set("SAFEPOINT_S3_TRACE", trace);
    std::unique_ptr<Storage> s;
    ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=3&timeout=5", &s));
    ASSERT_OK(s->Open("obj"));
  }
  std::ifstream in(trace);
  std::vector<std::vector<std::string>> lines;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    for (size_t b = 0, e; b <= line.size(); b = e + 1) {
      e = std::min(line.find('\t', b), line.size());
      fields.push_back(line.substr(b, e - b));
    }
    lines.push_back(std::move(fields));
  }
  ASSERT_EQ(lines.size(), 2u);
  const std::vector<std::string> statuses = {"503", "200"};
  for (size_t i = 0; i < lines.size(); ++i) {
    ASSERT_EQ(lines[i].size(), 14u);
    EXPECT_LE(std::stoll(lines[i][0]), std::stoll(lines[i][1]));  // start <= end
    EXPECT_EQ(lines[i][3], "HEAD");
    EXPECT_EQ(lines[i][4], statuses[i]);
    EXPECT_EQ(lines[i][7], "1");  // the server closed the previous connection: a new one
    EXPECT_NE(lines[i][8], "0");  // its local port
    EXPECT_EQ(lines[i][12], "p/obj");
    EXPECT_EQ(lines[i][13], "-");  // no Range header
  }

  // Unset: the same request adds no line.
  CannedHttpServer server({HeadAnswer("200 OK", "Content-Length: 7\r\nETag: \"e1\"\r\n")});
  ScopedEnv env;
  env.Unset("SAFEPOINT_S3_TRACE");
  std::unique_ptr<Storage> s;
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=3&timeout=5", &s));
  ASSERT_OK(s->Open("obj"));
  std::ifstream again(trace);
  size_t count = 0;
  for (std::string line; std::getline(again, line);) ++count;
  EXPECT_EQ(count, 2u);
}

TEST(S3ClientTest, ServerErrorsPastTheRetriesAreUnavailable) {
  CannedHttpServer server({HeadAnswer("500 Internal Server Error", "Content-Length: 0\r\n"),
                           HeadAnswer("503 Service Unavailable", "Content-Length: 0\r\n")});
  ScopedEnv env;
  std::unique_ptr<Storage> s;
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=1&timeout=5", &s));
  auto r = s->Open("obj");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsError(
      r.status(), StatusCode::kUnavailable,
      {"s3://bucket/p/obj", "HTTP 503", "after 2 attempts", "endpoint " + server.endpoint()}));
  EXPECT_EQ(server.requests(), 2);
}

TEST(S3ClientTest, TruncatedListingsWithoutAContinuationAreErrors) {
  // A server that says "more follows" but not where: no silent stop after the first page.
  auto truncated = [](const std::string& root) {
    const std::string body = "<" + root + "><IsTruncated>true</IsTruncated></" + root + ">";
    return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n\r\n" + body;
  };
  CannedHttpServer server({truncated("ListBucketResult"), truncated("ListMultipartUploadsResult")});
  ScopedEnv env;
  std::unique_ptr<Storage> s;
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=0&timeout=5", &s));
  EXPECT_TRUE(IsError(s->List("").status(), StatusCode::kIOError,
                      {"ListObjectsV2 s3://bucket/p/", "truncated"}));
  EXPECT_TRUE(IsError(s->RemoveLeftovers("").status(), StatusCode::kIOError,
                      {"ListMultipartUploads s3://bucket/p/", "truncated"}));
}

// Issue 35: credentials typed into a URI were taken as part of the bucket name, and the secret
// was shown wherever the URI is (errors, `safepoint status`, job.json, agent.log, the event
// log). Refused by OpenStorage for every scheme, saying how to pass them, without showing them.
TEST(S3UriTest, CredentialsInAStorageUriAreRefusedWithoutShowingThem) {
  ScopedEnv env;
  UseTestCredentials(env, "http://127.0.0.1:1");
  for (const std::string uri :
       {"s3://AKIAKEYID:TopSecretValue@bucket/run1", "s3://TopSecretValue@bucket/run1?retries=0",
        "S3://AKIAKEYID:TopSecretValue@bucket", "rados://admin:TopSecretValue@pool/run1",
        "file://u:TopSecretValue@localhost/tmp/run1", "mem://u:TopSecretValue@name"}) {
    SCOPED_TRACE(uri);
    auto s = OpenStorage(uri);
    ASSERT_FALSE(s.ok()) << (*s)->uri();
    const std::string m = s.status().ToString();
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << m;
    EXPECT_EQ(m.find("TopSecretValue"), std::string::npos) << m;
    EXPECT_EQ(m.find("AKIAKEYID"), std::string::npos) << m;
    EXPECT_NE(m.find("credentials"), std::string::npos) << m;
    if (uri.starts_with("s3") || uri.starts_with("S3")) {
      EXPECT_NE(m.find("AWS_SECRET_ACCESS_KEY"), std::string::npos) << m;
    }
  }
  // An '@' after the bucket is part of the object prefix, not user information.
  auto at = OpenStorage("s3://bucket/run@1");
  ASSERT_OK(at);
  EXPECT_EQ((*at)->uri(), "s3://bucket/run@1");
}

// An S3 error's <Code> and <Message> came verbatim into the error (and from there into logs,
// the status and the event log): a hostile or broken endpoint could send megabytes, terminal
// escapes or forged log lines. Bounded and made printable now.
TEST(S3ClientTest, AnErrorsCodeAndMessageAreShownBoundedAndPrintable) {
  const std::string body = "<Error><Code>AccessDenied\x1b[2J" + std::string(5000, 'C') +
                           "</Code><Message>" +
                           "no\n[2026-01-01 00:00:00] [info] forged line\x1b]0;t\x07" +
                           std::string(100000, 'M') + "</Message></Error>";
  const std::string answer =
      "HTTP/1.1 403 Forbidden\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n\r\n" + body;
  CannedHttpServer server({answer});
  ScopedEnv env;
  std::unique_ptr<Storage> s;
  ASSERT_NO_FATAL_FAILURE(OpenOnServer(server, env, "s3://bucket/p?retries=0&timeout=5", &s));
  const Status st = s->List("").status();
  ASSERT_FALSE(st.ok());
  const std::string m = st.ToString();
  EXPECT_NE(m.find("HTTP 403 AccessDenied"), std::string::npos) << m.substr(0, 500);
  EXPECT_NE(m.find("permission denied"), std::string::npos) << m.substr(0, 500);
  EXPECT_LT(m.size(), 1500u);
  for (char c : m) {
    EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << int(static_cast<unsigned char>(c));
    if (!(c >= 0x20 && c < 0x7f)) break;
  }
}

// ---- against a real gateway ---------------------------------------------------------------------

// The URI of a fresh prefix under $SAFEPOINT_TEST_S3_URI, unique to the test.
std::string TestUri(const TempDir& dir) {
  std::string leaf = dir.path();
  std::replace(leaf.begin(), leaf.end(), '/', '_');
  std::string base = std::getenv("SAFEPOINT_TEST_S3_URI");
  while (base.ends_with('/')) base.pop_back();
  return base + "/" + leaf.substr(leaf.find_first_not_of('_'));
}

#define SKIP_WITHOUT_S3()                                                                     \
  if (std::getenv("SAFEPOINT_TEST_S3_URI") == nullptr) {                                      \
    GTEST_SKIP() << "$SAFEPOINT_TEST_S3_URI is not set (scripts/with-ceph.sh sets it with a " \
                    "test Ceph cluster)";                                                     \
  }

// For the tests that run radosgw or radosgw-admin on the test cluster themselves.
#define SKIP_WITHOUT_S3_CEPH_DIR()                                                        \
  SKIP_WITHOUT_S3();                                                                      \
  if (std::getenv("SAFEPOINT_TEST_CEPH_DIR") == nullptr) {                                \
    GTEST_SKIP() << "$SAFEPOINT_TEST_CEPH_DIR is not set (scripts/with-ceph.sh sets it)"; \
  }

// A client on the bucket of `uri` ("s3://bucket/prefix") and the prefix's key root.
std::pair<std::unique_ptr<s3::S3Client>, std::string> RawClient(const std::string& uri) {
  std::string rest = uri.substr(5);
  const size_t slash = rest.find('/');
  auto config = s3::ResolveS3Config();
  EXPECT_OK(config);
  return {std::make_unique<s3::S3Client>(*config, rest.substr(0, slash)),
          slash == std::string::npos ? "" : rest.substr(slash + 1) + "/"};
}

// Upload ids of the multipart uploads in progress under `root`.
std::vector<std::string> PendingUploads(s3::S3Client& client, const std::string& root) {
  s3::S3Request req;
  req.query = {{"uploads", ""}, {"prefix", root}};
  auto r = client.Execute(req, "ListMultipartUploads");
  EXPECT_OK(r);
  std::vector<std::string> ids;
  if (!r.ok()) return ids;
  EXPECT_EQ(r->http_status, 200) << r->body;
  for (auto u : s3::XmlElements(r->body, "Upload")) ids.push_back(s3::XmlText(u, "UploadId"));
  return ids;
}

// The bucket under a prefix of this test's own, opened with 5 MiB parts so that a few MiB make
// a multipart upload. Skips without $SAFEPOINT_TEST_S3_URI.
class S3MultipartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_S3();
    auto s = OpenStorage(TestUri(dir_) + "?part_size=5M");
    ASSERT_OK(s);
    storage_ = std::move(*s);
  }

  TempDir dir_;
  std::unique_ptr<Storage> storage_;
};

TEST_F(S3MultipartTest, PublishIfAbsentRefusesAnExistingObject) {
  Storage& st = *storage_;
  auto first = st.Create("step-1/COMMIT", 0);
  ASSERT_OK(first);
  ASSERT_OK((*first)->WriteAt(0, PatternBytes(100, 1)));
  ASSERT_OK((*first)->PublishIfAbsent());
  auto second = st.Create("step-1/COMMIT", 0);
  ASSERT_OK(second);
  ASSERT_OK((*second)->WriteAt(0, PatternBytes(50, 2)));
  EXPECT_TRUE(IsError((*second)->PublishIfAbsent(), StatusCode::kAlreadyExists,
                      {st.Describe("step-1/COMMIT")}));
  EXPECT_EQ(test::ReadWholeObject(st, "step-1/COMMIT"), PatternBytes(100, 1));

  // A multipart object (12 MiB in 5 MiB parts) is refused too, and its upload is aborted.
  auto big = st.Create("step-1/COMMIT", 12 << 20);
  ASSERT_OK(big);
  ASSERT_OK((*big)->WriteAt(0, PatternBytes(12 << 20, 3)));
  EXPECT_EQ((*big)->PublishIfAbsent().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(test::ReadWholeObject(st, "step-1/COMMIT"), PatternBytes(100, 1));
  auto [client, root] = RawClient(st.uri());
  EXPECT_TRUE(PendingUploads(*client, root).empty());

  // Racing exclusive publishers of a new name: exactly one wins.
  constexpr int kRacers = 6;
  std::vector<std::unique_ptr<WritableObject>> writers;
  for (int i = 0; i < kRacers; ++i) {
    auto w = st.Create("step-2/COMMIT", 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(64, 10 + i)));
    writers.push_back(std::move(*w));
  }
  std::atomic<int> won{0}, refused{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kRacers; ++i) {
    threads.emplace_back([&, i] {
      Status p = writers[i]->PublishIfAbsent();
      if (p.ok()) ++won;
      if (p.code() == StatusCode::kAlreadyExists) ++refused;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(won.load(), 1);
  EXPECT_EQ(refused.load(), kRacers - 1);
}

TEST(S3StorageTest, MissingBucketIsNotFoundNamingTheBucket) {
  SKIP_WITHOUT_S3();
  const std::string uri = "s3://sp-no-such-bucket-" + std::to_string(getpid()) + "/run";
  auto s = OpenStorage(uri);
  ASSERT_OK(s);
  auto list = (*s)->List("");
  ASSERT_FALSE(list.ok());
  EXPECT_TRUE(IsError(list.status(), StatusCode::kNotFound, {uri, "NoSuchBucket"}));
  EXPECT_TRUE(IsError(test::PutObject(**s, "step-1/COMMIT", PatternBytes(10, 1)),
                      StatusCode::kNotFound, {uri + "/step-1/COMMIT", "NoSuchBucket"}));
  EXPECT_EQ((*s)->Open("step-1/COMMIT").status().code(), StatusCode::kNotFound);
}

TEST(S3StorageTest, WrongSecretIsPermissionDeniedWithoutRetries) {
  SKIP_WITHOUT_S3();
  ScopedEnv env;
  env.Set("AWS_SECRET_ACCESS_KEY", std::string(40, '0'));
  TempDir dir;
  auto s = OpenStorage(TestUri(dir));
  ASSERT_OK(s);
  auto r = (*s)->Open("obj");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(
      IsError(r.status(), StatusCode::kIOError, {"permission denied", "AWS_SECRET_ACCESS_KEY"}));
  auto list = (*s)->List("");
  ASSERT_FALSE(list.ok());
  EXPECT_NE(list.status().message().find("SignatureDoesNotMatch"), std::string::npos)
      << list.status().ToString();
  EXPECT_EQ(list.status().message().find("attempts"), std::string::npos)
      << list.status().ToString();
  EXPECT_FALSE(test::PutObject(**s, "obj", PatternBytes(10, 1)).ok());
}

TEST_F(S3MultipartTest, AbortedUploadsLeaveNothingAndLeftoversOfGoneWritersAreAborted) {
  Storage& st = *storage_;
  auto [client, root] = RawClient(st.uri());

  // An aborted multipart upload: no object, no upload left.
  {
    auto w = st.Create("step-1/aborted.img", 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(11 << 20, 1)));  // two complete parts: uploading
    (*w)->Abort();
  }
  EXPECT_TRUE(PendingUploads(*client, root).empty());
  EXPECT_EQ(st.Open("step-1/aborted.img").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(st.List("")->empty());

  // The upload of a writer that crashed (started by hand here: no WritableObject owns it).
  s3::S3Request create;
  create.method = "POST";
  create.key = root + "step-1/crashed.img";
  create.query = {{"uploads", ""}};
  auto created = client->Execute(create, "CreateMultipartUpload");
  ASSERT_OK(created);
  ASSERT_EQ(created->http_status, 200) << created->body;
  const std::string crashed = s3::XmlText(created->body, "UploadId");
  ASSERT_FALSE(crashed.empty());

  // A live writer of this process with an upload in progress.
  auto live = st.Create("step-2/live.img", 0);
  ASSERT_OK(live);
  ASSERT_OK((*live)->WriteAt(0, PatternBytes(6 << 20, 2)));
  // Its upload starts in the background; wait until the server lists it (a poll, not a timing).
  for (int i = 0; i < 600 && PendingUploads(*client, root).size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(PendingUploads(*client, root).size(), 2u);

  // A filter that spares step-1 removes nothing; the live writer is never touched.
  auto removed =
      st.RemoveLeftovers("", [](std::string_view name) { return name.starts_with("step-2/"); });
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 0u);
  removed = st.RemoveLeftovers("");
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 1u);
  auto pending = PendingUploads(*client, root);
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_NE(pending[0], crashed);
  ASSERT_OK((*live)->Publish());
  EXPECT_TRUE(PendingUploads(*client, root).empty());
  EXPECT_EQ(test::ReadWholeObject(st, "step-2/live.img"), PatternBytes(6 << 20, 2));
}

TEST_F(S3MultipartTest, SparseObjectsReadZerosInTheirGapsAfterPartBuffersWereReused) {
  Storage& st = *storage_;
  // A multipart object first: its part buffers (full of 0x.. pattern bytes) go back for reuse.
  ASSERT_OK(test::PutObject(st, "dense", PatternBytes(20 << 20, 1)));
  // A small sparse object (one PUT) and a large one (multipart): the gaps read as zeros.
  for (uint64_t size : {uint64_t{100000}, uint64_t{(13 << 20) + 7}}) {
    SCOPED_TRACE(size);
    const std::string name = "sparse-" + std::to_string(size);
    auto w = st.Create(name, 0);
    ASSERT_OK(w);
    const std::vector<std::byte> tail = PatternBytes(100, 2);
    ASSERT_OK((*w)->WriteAt(10, PatternBytes(10, 3)));
    ASSERT_OK((*w)->WriteAt(size - 100, tail));
    ASSERT_OK((*w)->Publish());
    std::vector<std::byte> back = test::ReadWholeObject(st, name);
    ASSERT_EQ(back.size(), size);
    EXPECT_TRUE(std::all_of(back.begin(), back.begin() + 10,
                            [](std::byte b) { return b == std::byte{0}; }));
    EXPECT_TRUE(std::equal(back.begin() + 10, back.begin() + 20, PatternBytes(10, 3).begin()));
    EXPECT_TRUE(std::all_of(back.begin() + 20, back.end() - 100,
                            [](std::byte b) { return b == std::byte{0}; }));
    EXPECT_TRUE(std::equal(tail.begin(), tail.end(), back.end() - 100));
  }
}

TEST_F(S3MultipartTest, WholePartsWrittenFromSeveralThreadsBesideBufferedOnesMakeOneObject) {
  // Parts 1-3 are each written whole by a thread of its own (uploaded from the caller's bytes),
  // part 0 in two halves and the short last part buffered, as a persist and a sparse writer do.
  Storage& st = *storage_;
  constexpr uint64_t kPart = 5 << 20;
  const uint64_t size = 4 * kPart + 12345;
  const std::vector<std::byte> want = PatternBytes(size, 7);
  auto w = st.Create("mixed", size);
  ASSERT_OK(w);
  WritableObject& out = **w;
  const std::span<const std::byte> all(want);
  ASSERT_OK(out.WriteAt(0, all.subspan(0, kPart / 2)));
  std::vector<std::thread> writers;
  std::vector<Status> got(3);
  for (uint64_t i = 1; i <= 3; ++i) {
    writers.emplace_back(
        [&, i] { got[i - 1] = out.WriteAt(i * kPart, all.subspan(i * kPart, kPart)); });
  }
  for (auto& t : writers) t.join();
  for (const Status& s : got) ASSERT_OK(s);
  ASSERT_OK(out.WriteAt(kPart / 2, all.subspan(kPart / 2, kPart - kPart / 2)));
  ASSERT_OK(out.WriteAt(4 * kPart, all.subspan(4 * kPart)));
  // A whole part written again is refused: it was uploaded already.
  EXPECT_EQ(out.WriteAt(2 * kPart, all.subspan(2 * kPart, kPart)).code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK(out.Publish());
  EXPECT_EQ(test::ReadWholeObject(st, "mixed"), want);
}

TEST(S3StorageTest, CheckpointStoreRoundTripOfTwoRanks) {
  SKIP_WITHOUT_S3();
  TempDir dir;
  auto opened = OpenStorage(TestUri(dir) + "?part_size=5M");
  ASSERT_OK(opened);
  CheckpointStore store(std::shared_ptr<Storage>(std::move(*opened)));
  // 24 MiB of tensor data per rank: multipart images (5 parts), then the COMMIT record.
  constexpr size_t kElems = 6 << 20;
  std::vector<std::vector<float>> data(2, std::vector<float>(kElems));
  for (uint32_t rank = 0; rank < 2; ++rank) {
    for (size_t i = 0; i < kElems; ++i) data[rank][i] = float(rank * 7 + i % 1000003);
    std::vector<TensorSource> sources;
    sources.push_back({{"w", DType::kFloat32, {kElems}, {}, {}}, data[rank].data(), kElems * 4});
    Dict d;
    d.items.emplace_back(Value(std::string("w")), Value(TensorRef{0, 0}));
    auto extras = EncodeExtras(Value(std::move(d)));
    ASSERT_OK(extras);
    auto saved = SaveShard(store, test::TestImageMeta("s3", 3, rank, 2), sources, *extras);
    ASSERT_OK(saved);
    EXPECT_EQ(saved->committed, rank == 1);
  }
  auto committed = store.ListCommitted();
  ASSERT_OK(committed);
  ASSERT_EQ(committed->size(), 1u);
  EXPECT_EQ((*committed)[0].step, 3u);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto shard = LoadShard(store, std::nullopt, rank);
    ASSERT_OK(shard);
    EXPECT_EQ(shard->commit.step, 3u);
    auto w = shard->reader.tensor_data(0);
    ASSERT_EQ(w.size(), kElems * 4);
    EXPECT_EQ(std::memcmp(w.data(), data[rank].data(), w.size()), 0) << "rank " << rank;
  }
}

// A radosgw of the test's own on the test cluster, in the foreground as a child of this process.
class PrivateGateway {
 public:
  ~PrivateGateway() { Kill(); }

  // Starts it on `port` (0: a free one) and waits until it answers. False with a message when
  // it cannot start.
  bool Start(int port, std::string* error) {
    const char* dir = std::getenv("SAFEPOINT_TEST_CEPH_DIR");
    if (dir == nullptr) {
      *error = "$SAFEPOINT_TEST_CEPH_DIR is not set";
      return false;
    }
    if (port == 0) port = FreeLoopbackPort();
    port_ = port;
    const std::string conf = std::string(dir) + "/ceph.conf";
    const std::string name = "client.rgw.sptest" + std::to_string(getpid());
    const std::string frontends = "beast endpoint=127.0.0.1:" + std::to_string(port);
    const std::string files = tmp_.path() + "/rgw";
    pid_ = fork();
    if (pid_ == 0) {
      execlp("radosgw", "radosgw", "-f", "-c", conf.c_str(), "-n", name.c_str(), "--rgw-frontends",
             frontends.c_str(), "--admin-socket", (files + ".asok").c_str(), "--log-file",
             (files + ".log").c_str(), "--rgw-thread-pool-size", "16", static_cast<char*>(nullptr));
      _exit(127);
    }
    // Poll until it accepts connections (bounded: a gateway that never comes up fails here).
    for (int i = 0; i < 1200; ++i) {
      if (Accepts()) return true;
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        *error = "radosgw exited (log: " + files + ".log)";
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    *error = "radosgw did not listen on port " + std::to_string(port);
    return false;
  }

  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }

  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

 private:
  bool Accepts() const {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    return ok;
  }

  TempDir tmp_;
  pid_t pid_ = -1;
  int port_ = 0;
};

#define START_PRIVATE_GATEWAY(gw, env)         \
  SKIP_WITHOUT_S3_CEPH_DIR();                  \
  {                                            \
    std::string error;                         \
    ASSERT_TRUE(gw.Start(0, &error)) << error; \
  }                                            \
  env.Set("AWS_ENDPOINT_URL", gw.endpoint());  \
  env.Unset("AWS_ENDPOINT_URL_S3")

TEST(S3StorageFaultTest, StalledGatewayFailsUploadAndDownloadAfterTheTimeout) {
  ScopedEnv env;
  PrivateGateway gw;
  START_PRIVATE_GATEWAY(gw, env);
  TempDir dir;
  // The object read later is written through a handle with a generous timeout: on a loaded
  // machine a fresh gateway can take more than the stalled handle's few seconds to answer.
  auto setup = OpenStorage(TestUri(dir) + "?timeout=60");
  ASSERT_OK(setup);
  ASSERT_OK(test::PutObject(**setup, "before", PatternBytes(1 << 20, 1)));
  auto s = OpenStorage(TestUri(dir) + "?timeout=3&retries=1&part_size=5M");
  ASSERT_OK(s);
  Storage& st = **s;
  auto r = st.Open("before");
  ASSERT_OK(r);

  gw.Signal(SIGSTOP);
  struct Continue {
    PrivateGateway& gw;
    ~Continue() { gw.Signal(SIGCONT); }
  } resume{gw};

  std::vector<std::byte> buf(1 << 20);
  EXPECT_TRUE(IsError((*r)->ReadAt(0, buf), StatusCode::kUnavailable,
                      {st.Describe("before"), "after 2 attempts"}));
  EXPECT_TRUE(IsError(test::PutObject(st, "small", PatternBytes(1000, 2)), StatusCode::kUnavailable,
                      {st.Describe("small")}));

  auto w = st.Create("large", 12 << 20);
  ASSERT_OK(w);
  // Parts 1 and 2 are whole 5 MiB parts of this one write: each is uploaded from the caller's
  // bytes before WriteAt returns, so the stall fails the write itself (naming the object);
  // the 2 MiB tail would be buffered and sent at Publish.
  Status wrote = (*w)->WriteAt(0, PatternBytes(12 << 20, 3));
  EXPECT_TRUE(IsError(wrote.ok() ? (*w)->Publish() : wrote, StatusCode::kUnavailable,
                      {st.Describe("large")}));

  gw.Signal(SIGCONT);
  // The gateway is back. The multipart object never became visible. The single PUT that timed
  // out may still be applied once the gateway resumes (its bytes were in the socket): then it
  // is whole, never partial (docs/operations.md: a timed-out request may land later).
  auto names = st.List("");
  ASSERT_OK(names);
  for (const ObjectInfo& info : *names) {
    EXPECT_TRUE(info.name == "before" || info.name == "small") << info.name;
    if (info.name == "small") EXPECT_EQ(test::ReadWholeObject(st, "small"), PatternBytes(1000, 2));
  }
  EXPECT_EQ(st.Open("large").status().code(), StatusCode::kNotFound);
  ASSERT_OK((*r)->ReadAt(0, buf));
  EXPECT_EQ(buf, PatternBytes(1 << 20, 1));
  ASSERT_OK(st.RemoveLeftovers(""));
}

TEST(S3StorageFaultTest, BucketQuotaExceededIsResourceExhaustedAndLeavesNothing) {
  SKIP_WITHOUT_S3_CEPH_DIR();
  const char* ceph_dir = std::getenv("SAFEPOINT_TEST_CEPH_DIR");
  // A bucket of the test's own with a 1 MiB quota (radosgw-admin on the test cluster).
  const std::string bucket = "sp-quota-" + std::to_string(getpid());
  auto config = s3::ResolveS3Config();
  ASSERT_OK(config);
  s3::S3Client client(*config, bucket);
  s3::S3Request create;
  create.method = "PUT";
  auto created = client.Execute(create, "CreateBucket " + bucket);
  ASSERT_OK(created);
  ASSERT_TRUE(created->http_status == 200 || created->http_status == 409) << created->body;
  const std::string admin = "timeout 60 radosgw-admin -c " + std::string(ceph_dir) +
                            "/ceph.conf quota {} --quota-scope=bucket --bucket=" + bucket;
  auto run = [&](const std::string& verb, const std::string& extra) {
    std::string cmd = admin;
    cmd.replace(cmd.find("{}"), 2, verb);
    return std::system((cmd + extra + " >/dev/null 2>&1").c_str());
  };
  ASSERT_EQ(run("set", " --max-size=1048576"), 0);
  ASSERT_EQ(run("enable", ""), 0);

  auto s = OpenStorage("s3://" + bucket + "/run?part_size=5M");
  ASSERT_OK(s);
  Storage& st = **s;
  EXPECT_TRUE(IsError(test::PutObject(st, "step-1/rank-0.img", PatternBytes(2 << 20, 1)),
                      StatusCode::kResourceExhausted,
                      {"QuotaExceeded", st.Describe("step-1/rank-0.img")}));
  Status large = test::PutObject(st, "step-1/rank-1.img", PatternBytes(12 << 20, 2));
  EXPECT_EQ(large.code(), StatusCode::kResourceExhausted) << large.ToString();
  auto names = st.List("");
  ASSERT_OK(names);
  EXPECT_TRUE(names->empty());
  auto leftovers = st.RemoveLeftovers("");
  ASSERT_OK(leftovers);
  EXPECT_EQ(*leftovers, 0u);  // the failed multipart upload was aborted
  s3::S3Request drop;
  drop.method = "DELETE";
  (void)client.Execute(drop, "DeleteBucket " + bucket);
}

TEST(S3StorageFaultTest, GatewayKilledAndRestartedMidDownloadIsRetried) {
  ScopedEnv env;
  PrivateGateway gw;
  START_PRIVATE_GATEWAY(gw, env);
  TempDir dir;
  auto s = OpenStorage(TestUri(dir) + "?timeout=30&retries=8");
  ASSERT_OK(s);
  Storage& st = **s;
  constexpr size_t kSize = 40 << 20;  // three parallel ranges of a part (16 MiB)
  const std::vector<std::byte> data = PatternBytes(kSize, 4);
  ASSERT_OK(test::PutObject(st, "big.img", data));
  auto r = st.Open("big.img");
  ASSERT_OK(r);

  // Freeze the gateway so that the ranged GETs are in flight, then kill it and start a new one
  // on the same port: the GETs see their connections reset and refused, and retry.
  gw.Signal(SIGSTOP);
  std::vector<std::byte> back(kSize);
  Status read;
  std::thread reader([&] { read = (*r)->ReadAt(0, back); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int port = gw.port();
  gw.Kill();
  std::string error;
  ASSERT_TRUE(gw.Start(port, &error)) << error;
  reader.join();
  ASSERT_OK(read);
  EXPECT_TRUE(back == data);
}

}  // namespace
}  // namespace safepoint::s3_storage_test
