// S3 HTTP client: configuration lookup, SigV4, bounded and retried requests (see s3_client.h).
#include "storage/s3/s3_client.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <thread>

#include "base/digest.h"
#include "base/log.h"
#include "storage/uri_options.h"

namespace safepoint::s3 {

namespace {

std::string Getenv(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// key = value pairs of one [section] of an AWS ini file; empty when the file or section is
// missing. Nested settings ("s3 =" followed by indented lines) are skipped.
std::map<std::string, std::string> IniSection(const std::string& path, const std::string& section) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  if (!in) return out;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    const std::string t = Trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[' && t.back() == ']') {
      inside = Trim(std::string_view(t).substr(1, t.size() - 2)) == section;
      continue;
    }
    if (!inside || std::isspace(static_cast<unsigned char>(line[0]))) continue;
    const size_t eq = t.find('=');
    if (eq == std::string::npos) continue;
    out[Lower(Trim(std::string_view(t).substr(0, eq)))] = Trim(std::string_view(t).substr(eq + 1));
  }
  return out;
}

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// True for the failures worth another attempt.
bool Retryable(const S3Response& r, bool conditional) {
  if (r.http_status >= 500 || r.http_status == 429) return true;
  if (conditional && r.http_status == 409) return true;  // ConditionalRequestConflict
  const std::string code = r.ErrorCode();
  return code == "SlowDown" || code == "RequestTimeout" || code == "InternalError" ||
         code == "RequestTimeTooSkewed";
}

// Keeps a SIGPIPE raised on this thread during a transfer (a TLS write to a connection the
// server closed) from killing a process that does not ignore it: blocked while the guard lives,
// a SIGPIPE that became pending meanwhile is consumed. (libcurl leaves this to the caller with
// CURLOPT_NOSIGNAL, which threads need.)
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

}  // namespace

// ---- configuration ------------------------------------------------------------------------------

Result<S3Config> ResolveS3Config() {
  S3Config c;
  const std::string home = Getenv("HOME");
  std::string profile = Getenv("AWS_PROFILE");
  if (profile.empty()) profile = "default";
  std::string cred_file = Getenv("AWS_SHARED_CREDENTIALS_FILE");
  if (cred_file.empty() && !home.empty()) cred_file = home + "/.aws/credentials";
  std::string conf_file = Getenv("AWS_CONFIG_FILE");
  if (conf_file.empty() && !home.empty()) conf_file = home + "/.aws/config";
  auto creds = IniSection(cred_file, profile);
  auto conf = IniSection(conf_file, profile == "default" ? "default" : "profile " + profile);

  c.endpoint = Getenv("AWS_ENDPOINT_URL_S3");
  if (c.endpoint.empty()) c.endpoint = Getenv("AWS_ENDPOINT_URL");
  if (c.endpoint.empty()) c.endpoint = conf["endpoint_url"];
  while (!c.endpoint.empty() && c.endpoint.back() == '/') c.endpoint.pop_back();
  if (!c.endpoint.empty() && c.endpoint.find("://") == std::string::npos) {
    return InvalidArgument(
        "S3 endpoint \"" + c.endpoint +
        "\" (AWS_ENDPOINT_URL) needs a scheme: http://HOST:PORT or https://HOST");
  }
  c.path_style = !c.endpoint.empty();

  c.region = Getenv("AWS_REGION");
  if (c.region.empty()) c.region = Getenv("AWS_DEFAULT_REGION");
  if (c.region.empty()) c.region = conf["region"];
  if (c.region.empty()) {
    if (c.endpoint.empty()) {
      return InvalidArgument(
          "S3: no region: set AWS_REGION (or AWS_DEFAULT_REGION, or region in the profile \"" +
          profile + "\" of " + conf_file + "), or AWS_ENDPOINT_URL for RGW/MinIO");
    }
    c.region = "us-east-1";
  }

  c.access_key = Getenv("AWS_ACCESS_KEY_ID");
  c.secret_key = Getenv("AWS_SECRET_ACCESS_KEY");
  c.session_token = Getenv("AWS_SESSION_TOKEN");
  for (auto* source : {&creds, &conf}) {
    if (!c.access_key.empty() && !c.secret_key.empty()) break;
    c.access_key = (*source)["aws_access_key_id"];
    c.secret_key = (*source)["aws_secret_access_key"];
    c.session_token = (*source)["aws_session_token"];
  }
  if (c.access_key.empty() || c.secret_key.empty()) {
    return InvalidArgument(
        "S3: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or put "
        "aws_access_key_id and aws_secret_access_key in the profile \"" +
        profile + "\" of " + (cred_file.empty() ? "~/.aws/credentials" : cred_file));
  }
  SP_ASSIGN_OR_RETURN(c.timeout_s, internal::StorageTimeoutFromEnv(c.timeout_s));
  return c;
}

// ---- SigV4
// ----------------------------------------------------------------------------------------

std::string UriEncode(std::string_view s, bool keep_slash) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() * 3 / 2);
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string Sha256Hex(std::span<const std::byte> data) {
  return internal::ToHex(internal::Sha256(data));
}

std::string SigV4Authorization(const S3Config& config, std::string_view method,
                               std::string_view canonical_uri, std::string_view canonical_query,
                               const std::vector<std::pair<std::string, std::string>>& headers,
                               std::string_view payload_hash, std::string_view amz_date) {
  std::vector<std::pair<std::string, std::string>> h;
  for (const auto& [k, v] : headers) h.emplace_back(Lower(k), Trim(v));
  std::sort(h.begin(), h.end());
  std::string canonical_headers, signed_headers;
  for (const auto& [k, v] : h) {
    canonical_headers += k + ":" + v + "\n";
    if (!signed_headers.empty()) signed_headers += ';';
    signed_headers += k;
  }
  std::string creq;
  creq.append(method).append("\n").append(canonical_uri).append("\n");
  creq.append(canonical_query).append("\n").append(canonical_headers).append("\n");
  creq.append(signed_headers).append("\n").append(payload_hash);
  const std::string date(amz_date.substr(0, 8));
  const std::string scope = date + "/" + config.region + "/s3/aws4_request";
  const std::string to_sign = "AWS4-HMAC-SHA256\n" + std::string(amz_date) + "\n" + scope + "\n" +
                              Sha256Hex(std::as_bytes(std::span(creq.data(), creq.size())));
  using internal::AsStringView;
  using internal::HmacSha256;
  internal::Sha256Digest key = HmacSha256("AWS4" + config.secret_key, date);
  key = HmacSha256(AsStringView(key), config.region);
  key = HmacSha256(AsStringView(key), "s3");
  key = HmacSha256(AsStringView(key), "aws4_request");
  return "AWS4-HMAC-SHA256 Credential=" + config.access_key + "/" + scope +
         ", SignedHeaders=" + signed_headers +
         ", Signature=" + internal::ToHex(HmacSha256(AsStringView(key), to_sign));
}

// ---- XML
// ------------------------------------------------------------------------------------------

std::vector<std::string_view> XmlElements(std::string_view xml, std::string_view tag) {
  std::vector<std::string_view> out;
  const std::string open = "<" + std::string(tag) + ">";
  const std::string close = "</" + std::string(tag) + ">";
  size_t pos = 0;
  while (true) {
    const size_t b = xml.find(open, pos);
    if (b == std::string_view::npos) break;
    const size_t e = xml.find(close, b + open.size());
    if (e == std::string_view::npos) break;
    out.push_back(xml.substr(b + open.size(), e - b - open.size()));
    pos = e + close.size();
  }
  return out;
}

std::string XmlDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    const size_t semi = s.find(';', i);
    if (semi == std::string_view::npos) {
      out += s[i];
      continue;
    }
    const std::string_view ent = s.substr(i + 1, semi - i - 1);
    if (ent == "amp")
      out += '&';
    else if (ent == "lt")
      out += '<';
    else if (ent == "gt")
      out += '>';
    else if (ent == "quot")
      out += '"';
    else if (ent == "apos")
      out += '\'';
    else if (!ent.empty() && ent[0] == '#') {
      const bool hex = ent.size() > 1 && (ent[1] == 'x' || ent[1] == 'X');
      const unsigned long cp =
          std::strtoul(std::string(ent.substr(hex ? 2 : 1)).c_str(), nullptr, hex ? 16 : 10);
      if (cp < 0x80) {
        out += static_cast<char>(cp);
      } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      }
    } else {
      out.append(s.substr(i, semi - i + 1));
    }
    i = semi;
  }
  return out;
}

std::string XmlText(std::string_view xml, std::string_view tag) {
  auto e = XmlElements(xml, tag);
  return e.empty() ? std::string() : XmlDecode(e[0]);
}

std::string ShownText(std::string_view text, size_t max) {
  std::string out;
  out.reserve(std::min(text.size(), max));
  for (const char c : text) {
    if (out.size() >= max) {
      out.resize(max >= 3 ? max - 3 : 0);
      out += "...";
      break;
    }
    if (c == '\n' || c == '\r' || c == '\t') {
      out += ' ';
    } else if (c >= 0x20 && c < 0x7f) {
      out += c;
    } else {
      out += '?';
    }
  }
  return out;
}

std::string XmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

int64_t ParseIso8601Ns(std::string_view s) {
  std::tm tm{};
  int frac = 0;
  const std::string str(s);
  int n = std::sscanf(str.c_str(), "%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                      &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &frac);
  if (n < 6) return 0;
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  const time_t t = timegm(&tm);
  int64_t ns = static_cast<int64_t>(t) * 1000000000;
  if (n == 7) {
    // Fraction digits as written: ".5" is 500 ms, ".123" 123 ms.
    const size_t dot = str.find('.');
    const size_t z = str.find('Z', dot);
    int digits = static_cast<int>(z - dot - 1);
    int64_t f = frac;
    for (int i = digits; i < 9; ++i) f *= 10;
    for (int i = 9; i < digits; ++i) f /= 10;
    ns += f;
  }
  return ns;
}

// ---- responses
// ------------------------------------------------------------------------------------

std::string S3Response::ErrorCode() const { return XmlText(body, "Code"); }

std::string S3Response::Header(std::string_view lower_name) const {
  auto it = headers.find(std::string(lower_name));
  return it == headers.end() ? std::string() : it->second;
}

// ---- the client
// -----------------------------------------------------------------------------------

S3Client::S3Client(S3Config config, std::string bucket)
    : config_(std::move(config)), bucket_(std::move(bucket)) {
  GlobalInit();
  if (config_.endpoint.empty() && bucket_.find('.') != std::string::npos) {
    // AWS with a dotted bucket name: the wildcard certificate does not cover
    // "a.b.s3.REGION.amazonaws.com", so path style, as the SDKs do.
    host_ = "s3." + config_.region + ".amazonaws.com";
    base_url_ = "https://" + host_;
    path_prefix_ = "/" + UriEncode(bucket_, false);
  } else if (config_.endpoint.empty()) {
    host_ = bucket_ + ".s3." + config_.region + ".amazonaws.com";
    base_url_ = "https://" + host_;
  } else {
    const size_t scheme_end = config_.endpoint.find("://") + 3;
    const size_t slash = config_.endpoint.find('/', scheme_end);
    host_ = config_.endpoint.substr(
        scheme_end, slash == std::string::npos ? std::string::npos : slash - scheme_end);
    if (config_.path_style) {
      path_prefix_ = "/" + UriEncode(bucket_, false);
      base_url_ =
          config_.endpoint.substr(0, slash == std::string::npos ? std::string::npos : slash);
    } else {
      host_ = bucket_ + "." + host_;
      base_url_ = config_.endpoint.substr(0, scheme_end) + host_;
    }
  }
  if (const char* trace = std::getenv("SAFEPOINT_S3_TRACE"); trace != nullptr && *trace != 0) {
    trace_fd_ = open(trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (trace_fd_ < 0) {
      // Asked for and not written: said once a process (every client opens it).
      const int err = errno;
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        spdlog::warn("SAFEPOINT_S3_TRACE={}: cannot open it ({}); no S3 request trace is written",
                     trace, std::strerror(err));
      }
    }
  }
}

S3Client::~S3Client() {
  for (void* h : idle_handles_) curl_easy_cleanup(static_cast<CURL*>(h));
  if (trace_fd_ >= 0) close(trace_fd_);
}

namespace {
int64_t MonotonicMicros() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}
}  // namespace

void S3Client::TraceAttempt(const S3Request& req, void* handle, int64_t start_us,
                            long http_status) const {
  CURL* curl = static_cast<CURL*>(handle);
  curl_off_t down = 0, up = 0, connect_us = 0, first_byte_us = 0, total_us = 0;
  long new_connections = 0, local_port = 0;
  curl_easy_getinfo(curl, CURLINFO_SIZE_DOWNLOAD_T, &down);
  curl_easy_getinfo(curl, CURLINFO_SIZE_UPLOAD_T, &up);
  curl_easy_getinfo(curl, CURLINFO_NUM_CONNECTS, &new_connections);
  curl_easy_getinfo(curl, CURLINFO_LOCAL_PORT, &local_port);
  curl_easy_getinfo(curl, CURLINFO_CONNECT_TIME_T, &connect_us);
  curl_easy_getinfo(curl, CURLINFO_STARTTRANSFER_TIME_T, &first_byte_us);
  curl_easy_getinfo(curl, CURLINFO_TOTAL_TIME_T, &total_us);
  std::string range;
  for (const auto& [k, v] : req.headers) {
    if (Lower(k) == "range") range = v;
  }
  std::string line = std::to_string(start_us) + '\t' + std::to_string(MonotonicMicros()) + '\t' +
                     std::to_string(gettid()) + '\t' + req.method + '\t' +
                     std::to_string(http_status) + '\t' + std::to_string(down) + '\t' +
                     std::to_string(up) + '\t' + std::to_string(new_connections) + '\t' +
                     std::to_string(local_port) + '\t' + std::to_string(connect_us) + '\t' +
                     std::to_string(first_byte_us) + '\t' + std::to_string(total_us) + '\t' +
                     ShownText(req.key, 256) + '\t' + (range.empty() ? "-" : range) + '\n';
  // One write: O_APPEND keeps lines of concurrent writers whole. A failed write loses a line of a
  // diagnostic trace and nothing else.
  [[maybe_unused]] const ssize_t n = write(trace_fd_, line.data(), line.size());
}

void* S3Client::TakeHandle() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_handles_.empty()) {
      void* h = idle_handles_.back();
      idle_handles_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void S3Client::GiveHandle(void* handle) {
  if (handle == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  idle_handles_.push_back(handle);
}

std::string S3Client::Url(std::string_view key, std::string_view query) const {
  std::string url = base_url_ + path_prefix_ + "/" + UriEncode(key, true);
  if (!query.empty()) url += "?" + std::string(query);
  return url;
}

namespace {

// State of one attempt, shared with libcurl's callbacks.
struct Attempt {
  const S3Request* request;
  S3Response* response;
  CURL* curl;
  const std::atomic<bool>* cancelled;
  size_t sent = 0;
  bool overflow = false;  // more body than receive_into holds
};

// libcurl calls it at least once a second while a transfer waits: non-zero aborts it.
int Progress(void* userdata, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  return static_cast<Attempt*>(userdata)->cancelled->load(std::memory_order_acquire) ? 1 : 0;
}

size_t ReadBody(char* buffer, size_t size, size_t nitems, void* userdata) {
  auto* a = static_cast<Attempt*>(userdata);
  const auto body = a->request->body;
  const size_t n = std::min(size * nitems, body.size() - a->sent);
  std::memcpy(buffer, body.data() + a->sent, n);
  a->sent += n;
  return n;
}

size_t WriteBody(char* ptr, size_t size, size_t nmemb, void* userdata) {
  auto* a = static_cast<Attempt*>(userdata);
  const size_t n = size * nmemb;
  long code = 0;
  curl_easy_getinfo(a->curl, CURLINFO_RESPONSE_CODE, &code);
  if (a->request->has_receive_into && code >= 200 && code < 300) {
    auto dst = a->request->receive_into;
    if (a->response->received + n > dst.size()) {
      a->overflow = true;
      return 0;  // aborts the transfer
    }
    std::memcpy(dst.data() + a->response->received, ptr, n);
    a->response->received += n;
    return n;
  }
  if (a->response->body.size() + n > (64u << 20)) return 0;
  a->response->body.append(ptr, n);
  return n;
}

size_t HeaderLine(char* buffer, size_t size, size_t nitems, void* userdata) {
  auto* a = static_cast<Attempt*>(userdata);
  const size_t n = size * nitems;
  std::string_view line(buffer, n);
  if (line.starts_with("HTTP/")) {
    a->response->headers.clear();  // a new response (after 100 Continue)
    return n;
  }
  const size_t colon = line.find(':');
  if (colon != std::string_view::npos) {
    a->response->headers[Lower(Trim(line.substr(0, colon)))] = Trim(line.substr(colon + 1));
  }
  return n;
}

}  // namespace

Result<S3Response> S3Client::Once(const S3Request& req, void* handle,
                                  std::string* transport_error) {
  CURL* curl = static_cast<CURL*>(handle);
  curl_easy_reset(curl);
  S3Response resp;
  Attempt a{&req, &resp, curl, &cancelled_};

  // Canonical query: sorted by encoded key, then value.
  std::vector<std::pair<std::string, std::string>> q;
  for (const auto& [k, v] : req.query) q.emplace_back(UriEncode(k, false), UriEncode(v, false));
  std::sort(q.begin(), q.end());
  std::string query;
  for (const auto& [k, v] : q) {
    if (!query.empty()) query += '&';
    query += k + "=" + v;
  }
  const std::string url = Url(req.key, query);
  const std::string canonical_uri = path_prefix_ + "/" + UriEncode(req.key, true);

  // x-amz-date
  char amz_date[32];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(amz_date, sizeof(amz_date), "%Y%m%dT%H%M%SZ", &tm);
  // Bodies up to 1 MiB are hashed; larger ones (object data, whose integrity the image's own
  // checksums cover end to end) go as UNSIGNED-PAYLOAD so that no core hashes gigabytes.
  const std::string payload_hash =
      req.body.size() <= (1u << 20) ? Sha256Hex(req.body) : "UNSIGNED-PAYLOAD";

  std::vector<std::pair<std::string, std::string>> signed_headers = {
      {"host", host_}, {"x-amz-content-sha256", payload_hash}, {"x-amz-date", amz_date}};
  if (!config_.session_token.empty()) {
    signed_headers.emplace_back("x-amz-security-token", config_.session_token);
  }
  const std::string auth = SigV4Authorization(config_, req.method, canonical_uri, query,
                                              signed_headers, payload_hash, amz_date);
  curl_slist* list = nullptr;
  for (const auto& [k, v] : signed_headers) list = curl_slist_append(list, (k + ": " + v).c_str());
  list = curl_slist_append(list, ("Authorization: " + auth).c_str());
  for (const auto& [k, v] : req.headers) list = curl_slist_append(list, (k + ": " + v).c_str());
  list = curl_slist_append(list, "Expect:");  // no 100-continue round trip

  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_TCP_KEEPALIVE, 1L);
  const long timeout_ms = std::max(1L, static_cast<long>(config_.timeout_s * 1000));
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, std::min(timeout_ms, 10000L));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                   std::max(1L, std::min(30L, static_cast<long>(config_.timeout_s))));
  // Larger socket reads and writes than libcurl's defaults (16 KiB / 64 KiB): fewer callbacks
  // and system calls per megabyte (the curl tool itself reads 100 KiB at a time).
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(curl, CURLOPT_UPLOAD_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, WriteBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &a);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, HeaderLine);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &a);
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, Progress);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, &a);
  if (req.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (req.method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, ReadBody);
    curl_easy_setopt(curl, CURLOPT_READDATA, &a);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
  } else if (req.method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, ReadBody);
    curl_easy_setopt(curl, CURLOPT_READDATA, &a);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
  } else if (req.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, req.method.c_str());
  }
  CURLcode rc;
  const int64_t start_us = trace_fd_ >= 0 ? MonotonicMicros() : 0;
  {
    SigpipeGuard no_sigpipe;
    rc = curl_easy_perform(curl);
  }
  curl_slist_free_all(list);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &resp.http_status);
  if (trace_fd_ >= 0) TraceAttempt(req, curl, start_us, resp.http_status);
  if (a.overflow) {
    return IOError("the server sent more than the " + std::to_string(req.receive_into.size()) +
                   " bytes asked for");
  }
  if (rc == CURLE_ABORTED_BY_CALLBACK) {
    *transport_error = "cancelled";
    return Cancelled("request cancelled");
  }
  if (rc != CURLE_OK) {
    *transport_error = curl_easy_strerror(rc);
    if (rc == CURLE_OPERATION_TIMEDOUT) {
      *transport_error += " (no complete answer within " +
                          std::to_string(static_cast<long>(config_.timeout_s)) + " s)";
    }
    return Unavailable(*transport_error);
  }
  return resp;
}

void S3Client::Cancel() {
  {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    cancelled_.store(true, std::memory_order_release);
  }
  cancel_cv_.notify_all();
}

Result<S3Response> S3Client::Execute(const S3Request& request, std::string_view what) {
  const bool conditional =
      std::any_of(request.headers.begin(), request.headers.end(),
                  [](const auto& h) { return Lower(h.first) == "if-none-match"; });
  Status last;
  int made = 0;
  for (int attempt = 0; attempt <= config_.retries; ++attempt) {
    if (attempt > 0) {
      std::unique_lock<std::mutex> lock(cancel_mu_);
      cancel_cv_.wait_for(lock,
                          std::chrono::duration<double>(internal::RetryBackoffSeconds(attempt)),
                          [this] { return cancelled(); });
    }
    if (cancelled()) {
      return Cancelled(std::string(what) + " cancelled (the storage is being shut down)" +
                       (made > 0 ? " after " + std::to_string(made) + " attempt(s)" : ""));
    }
    ++made;
    void* curl = TakeHandle();
    if (curl == nullptr) return ResourceExhausted(std::string(what) + ": curl_easy_init failed");
    std::string transport_error;
    Result<S3Response> r = Once(request, curl, &transport_error);
    if (!r.ok() && !transport_error.empty()) {
      // The connection may be in any state: do not reuse this handle.
      curl_easy_cleanup(static_cast<CURL*>(curl));
    } else {
      GiveHandle(curl);
    }
    if (!r.ok()) {
      last = r.status();
      if (transport_error.empty()) break;  // not transient (e.g. an overlong body)
      continue;                            // cancelled: ends at the check above
    }
    if (Retryable(*r, conditional) && attempt < config_.retries) {
      last = Unavailable("HTTP " + std::to_string(r->http_status) + " " +
                         ShownText(r->ErrorCode(), kMaxShownCode));
      continue;
    }
    r->attempts = made;
    return r;
  }
  return Status(last.code(), std::string(what) + " failed after " + std::to_string(made) +
                                 (made == 1 ? " attempt" : " attempts") + " (endpoint " +
                                 base_url_ + "): " + last.message());
}

}  // namespace safepoint::s3
