// MemoryStorage: Storage kept in process memory, for tests and for "mem://" URIs.
//
// Objects are immutable byte vectors held by shared_ptr in a name-sorted map guarded by a mutex;
// a ReadableObject keeps the version it opened alive, so that replacing or deleting an object
// does not disturb readers (as with an open POSIX file). Instances created with the same
// non-empty name share one map that lives until the process exits, like one directory opened
// twice; an empty name gives a private map. A WritableObject owns its bytes until Publish() moves
// them into the map, so temporaries are never visible and there are never leftovers to remove.
// Nothing is durable: capabilities().durable is false.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "base/clock.h"
#include "safepoint/storage.h"

namespace safepoint {

namespace {

using Bytes = std::vector<std::byte>;

struct StoredObject {
  std::shared_ptr<const Bytes> data;
  int64_t mtime_ns = 0;
};

// The objects of one named (or private) memory storage.
struct ObjectMap {
  std::mutex mu;
  std::map<std::string, StoredObject, std::less<>> objects;
};

std::shared_ptr<ObjectMap> SharedObjectMap(const std::string& name) {
  if (name.empty()) return std::make_shared<ObjectMap>();
  static std::mutex* mu = new std::mutex();
  static auto* maps = new std::map<std::string, std::shared_ptr<ObjectMap>>();
  std::lock_guard<std::mutex> lock(*mu);
  auto& map = (*maps)[name];
  if (!map) map = std::make_shared<ObjectMap>();
  return map;
}

class MemoryWritableObject final : public WritableObject {
 public:
  MemoryWritableObject(std::shared_ptr<ObjectMap> map, std::string name, std::string path,
                       uint64_t size_hint)
      : map_(std::move(map)), name_(std::move(name)), path_(std::move(path)) {
    // Reserving is only a hint: a hint larger than memory allows is not an error here.
    if (size_hint > 0 && size_hint <= (uint64_t{1} << 34)) {
      try {
        data_.reserve(size_hint);
      } catch (const std::bad_alloc&) {
      }
    }
  }

  ~MemoryWritableObject() override { Abort(); }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (data.size() > UINT64_MAX - offset) {
      return InvalidArgument(path_ + ": write of " + std::to_string(data.size()) +
                             " bytes at offset " + std::to_string(offset) + " overflows");
    }
    const uint64_t end = offset + data.size();
    {
      // Writes that fit the current size copy in parallel under the shared lock; only growing
      // the vector needs the exclusive lock.
      std::shared_lock<std::shared_mutex> lock(mu_);
      if (state_ != State::kWriting) return NotWritable();
      if (end <= data_.size()) {
        if (!data.empty()) std::memcpy(data_.data() + offset, data.data(), data.size());
        return Status::OK();
      }
    }
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (state_ != State::kWriting) return NotWritable();
    if (end > data_.size()) {
      try {
        data_.resize(end);
      } catch (const std::bad_alloc&) {
        return ResourceExhausted(path_ + ": out of memory growing the object to " +
                                 std::to_string(end) + " bytes");
      } catch (const std::length_error&) {
        return ResourceExhausted(path_ + ": object size " + std::to_string(end) + " too large");
      }
    }
    if (!data.empty()) std::memcpy(data_.data() + offset, data.data(), data.size());
    return Status::OK();
  }

  Status Publish() override { return PublishAs(/*exclusive=*/false); }
  Status PublishIfAbsent() override { return PublishAs(/*exclusive=*/true); }

  void Abort() override {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (state_ != State::kWriting) return;
    state_ = State::kAborted;
    Bytes().swap(data_);
  }

 private:
  enum class State { kWriting, kPublished, kAborted };

  Status NotWritable() const {
    return InvalidArgument(
        path_ + (state_ == State::kPublished ? ": already published" : ": write was aborted"));
  }

  // The check for an existing object and the insertion happen under the map's lock.
  Status PublishAs(bool exclusive) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (state_ != State::kWriting) return NotWritable();
    std::lock_guard<std::mutex> map_lock(map_->mu);
    if (exclusive && map_->objects.contains(name_)) {
      state_ = State::kAborted;
      Bytes().swap(data_);
      return AlreadyExists(path_ + ": already exists (not replaced)");
    }
    auto published = std::make_shared<const Bytes>(std::move(data_));
    data_ = Bytes();
    state_ = State::kPublished;
    map_->objects[name_] = StoredObject{std::move(published), UnixNanos()};
    return Status::OK();
  }

  const std::shared_ptr<ObjectMap> map_;
  const std::string name_;
  const std::string path_;
  mutable std::shared_mutex mu_;
  State state_ = State::kWriting;
  Bytes data_;
};

class MemoryReadableObject final : public ReadableObject {
 public:
  MemoryReadableObject(std::shared_ptr<const Bytes> data, std::string path)
      : data_(std::move(data)), path_(std::move(path)) {}

  uint64_t size() const override { return data_->size(); }

  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    const uint64_t size = data_->size();
    if (offset > size || dst.size() > size - offset) {
      return Corruption(path_ + ": truncated: wanted " + std::to_string(dst.size()) +
                        " bytes at offset " + std::to_string(offset) + ", object has " +
                        std::to_string(size) + " bytes");
    }
    if (!dst.empty()) std::memcpy(dst.data(), data_->data() + offset, dst.size());
    return Status::OK();
  }

 private:
  const std::shared_ptr<const Bytes> data_;
  const std::string path_;
};

class MemoryStorage final : public Storage {
 public:
  explicit MemoryStorage(std::string name) : uri_("mem://" + name), map_(SharedObjectMap(name)) {}

  const std::string& uri() const override { return uri_; }

  StorageCapabilities capabilities() const override {
    StorageCapabilities caps;
    caps.atomic_rename = true;
    caps.direct_io = false;
    caps.durable = false;
    caps.requests_end_with_process = true;
    return caps;
  }

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                 uint64_t size_hint) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    return std::unique_ptr<WritableObject>(
        std::make_unique<MemoryWritableObject>(map_, std::string(name), Describe(name), size_hint));
  }

  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    std::shared_ptr<const Bytes> data;
    {
      std::lock_guard<std::mutex> lock(map_->mu);
      auto it = map_->objects.find(name);
      if (it == map_->objects.end()) return NotFound(Describe(name) + ": no such object");
      data = it->second.data;
    }
    return std::unique_ptr<ReadableObject>(
        std::make_unique<MemoryReadableObject>(std::move(data), Describe(name)));
  }

  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
    std::vector<ObjectInfo> out;
    std::lock_guard<std::mutex> lock(map_->mu);
    for (auto it = map_->objects.lower_bound(prefix);
         it != map_->objects.end() && std::string_view(it->first).starts_with(prefix); ++it) {
      out.push_back(ObjectInfo{it->first, it->second.data->size(), it->second.mtime_ns});
    }
    return out;
  }

  Status Delete(std::string_view name) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    std::lock_guard<std::mutex> lock(map_->mu);
    auto it = map_->objects.find(name);
    if (it != map_->objects.end()) map_->objects.erase(it);
    return Status::OK();
  }

  Result<size_t> RemoveLeftovers(std::string_view prefix, const LeftoverFilter&) override {
    SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
    return size_t{0};  // temporaries live in their WritableObject and die with it
  }

  std::string Describe(std::string_view name) const override {
    std::string out = uri_;
    if (!out.ends_with("//")) out += '/';
    out += name;
    return out;
  }

 private:
  const std::string uri_;
  const std::shared_ptr<ObjectMap> map_;
};

}  // namespace

std::unique_ptr<Storage> NewMemoryStorage(std::string name) {
  return std::make_unique<MemoryStorage>(std::move(name));
}

}  // namespace safepoint
