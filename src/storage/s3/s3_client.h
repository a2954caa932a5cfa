// S3 HTTP client of the s3:// storage backend: configuration, AWS SigV4 signing, one bounded,
// retried request at a time per calling thread, and the few XML helpers the backend needs.
// Private to the library (src/storage/s3) and its tests.
//
// Configuration is found the way the AWS SDKs find it (ResolveS3Config): the endpoint from
// AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or the profile's endpoint_url (none: AWS itself,
// virtual-host addressing); the region from AWS_REGION, AWS_DEFAULT_REGION or the profile's
// region (us-east-1 when an endpoint is given without one); credentials from AWS_ACCESS_KEY_ID /
// AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, then the profile (AWS_PROFILE, else "default") in
// AWS_SHARED_CREDENTIALS_FILE (~/.aws/credentials), then in AWS_CONFIG_FILE (~/.aws/config,
// sections "[profile NAME]" and "[default]").
//
// Signing: requests are signed with AWS Signature Version 4 here (base/digest.h), not
// with libcurl's CURLOPT_AWS_SIGV4: libcurl 7.88 neither adds the x-amz-content-sha256 header
// that S3 requires nor signs a session token, and its canonical query string is not the one S3
// computes for every request this backend sends (?uploads, ?partNumber=&uploadId=, listing
// continuation tokens). Doing it here gives the same signature on every libcurl version.
//
// Every request is bounded: connect timeout, stall detection (no byte for min(timeout, 30) s)
// and a total time of `timeout`; failures that may be transient (connection errors, timeouts,
// HTTP 5xx, 429, 409 on a conditional write, the S3 codes SlowDown / RequestTimeout /
// InternalError) are retried `retries` times with exponential backoff and jitter. Easy
// handles are kept in a pool so that connections are reused across requests and threads.
//
// Request trace (off unless asked for): with SAFEPOINT_S3_TRACE=FILE in the environment when the
// client is created, every attempt appends one tab-separated line to FILE (opened with O_APPEND by
// each client; each line is one write(2), so the lines of several clients and threads never mix):
//   start_us end_us tid method http_status down_bytes up_bytes new_connections local_port
//   connect_us starttransfer_us total_us key range
// start_us/end_us are CLOCK_MONOTONIC microseconds (comparable with time.monotonic() of any process
// on the host); tid is the calling thread; new_connections is how many connections libcurl opened
// for the attempt (0: a pooled connection was reused), local_port names the connection;
// connect_us, starttransfer_us and total_us are libcurl's CURLINFO_*_TIME_T of the attempt. For
// measuring where a transfer's time goes (bench/s3_bimodal.py); nothing reads it back. A FILE
// that cannot be opened is warned about once a process (the log), and nothing is traced.
//
// Thread safety: S3Client::Execute may be called from many threads at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::s3 {

struct S3Config {
  std::string endpoint;  // "http://127.0.0.1:8080" (no trailing '/'); empty: AWS
  std::string region;
  std::string access_key;
  std::string secret_key;
  std::string session_token;  // empty when none
  bool path_style = false;    // true when an endpoint is given (RGW, MinIO)
  double timeout_s = 60;      // bound of each request
  int retries = 4;            // retries after the first attempt
};

// Reads the configuration from the environment and the ~/.aws files (see the top of this file).
// InvalidArgument naming what is missing (no region for AWS, no credentials).
Result<S3Config> ResolveS3Config();

// One request. `key` is the object key (not encoded); empty for a bucket-level request.
struct S3Request {
  std::string method = "GET";  // GET, HEAD, PUT, POST, DELETE
  std::string key;
  std::vector<std::pair<std::string, std::string>> query;    // not encoded; "" value allowed
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers (Range, If-*)
  std::span<const std::byte> body;                           // request body (PUT, POST)
  // When set, a 2xx response body is copied here (exactly this many bytes expected), with no
  // intermediate buffer; otherwise it is kept in S3Response::body.
  std::span<std::byte> receive_into;
  bool has_receive_into = false;
};

struct S3Response {
  long http_status = 0;
  std::string body;                            // response body (or the error body)
  std::map<std::string, std::string> headers;  // lower-case names
  uint64_t received = 0;                       // bytes written into receive_into
  int attempts = 1;                            // requests sent for this answer (retries + 1)
  std::string ErrorCode() const;               // <Code> of an S3 error body, "" if none
  std::string Header(std::string_view lower_name) const;
};

class S3Client {
 public:
  S3Client(S3Config config, std::string bucket);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  // Sends `request`, retrying transient failures. Returns the response of the last attempt for
  // any HTTP status (the caller maps it; S3Response::attempts counts the requests sent);
  // Unavailable naming `what` and the endpoint when no HTTP response came back at all
  // (connection refused, timeout, stall) after the retries.
  Result<S3Response> Execute(const S3Request& request, std::string_view what);

  // Ends every request in flight promptly (Cancelled: libcurl's transfer is aborted from its
  // progress callback, a retry backoff is cut short) and fails every later one at once. Final.
  void Cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // scheme://host[:port] the requests go to (named in errors: which server failed).
  const std::string& endpoint() const { return base_url_; }

  // The request's URL (for tests and messages).
  std::string Url(std::string_view key, std::string_view query) const;

 private:
  void* TakeHandle();
  void GiveHandle(void* handle);
  Result<S3Response> Once(const S3Request& request, void* curl, std::string* transport_error);
  void TraceAttempt(const S3Request& request, void* curl, int64_t start_us, long http_status) const;

  const S3Config config_;
  const std::string bucket_;
  std::string host_;         // authority for the Host header and signing
  std::string base_url_;     // scheme://authority[/bucket] (path style) or virtual host
  std::string path_prefix_;  // "/bucket" (path style) or ""
  std::mutex mu_;
  std::vector<void*> idle_handles_;
  std::atomic<bool> cancelled_{false};
  std::mutex cancel_mu_;  // with cancel_cv_: wakes backoffs at Cancel
  std::condition_variable cancel_cv_;
  int trace_fd_ = -1;  // SAFEPOINT_S3_TRACE's file (O_APPEND), or -1
};

// SigV4 pieces (exposed for the unit test against AWS's published example).
std::string UriEncode(std::string_view s, bool keep_slash);
std::string Sha256Hex(std::span<const std::byte> data);
std::string SigV4Authorization(const S3Config& config, std::string_view method,
                               std::string_view canonical_uri, std::string_view canonical_query,
                               const std::vector<std::pair<std::string, std::string>>& headers,
                               std::string_view payload_hash, std::string_view amz_date);

// Minimal XML helpers for S3's flat response documents: the inner texts of every <tag>...</tag>
// (not nested in itself), entity-decoded by XmlDecode.
std::vector<std::string_view> XmlElements(std::string_view xml, std::string_view tag);
std::string XmlText(std::string_view xml, std::string_view tag);  // first element, decoded
std::string XmlDecode(std::string_view s);
std::string XmlEscape(std::string_view s);

// Text of a server's answer (an error's <Code> or <Message>) made fit to show in an error, and
// from there in agent.log, the status and the event log: printable ASCII only (a line break or
// tab becomes a space, any other byte '?': no terminal escapes, no forged log lines), at most
// `max` bytes, "..." where it was cut.
inline constexpr size_t kMaxShownCode = 64;
inline constexpr size_t kMaxShownMessage = 256;
std::string ShownText(std::string_view text, size_t max);

// Parses "2026-12-01T05:40:00.000Z" into nanoseconds since the epoch; 0 when malformed.
int64_t ParseIso8601Ns(std::string_view s);

}  // namespace safepoint::s3
