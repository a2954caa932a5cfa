// CountedStorage: the wrapper OpenStorage puts around every backend so that each storage
// request this process makes is counted by scheme (include/safepoint/storage.h,
// StorageRequestCounts). The counts are process-wide relaxed atomics: a request costs one
// uncontended atomic add beside a syscall or a network round trip.
#include "storage/counted_storage.h"

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "storage/cancellable.h"

namespace safepoint {
namespace {

struct Counters {
  std::atomic<uint64_t> list{0}, head{0}, get{0}, create{0}, write{0}, put{0}, del{0}, cleanup{0},
      metadata_bytes{0}, data_bytes_read{0}, data_bytes_written{0};
};

class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry();  // never destroyed: storages may outlive statics
    return *r;
  }
  Counters* For(const std::string& scheme) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& c = by_scheme_[scheme];
    if (!c) c = std::make_unique<Counters>();
    return c.get();
  }
  std::vector<std::pair<std::string, StorageRequestCounts>> Snapshot() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<std::string, StorageRequestCounts>> out;
    for (const auto& [scheme, c] : by_scheme_) {
      StorageRequestCounts s;
      s.list = c->list.load(std::memory_order_relaxed);
      s.head = c->head.load(std::memory_order_relaxed);
      s.get = c->get.load(std::memory_order_relaxed);
      s.create = c->create.load(std::memory_order_relaxed);
      s.write = c->write.load(std::memory_order_relaxed);
      s.put = c->put.load(std::memory_order_relaxed);
      s.del = c->del.load(std::memory_order_relaxed);
      s.cleanup = c->cleanup.load(std::memory_order_relaxed);
      s.metadata_bytes = c->metadata_bytes.load(std::memory_order_relaxed);
      s.data_bytes_read = c->data_bytes_read.load(std::memory_order_relaxed);
      s.data_bytes_written = c->data_bytes_written.load(std::memory_order_relaxed);
      out.emplace_back(scheme, s);
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Counters>> by_scheme_;
};

inline void Inc(std::atomic<uint64_t>& a, uint64_t v = 1) {
  a.fetch_add(v, std::memory_order_relaxed);
}

class CountedWritable final : public WritableObject {
 public:
  CountedWritable(std::unique_ptr<WritableObject> inner, Counters* c, bool data)
      : inner_(std::move(inner)), c_(c), data_(data) {}
  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    Inc(c_->write);
    Inc(data_ ? c_->data_bytes_written : c_->metadata_bytes, data.size());
    return inner_->WriteAt(offset, data);
  }
  Status Publish() override {
    Inc(c_->put);
    return inner_->Publish();
  }
  Status PublishIfAbsent() override {
    Inc(c_->put);
    return inner_->PublishIfAbsent();
  }
  void Abort() override { inner_->Abort(); }

 private:
  std::unique_ptr<WritableObject> inner_;
  Counters* c_;
  bool data_;
};

class CountedReadable final : public ReadableObject {
 public:
  CountedReadable(std::unique_ptr<ReadableObject> inner, Counters* c, bool data)
      : inner_(std::move(inner)), c_(c), data_(data) {}
  uint64_t size() const override { return inner_->size(); }
  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    Inc(c_->get);
    Inc(data_ ? c_->data_bytes_read : c_->metadata_bytes, dst.size());
    return inner_->ReadAt(offset, dst);
  }

 private:
  std::unique_ptr<ReadableObject> inner_;
  Counters* c_;
  bool data_;
};

class CountedStorage final : public Storage, public internal::CancellableStorage {
 public:
  CountedStorage(std::unique_ptr<Storage> inner, Counters* c) : inner_(std::move(inner)), c_(c) {}

  const std::string& uri() const override { return inner_->uri(); }
  StorageCapabilities capabilities() const override { return inner_->capabilities(); }

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                 uint64_t size_hint) override {
    Inc(c_->create);
    auto w = inner_->Create(name, size_hint);
    if (!w.ok()) return w.status();
    return std::unique_ptr<WritableObject>(
        std::make_unique<CountedWritable>(std::move(*w), c_, IsDataObjectName(name)));
  }
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    Inc(c_->head);
    auto r = inner_->Open(name);
    if (!r.ok()) return r.status();
    return std::unique_ptr<ReadableObject>(
        std::make_unique<CountedReadable>(std::move(*r), c_, IsDataObjectName(name)));
  }
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    Inc(c_->list);
    auto l = inner_->List(prefix);
    if (l.ok()) {
      uint64_t bytes = 0;
      for (const ObjectInfo& o : *l) bytes += o.name.size() + 16;
      Inc(c_->metadata_bytes, bytes);
    }
    return l;
  }
  Status Delete(std::string_view name) override {
    Inc(c_->del);
    return inner_->Delete(name);
  }
  Result<size_t> RemoveLeftovers(std::string_view prefix,
                                 const LeftoverFilter& remove_if) override {
    Inc(c_->cleanup);
    return inner_->RemoveLeftovers(prefix, remove_if);
  }
  std::string Describe(std::string_view name) const override { return inner_->Describe(name); }
  void CancelRequests() override { internal::CancelStorageRequests(*inner_); }

 private:
  std::unique_ptr<Storage> inner_;
  Counters* c_;
};

}  // namespace

bool IsDataObjectName(std::string_view name) {
  if (name.starts_with("chunks/")) {
    return !name.starts_with("chunks/inflight/") && name != "chunks/gc-lock";
  }
  return name.ends_with(".img");
}

std::vector<std::pair<std::string, StorageRequestCounts>> StorageRequestCountsByScheme() {
  return Registry::Get().Snapshot();
}

namespace internal {

std::unique_ptr<Storage> CountRequests(std::unique_ptr<Storage> inner, std::string_view scheme) {
  if (!inner) return inner;
  return std::make_unique<CountedStorage>(std::move(inner),
                                          Registry::Get().For(std::string(scheme)));
}

}  // namespace internal
}  // namespace safepoint
