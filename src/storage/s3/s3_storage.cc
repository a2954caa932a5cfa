// S3Storage: Storage over an S3 bucket (see s3_storage.h for the protocol).
#include "storage/s3/s3_storage.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "storage/cancellable.h"
#include "storage/s3/s3_client.h"
#include "storage/uri_options.h"

namespace safepoint {

namespace {

using s3::S3Client;
using s3::S3Request;
using s3::S3Response;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kMinPartSize = 5 * kMiB;    // S3's minimum for all parts but the last
constexpr uint64_t kMaxPartSize = 5ull << 30;  // and its maximum
constexpr uint64_t kMaxParts = 10000;

// A fixed set of threads that run queued tasks; started on first use, joined by the destructor.
// Tasks never wait for other tasks, so a full pool only delays work.
class TaskPool {
 public:
  explicit TaskPool(size_t threads) : max_threads_(threads) {}
  ~TaskPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void Submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    // More queued tasks than idle threads to take them: another thread, up to the maximum.
    if (threads_.size() < max_threads_ && queue_.size() > idle_) {
      threads_.emplace_back([this] { Run(); });
    } else {
      cv_.notify_one();
    }
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stopping
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stop_ = false;
};

// Counts tasks of one call and keeps their first error.
class TaskGroup {
 public:
  void Add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
  }
  void Done(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok() && first_.ok()) first_ = std::move(s);
    if (--pending_ == 0) cv_.notify_all();
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
    return first_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  Status first_;
};

// Upload ids of multipart uploads that writers of this process own (RemoveLeftovers skips them).
class ActiveUploads {
 public:
  static ActiveUploads& Get() {
    static ActiveUploads* a = new ActiveUploads();  // never destroyed: usable at exit
    return *a;
  }
  void Add(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.insert(id);
  }
  void Remove(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.erase(id);
  }
  bool Contains(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    return ids_.count(id) > 0;
  }

 private:
  std::mutex mu_;
  std::set<std::string> ids_;
};

// The buffer of one part.
struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using PartBuffer = std::unique_ptr<std::byte[], FreeDeleter>;

// Part buffers of the storage's default part size, kept for reuse once their part is uploaded:
// a fresh 16 MiB buffer costs 4096 page faults and the kernel's zeroing, a reused one nothing.
// A reused buffer holds old bytes; the writer zeroes what was not written before it uploads.
class PartBufferPool {
 public:
  PartBufferPool(uint64_t size, size_t keep) : size_(size), keep_(keep) {}

  // A buffer of `size` bytes; *zeroed tells whether it is known to be all zeros. Null when
  // memory is short.
  PartBuffer Take(uint64_t size, bool* zeroed) {
    if (size == size_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        PartBuffer b = std::move(free_.back());
        free_.pop_back();
        *zeroed = false;
        return b;
      }
    }
    *zeroed = true;
    return PartBuffer(static_cast<std::byte*>(std::calloc(1, size)));
  }

  void Give(PartBuffer b, uint64_t size) {
    if (!b || size != size_) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < keep_) free_.push_back(std::move(b));
  }

 private:
  const uint64_t size_;
  const size_t keep_;
  std::mutex mu_;
  std::vector<PartBuffer> free_;
};

struct S3Options {
  // Unset: the client configuration's ($SAFEPOINT_STORAGE_TIMEOUT or 60 s; 4 retries).
  std::optional<double> timeout_s;
  std::optional<int> retries;
  uint64_t part_size = 16 * kMiB;
  size_t connections = 8;
};

// What one S3Storage and every object it opened share; objects keep it alive.
struct S3Context {
  std::unique_ptr<S3Client> client;
  std::string uri;   // "s3://bucket" or "s3://bucket/prefix"
  std::string root;  // "" or "prefix/"
  S3Options options;
  PartBufferPool buffers;
  TaskPool pool;  // last: its threads are joined first

  S3Context(std::unique_ptr<S3Client> c, std::string u, std::string r, S3Options o)
      : client(std::move(c)),
        uri(std::move(u)),
        root(std::move(r)),
        options(o),
        buffers(o.part_size, 2 * o.connections),
        pool(o.connections) {}

  std::string Key(std::string_view name) const { return root + std::string(name); }
  std::string Describe(std::string_view name) const { return uri + "/" + std::string(name); }

  Result<S3Response> Head(const std::string& key, const std::string& what) const {
    S3Request req;
    req.method = "HEAD";
    req.key = key;
    return client->Execute(req, what);
  }

  // AbortMultipartUpload: the upload's parts are dropped, no object appears.
  Result<S3Response> AbortUpload(const std::string& key, const std::string& upload_id,
                                 const std::string& what) const {
    S3Request req;
    req.method = "DELETE";
    req.key = key;
    req.query = {{"uploadId", upload_id}};
    return client->Execute(req, what);
  }
};

// Maps an S3 error response of `what` ("PUT s3://b/p/x") from `endpoint` to a Status.
Status HttpError(const S3Response& r, const std::string& what, const std::string& endpoint) {
  const std::string code = r.ErrorCode();
  std::string detail = "HTTP " + std::to_string(r.http_status);
  // What the server says is shown bounded and printable (s3::ShownText): it ends up in logs.
  if (!code.empty()) detail += " " + s3::ShownText(code, s3::kMaxShownCode);
  if (const std::string m = s3::XmlText(r.body, "Message"); !m.empty()) {
    detail += ": " + s3::ShownText(m, s3::kMaxShownMessage);
  }
  // Which server answered: the same bucket may be reached through several endpoints.
  detail += " (" + (r.attempts > 1 ? "after " + std::to_string(r.attempts) + " attempts, " : "") +
            "endpoint " + endpoint + ")";
  if (code == "QuotaExceeded" || code == "EntityTooLarge" || r.http_status == 507) {
    return ResourceExhausted(what + ": quota exceeded or storage full (" + detail + ")");
  }
  if (r.http_status == 404) return NotFound(what + ": not found (" + detail + ")");
  if (r.http_status == 401 || r.http_status == 403) {
    return IOError(what + ": permission denied (" + detail +
                   "): check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                   "AWS_PROFILE) and the bucket's policy");
  }
  if (r.http_status >= 500 || r.http_status == 429) return Unavailable(what + ": " + detail);
  return IOError(what + ": " + detail);
}

bool Ok2xx(const S3Response& r) { return r.http_status >= 200 && r.http_status < 300; }

// Adds [a, b) to the disjoint ranges `m` (start -> end) and returns whether [0, len) is covered.
bool AddRange(std::map<uint64_t, uint64_t>& m, uint64_t a, uint64_t b, uint64_t len) {
  auto it = m.upper_bound(a);
  if (it != m.begin() && std::prev(it)->second >= a) {
    --it;
    a = it->first;
    b = std::max(b, it->second);
    it = m.erase(it);
  }
  while (it != m.end() && it->first <= b) {
    b = std::max(b, it->second);
    it = m.erase(it);
  }
  m[a] = b;
  return m.size() == 1 && m.begin()->first == 0 && m.begin()->second >= len;
}

// ---- writing ------------------------------------------------------------------------------------

class S3WritableObject final : public WritableObject {
 public:
  S3WritableObject(std::shared_ptr<S3Context> ctx, std::string name, uint64_t part_size)
      : ctx_(std::move(ctx)),
        key_(ctx_->Key(name)),
        desc_(ctx_->Describe(name)),
        part_size_(part_size) {}

  ~S3WritableObject() override { Abort(); }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (data.size() > UINT64_MAX - offset) {
      return InvalidArgument(desc_ + ": write of " + std::to_string(data.size()) +
                             " bytes at offset " + std::to_string(offset) + " overflows");
    }
    const uint64_t end = offset + data.size();
    if (data.empty()) return Usable();
    if ((end - 1) / part_size_ >= kMaxParts) {
      return InvalidArgument(desc_ + ": a write ending at byte " + std::to_string(end) +
                             " needs more than 10000 parts of " + std::to_string(part_size_) +
                             " bytes: give Create a size hint or a larger ?part_size=");
    }
    uint64_t pos = offset;
    while (pos < end) {
      const uint64_t index = pos / part_size_;
      const uint64_t part_start = index * part_size_;
      const uint64_t n = std::min(end, part_start + part_size_) - pos;
      const std::span<const std::byte> piece = data.subspan(pos - offset, n);
      Part* part;
      bool direct = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        SP_RETURN_IF_ERROR(UsableLocked());
        part = &parts_[index];
        if (part->sent) {
          return InvalidArgument(desc_ + ": write at offset " + std::to_string(pos) +
                                 " into part " + std::to_string(index + 1) +
                                 ", which was already completely written and uploaded");
        }
        // A whole part written at once (a persist's part-sized requests) is uploaded from the
        // caller's bytes on this thread: no copy, no part buffer. The writers' own number
        // (the storage's io_parallelism) bounds these uploads.
        direct = n == part_size_ && !part->buffer && part->written.empty();
        if (direct) {
          part->sent = true;
          ++in_flight_;
        } else {
          SP_RETURN_IF_ERROR(AllocateLocked(*part));
        }
        end_ = std::max(end_, pos + n);
      }
      if (direct) {
        Status s = UploadPart(index, piece);
        std::lock_guard<std::mutex> lock(mu_);
        FinishUploadLocked(index, std::move(s));
        SP_RETURN_IF_ERROR(UsableLocked());
        pos += n;
        continue;
      }
      std::memcpy(part->buffer.get() + (pos - part_start), piece.data(), n);
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (AddRange(part->written, pos - part_start, pos - part_start + n, part_size_) &&
            !part->sent && state_ == State::kOpen) {
          StartUploadLocked(index, part_size_);
          // Bounded memory: at most `connections` parts wait for or are in upload.
          cv_.wait(lock, [&] {
            return in_flight_ <= ctx_->options.connections || state_ != State::kOpen;
          });
        }
      }
      pos += n;
    }
    return Usable();
  }

  Status Publish() override { return DoPublish(false); }
  Status PublishIfAbsent() override { return DoPublish(true); }

  void Abort() override {
    std::string upload_id;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (state_ == State::kPublished || state_ == State::kAborted) return;
      state_ = State::kAborted;
      cv_.wait(lock, [&] { return in_flight_ == 0; });
      for (auto& [index, part] : parts_) ctx_->buffers.Give(std::move(part.buffer), part_size_);
      parts_.clear();
      upload_id = upload_id_;
    }
    if (upload_id.empty()) return;
    // Best effort: an upload left behind is aborted by RemoveLeftovers or a lifecycle rule.
    (void)ctx_->AbortUpload(key_, upload_id, "AbortMultipartUpload " + desc_);
    ActiveUploads::Get().Remove(upload_id);
  }

 private:
  enum class State { kOpen, kFailed, kPublished, kAborted };
  struct Part {
    PartBuffer buffer;
    bool zeroed = false;  // the bytes not written are zeros
    std::map<uint64_t, uint64_t> written;
    bool sent = false;  // queued for upload (or uploaded)
  };

  Status Usable() {
    std::lock_guard<std::mutex> lock(mu_);
    return UsableLocked();
  }
  Status UsableLocked() const {
    switch (state_) {
      case State::kOpen:
        return Status::OK();
      case State::kFailed:
        return error_;
      case State::kPublished:
        return InvalidArgument(desc_ + ": already published");
      case State::kAborted:
        return InvalidArgument(desc_ + ": aborted");
    }
    return Status::OK();
  }

  Status AllocateLocked(Part& part) {
    if (part.buffer) return Status::OK();
    part.buffer = ctx_->buffers.Take(part_size_, &part.zeroed);
    if (!part.buffer) {
      return ResourceExhausted(desc_ + ": out of memory for a " + std::to_string(part_size_) +
                               "-byte upload part");
    }
    return Status::OK();
  }

  void FailLocked(Status s) {
    if (error_.ok()) error_ = std::move(s);
    if (state_ == State::kOpen) state_ = State::kFailed;
  }

  // A reused buffer holds old bytes: zeroes the ranges of [0, len) that were not written.
  static void ZeroGapsLocked(Part& part, uint64_t len) {
    if (part.zeroed) return;
    uint64_t pos = 0;
    for (const auto& [a, b] : part.written) {
      if (a > pos && pos < len) std::memset(part.buffer.get() + pos, 0, std::min(a, len) - pos);
      pos = std::max(pos, b);
    }
    if (pos < len) std::memset(part.buffer.get() + pos, 0, len - pos);
    part.zeroed = true;
  }

  void StartUploadLocked(uint64_t index, uint64_t len) {
    Part& part = parts_[index];
    ZeroGapsLocked(part, len);
    part.sent = true;
    ++in_flight_;
    const std::byte* data = part.buffer.get();
    ctx_->pool.Submit([this, index, data, len] {
      bool doomed;  // aborted or failed while queued: no point in sending it
      {
        std::lock_guard<std::mutex> lock(mu_);
        doomed = state_ == State::kAborted || state_ == State::kFailed;
      }
      Status s = doomed ? Cancelled(desc_ + ": part upload cancelled")
                        : UploadPart(index, std::span<const std::byte>(data, len));
      std::lock_guard<std::mutex> lock(mu_);
      FinishUploadLocked(index, std::move(s));
    });
  }

  // A part's upload ended (on the pool, or a direct one on the writer's thread): its buffer
  // (none for a direct upload) goes back for reuse, or the object fails; waiters wake up.
  void FinishUploadLocked(uint64_t index, Status s) {
    if (s.ok()) {
      ctx_->buffers.Give(std::move(parts_[index].buffer), part_size_);
      parts_[index].written.clear();
    } else {
      FailLocked(std::move(s));
    }
    --in_flight_;
    cv_.notify_all();
  }

  // Starts the multipart upload once (from whichever part upload comes first).
  Status EnsureUpload() {
    std::lock_guard<std::mutex> lock(create_mu_);
    if (!upload_id_.empty()) return Status::OK();
    SP_RETURN_IF_ERROR(create_error_);
    S3Request req;
    req.method = "POST";
    req.key = key_;
    req.query = {{"uploads", ""}};
    const std::string what = "CreateMultipartUpload " + desc_;
    auto r = ctx_->client->Execute(req, what);
    Status s = r.ok() ? (Ok2xx(*r) ? Status::OK() : HttpError(*r, what, ctx_->client->endpoint()))
                      : r.status();
    std::string id;
    if (s.ok()) {
      id = s3::XmlText(r->body, "UploadId");
      if (id.empty()) s = IOError(what + ": no UploadId in the answer");
    }
    if (!s.ok()) {
      create_error_ = s;
      return s;
    }
    ActiveUploads::Get().Add(id);
    std::lock_guard<std::mutex> state_lock(mu_);
    upload_id_ = id;
    return Status::OK();
  }

  std::string UploadId() {
    std::lock_guard<std::mutex> lock(mu_);
    return upload_id_;
  }

  Status UploadPart(uint64_t index, std::span<const std::byte> data) {
    SP_RETURN_IF_ERROR(EnsureUpload());
    S3Request req;
    req.method = "PUT";
    req.key = key_;
    req.query = {{"partNumber", std::to_string(index + 1)}, {"uploadId", UploadId()}};
    req.body = data;
    const std::string what = "UploadPart " + std::to_string(index + 1) + " of " + desc_;
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
    if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
    std::string etag = r.Header("etag");
    if (etag.empty()) return IOError(what + ": no ETag in the answer");
    std::lock_guard<std::mutex> lock(mu_);
    etags_[index] = std::move(etag);
    return Status::OK();
  }

  // HEAD of the key: OK when absent, AlreadyExists when present.
  Status CheckAbsent() {
    const std::string what = "HEAD " + desc_;
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->Head(key_, what));
    if (r.http_status == 404) return Status::OK();
    if (Ok2xx(r)) return AlreadyExists(desc_ + ": already exists");
    return HttpError(r, what, ctx_->client->endpoint());
  }

  Status DoPublish(bool exclusive) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (state_ == State::kPublished || state_ == State::kAborted) return UsableLocked();
      cv_.wait(lock, [&] { return in_flight_ == 0; });
    }
    Status s = PublishParts(exclusive);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = State::kPublished;
      for (auto& [index, part] : parts_) ctx_->buffers.Give(std::move(part.buffer), part_size_);
      parts_.clear();
      if (!upload_id_.empty()) ActiveUploads::Get().Remove(upload_id_);
      return s;
    }
    Abort();
    return s;
  }

  Status PublishParts(bool exclusive) {
    bool single;
    uint64_t end;
    {
      std::lock_guard<std::mutex> lock(mu_);
      SP_RETURN_IF_ERROR(UsableLocked());
      end = end_;
      single = upload_id_.empty() && create_error_.ok() && end_ <= part_size_;
    }
    if (exclusive) SP_RETURN_IF_ERROR(CheckAbsent());
    if (single) return PutWhole(exclusive, end);

    // The parts not uploaded yet (incomplete ones zero-filled, the last one short), in parallel.
    const uint64_t last = (end - 1) / part_size_;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (uint64_t i = 0; i <= last; ++i) {
        Part& part = parts_[i];
        if (part.sent) continue;
        Status a = AllocateLocked(part);
        if (!a.ok()) {
          FailLocked(a);
          break;
        }
        StartUploadLocked(i, i == last ? end - i * part_size_ : part_size_);
      }
      cv_.wait(lock, [&] { return in_flight_ == 0; });
      SP_RETURN_IF_ERROR(UsableLocked());
    }
    return Complete(exclusive, last + 1, end);
  }

  Status PutWhole(bool exclusive, uint64_t end) {
    S3Request req;
    req.method = "PUT";
    req.key = key_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = parts_.find(0);
      if (it != parts_.end() && it->second.buffer) {
        ZeroGapsLocked(it->second, end);
        req.body = {it->second.buffer.get(), end};
      }
    }
    static const std::byte kZero[1] = {};
    if (req.body.size() != end) {
      // Nothing written yet everything zero (e.g. a lone zero-length write): an empty object.
      req.body = std::span<const std::byte>(kZero, 0);
    }
    if (exclusive) req.headers.emplace_back("If-None-Match", "*");
    const std::string what = "PUT " + desc_;
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
    if (exclusive && r.http_status == 412) return AlreadyExists(desc_ + ": already exists");
    if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
    return Status::OK();
  }

  Status Complete(bool exclusive, uint64_t parts, uint64_t end) {
    std::string xml = "<CompleteMultipartUpload>";
    std::string upload_id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      upload_id = upload_id_;
      for (uint64_t i = 0; i < parts; ++i) {
        xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
               s3::XmlEscape(etags_[i]) + "</ETag></Part>";
      }
    }
    xml += "</CompleteMultipartUpload>";
    S3Request req;
    req.method = "POST";
    req.key = key_;
    req.query = {{"uploadId", upload_id}};
    req.body = std::as_bytes(std::span(xml.data(), xml.size()));
    req.headers.emplace_back("Content-Type", "application/xml");
    if (exclusive) req.headers.emplace_back("If-None-Match", "*");
    const std::string what = "CompleteMultipartUpload " + desc_;
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
    if (exclusive && r.http_status == 412) return AlreadyExists(desc_ + ": already exists");
    if (r.http_status == 404 && r.ErrorCode() == "NoSuchUpload") {
      // A retried Complete whose first attempt succeeded but whose answer was lost: the
      // object is there with our size. (Anything else is a real failure.)
      auto h = ctx_->Head(key_, "HEAD " + desc_);
      if (h.ok() && Ok2xx(*h) && h->Header("content-length") == std::to_string(end)) {
        return Status::OK();
      }
    }
    if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
    // S3 may answer 200 and report the failure in the body.
    if (r.body.find("<Error>") != std::string::npos) {
      S3Response e = r;
      e.http_status = 500;
      return HttpError(e, what, ctx_->client->endpoint());
    }
    return Status::OK();
  }

  const std::shared_ptr<S3Context> ctx_;
  const std::string key_;
  const std::string desc_;
  const uint64_t part_size_;

  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kOpen;
  Status error_;
  std::map<uint64_t, Part> parts_;  // by part index; entries are never removed while open
  std::map<uint64_t, std::string> etags_;
  uint64_t end_ = 0;       // end of the furthest write: the object's size
  size_t in_flight_ = 0;   // part uploads queued or running
  std::string upload_id_;  // set once under both mutexes
  std::mutex create_mu_;
  Status create_error_;  // guarded by create_mu_ (read under mu_ only after uploads drained)
};

// ---- reading ------------------------------------------------------------------------------------

class S3ReadableObject final : public ReadableObject {
 public:
  S3ReadableObject(std::shared_ptr<S3Context> ctx, std::string name, uint64_t size,
                   std::string etag)
      : ctx_(std::move(ctx)),
        key_(ctx_->Key(name)),
        desc_(ctx_->Describe(name)),
        size_(size),
        etag_(std::move(etag)) {}

  uint64_t size() const override { return size_; }

  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset > size_ || dst.size() > size_ - offset) {
      return Corruption(desc_ + ": truncated: read of " + std::to_string(dst.size()) +
                        " bytes at offset " + std::to_string(offset) + " but the object has " +
                        std::to_string(size_) + " bytes");
    }
    if (dst.empty()) return Status::OK();
    // One ranged GET per part-sized piece: the request shape of the upload, and the one
    // capabilities() asks large readers for (one piece per call, on this thread).
    const uint64_t piece_size = ctx_->options.part_size;
    const uint64_t pieces = (dst.size() + piece_size - 1) / piece_size;
    if (pieces == 1) return GetRange(offset, dst);
    // Pieces 1.. on the pool, piece 0 on this thread.
    TaskGroup group;
    for (uint64_t i = 1; i < pieces; ++i) {
      const uint64_t off = i * piece_size;
      auto piece = dst.subspan(off, std::min<uint64_t>(piece_size, dst.size() - off));
      group.Add();
      ctx_->pool.Submit(
          [this, &group, offset, off, piece] { group.Done(GetRange(offset + off, piece)); });
    }
    Status first = GetRange(offset, dst.subspan(0, piece_size));
    Status rest = group.Wait();
    return first.ok() ? rest : first;
  }

 private:
  Status GetRange(uint64_t offset, std::span<std::byte> dst) const {
    S3Request req;
    req.key = key_;
    req.headers.emplace_back(
        "Range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + dst.size() - 1));
    if (!etag_.empty()) req.headers.emplace_back("If-Match", etag_);
    req.receive_into = dst;
    req.has_receive_into = true;
    const std::string what = "GET " + desc_ + " (" + std::to_string(dst.size()) +
                             " bytes at offset " + std::to_string(offset) + ")";
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
    if (r.http_status == 412) {
      return IOError(desc_ + ": replaced or deleted while being read (ETag " + etag_ +
                     " no longer matches)");
    }
    if (r.http_status == 416) {
      return Corruption(desc_ + ": truncated: read of " + std::to_string(dst.size()) +
                        " bytes at offset " + std::to_string(offset) + " (HTTP 416)");
    }
    if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
    if (r.http_status != 206 && !(offset == 0 && dst.size() == size_)) {
      return IOError(what + ": the server ignored the Range header (HTTP " +
                     std::to_string(r.http_status) + ")");
    }
    if (r.received != dst.size()) {
      return IOError(what + ": got " + std::to_string(r.received) + " bytes");
    }
    return Status::OK();
  }

  const std::shared_ptr<S3Context> ctx_;
  const std::string key_;
  const std::string desc_;
  const uint64_t size_;
  const std::string etag_;
};

// ---- the storage --------------------------------------------------------------------------------

class S3Storage final : public Storage, public internal::CancellableStorage {
 public:
  explicit S3Storage(std::shared_ptr<S3Context> ctx) : ctx_(std::move(ctx)) {}

  // Objects made by this storage share its client: their requests end too.
  void CancelRequests() override { ctx_->client->Cancel(); }

  const std::string& uri() const override { return ctx_->uri; }

  StorageCapabilities capabilities() const override {
    // Large reads and writes: whole parts, one per connection.
    return StorageCapabilities{.atomic_rename = true,
                               .direct_io = false,
                               .durable = true,
                               .preferred_io_size = ctx_->options.part_size,
                               .io_parallelism = ctx_->options.connections};
  }

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                 uint64_t size_hint) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    uint64_t part = ctx_->options.part_size;
    if (size_hint > part * kMaxParts) {
      part = std::min(kMaxPartSize,
                      ((size_hint + kMaxParts - 1) / kMaxParts + kMiB - 1) / kMiB * kMiB);
    }
    return std::unique_ptr<WritableObject>(
        std::make_unique<S3WritableObject>(ctx_, std::string(name), part));
  }

  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    const std::string what = "HEAD " + ctx_->Describe(name);
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->Head(ctx_->Key(name), what));
    if (r.http_status == 404) return NotFound(ctx_->Describe(name) + ": no such object");
    if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
    uint64_t size = 0;
    const std::string len = r.Header("content-length");
    auto [p, ec] = std::from_chars(len.data(), len.data() + len.size(), size);
    if (ec != std::errc() || p != len.data() + len.size()) {
      return IOError(what + ": no valid Content-Length in the answer");
    }
    return std::unique_ptr<ReadableObject>(
        std::make_unique<S3ReadableObject>(ctx_, std::string(name), size, r.Header("etag")));
  }

  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
    std::vector<ObjectInfo> out;
    std::string token;
    const std::string what = "ListObjectsV2 " + ctx_->Describe(prefix);
    while (true) {
      S3Request req;
      req.query = {{"list-type", "2"}, {"prefix", ctx_->Key(prefix)}};
      if (!token.empty()) req.query.emplace_back("continuation-token", token);
      SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
      if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
      for (std::string_view c : s3::XmlElements(r.body, "Contents")) {
        const std::string key = s3::XmlText(c, "Key");
        if (!key.starts_with(ctx_->root)) continue;
        ObjectInfo info;
        info.name = key.substr(ctx_->root.size());
        // Keys that are no valid object name (a console's "dir/" marker) are not ours.
        if (!ValidateObjectName(info.name).ok()) continue;
        const std::string size = s3::XmlText(c, "Size");
        std::from_chars(size.data(), size.data() + size.size(), info.size);
        info.mtime_ns = s3::ParseIso8601Ns(s3::XmlText(c, "LastModified"));
        out.push_back(std::move(info));
      }
      if (s3::XmlText(r.body, "IsTruncated") != "true") break;
      token = s3::XmlText(r.body, "NextContinuationToken");
      if (token.empty()) return IOError(what + ": truncated listing without a continuation token");
    }
    std::sort(out.begin(), out.end(),
              [](const ObjectInfo& a, const ObjectInfo& b) { return a.name < b.name; });
    return out;
  }

  Status Delete(std::string_view name) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    S3Request req;
    req.method = "DELETE";
    req.key = ctx_->Key(name);
    const std::string what = "DELETE " + ctx_->Describe(name);
    SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
    if (Ok2xx(r) || r.http_status == 404) return Status::OK();
    return HttpError(r, what, ctx_->client->endpoint());
  }

  Result<size_t> RemoveLeftovers(std::string_view prefix,
                                 const LeftoverFilter& remove_if) override {
    SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
    const std::string what = "ListMultipartUploads " + ctx_->Describe(prefix);
    std::vector<std::pair<std::string, std::string>> doomed;  // key, upload id
    std::string key_marker, id_marker;
    while (true) {
      S3Request req;
      req.query = {{"uploads", ""}, {"prefix", ctx_->Key(prefix)}};
      if (!key_marker.empty()) req.query.emplace_back("key-marker", key_marker);
      if (!id_marker.empty()) req.query.emplace_back("upload-id-marker", id_marker);
      SP_ASSIGN_OR_RETURN(S3Response r, ctx_->client->Execute(req, what));
      if (!Ok2xx(r)) return HttpError(r, what, ctx_->client->endpoint());
      for (std::string_view u : s3::XmlElements(r.body, "Upload")) {
        const std::string key = s3::XmlText(u, "Key");
        const std::string id = s3::XmlText(u, "UploadId");
        if (!key.starts_with(ctx_->root) || id.empty()) continue;
        const std::string name = key.substr(ctx_->root.size());
        if (ActiveUploads::Get().Contains(id)) continue;
        if (remove_if && !remove_if(name)) continue;
        doomed.emplace_back(key, id);
      }
      if (s3::XmlText(r.body, "IsTruncated") != "true") break;
      key_marker = s3::XmlText(r.body, "NextKeyMarker");
      id_marker = s3::XmlText(r.body, "NextUploadIdMarker");
      if (key_marker.empty()) return IOError(what + ": truncated listing without a NextKeyMarker");
    }
    size_t removed = 0;
    for (const auto& [key, id] : doomed) {
      const std::string abort_what = "AbortMultipartUpload " + ctx_->uri + "/" +
                                     key.substr(ctx_->root.size()) + " (upload " + id + ")";
      SP_ASSIGN_OR_RETURN(S3Response r, ctx_->AbortUpload(key, id, abort_what));
      if (Ok2xx(r)) {
        ++removed;
      } else if (r.http_status != 404) {
        return HttpError(r, abort_what, ctx_->client->endpoint());
      }
    }
    return removed;
  }

  std::string Describe(std::string_view name) const override { return ctx_->Describe(name); }

 private:
  const std::shared_ptr<S3Context> ctx_;
};

Status ParseOptions(std::string_view uri, std::string_view query, S3Options* o) {
  using internal::BadStorageUri;
  for (const auto& [key, value] : internal::SplitUriQuery(query)) {
    const std::string v(value);
    if (key == "timeout") {
      const std::optional<double> t = internal::ParseSeconds(value);
      if (!t) return BadStorageUri(uri, "timeout=" + v + " is not a positive number of seconds");
      o->timeout_s = *t;
    } else if (key == "retries") {
      const std::optional<int64_t> n =
          internal::ParseWholeNumber(value, 0, internal::kMaxUriRetries);
      if (!n) {
        return BadStorageUri(uri, "retries=" + v + " is not a number from 0 to " +
                                      std::to_string(internal::kMaxUriRetries));
      }
      o->retries = static_cast<int>(*n);
    } else if (key == "part_size") {
      const std::optional<uint64_t> n = internal::ParseByteSize(value);
      if (!n || *n < kMinPartSize || *n > kMaxPartSize) {
        return BadStorageUri(uri, "part_size=" + v + " is not a size from 5M to 5G");
      }
      o->part_size = *n;
    } else if (key == "connections") {
      const std::optional<int64_t> n = internal::ParseWholeNumber(value, 1, 256);
      if (!n) return BadStorageUri(uri, "connections=" + v + " is not a number from 1 to 256");
      o->connections = static_cast<size_t>(*n);
    } else {
      return BadStorageUri(uri, "unknown option \"" + std::string(key) +
                                    "\" (known: timeout, retries, part_size, connections)");
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<Storage>> OpenS3Storage(std::string_view uri, std::string_view rest) {
  std::string_view query;
  if (const size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  const size_t slash = rest.find('/');
  const std::string bucket(rest.substr(0, slash));
  std::string prefix(slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1));
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (bucket.empty()) {
    return internal::BadStorageUri(uri, "no bucket (s3://BUCKET/PREFIX)");
  }
  // Not shown: a name that is no bucket name may be a secret typed into the URI ("s3://KEY:SECRET"
  // before a '@' that split_ref took for a version's).
  if (!std::all_of(bucket.begin(), bucket.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
      })) {
    return internal::BadStorageUri(
        "s3://<invalid bucket name>" + (prefix.empty() ? std::string() : "/" + prefix),
        "a bucket name has only letters, digits, '.', '-' and '_' (credentials go in the "
        "environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)");
  }
  if (!prefix.empty()) {
    Status s = ValidateObjectName(prefix);
    if (!s.ok()) return internal::BadStorageUri(uri, s.message());
  }
  S3Options options;
  SP_RETURN_IF_ERROR(ParseOptions(uri, query, &options));
  auto config = s3::ResolveS3Config();
  if (!config.ok()) return config.status().WithContext("storage URI \"" + std::string(uri) + "\"");
  config->timeout_s = options.timeout_s.value_or(config->timeout_s);
  config->retries = options.retries.value_or(config->retries);
  std::string clean = "s3://" + bucket + (prefix.empty() ? "" : "/" + prefix);
  auto ctx =
      std::make_shared<S3Context>(std::make_unique<S3Client>(*std::move(config), bucket),
                                  std::move(clean), prefix.empty() ? "" : prefix + "/", options);
  return std::unique_ptr<Storage>(std::make_unique<S3Storage>(std::move(ctx)));
}

}  // namespace safepoint
