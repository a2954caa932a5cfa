#include "checkpoint/small_object.h"

#include <string>

namespace safepoint::internal {

Status WriteSmallObject(Storage& storage, std::string_view name, std::string_view data,
                        bool exclusive) {
  SP_ASSIGN_OR_RETURN(auto w, storage.Create(name, data.size()));
  SP_RETURN_IF_ERROR(w->WriteAt(0, {reinterpret_cast<const std::byte*>(data.data()), data.size()}));
  return exclusive ? w->PublishIfAbsent() : w->Publish();
}

Result<std::vector<std::byte>> ReadSmallObject(Storage& storage, std::string_view name,
                                               uint64_t max) {
  SP_ASSIGN_OR_RETURN(auto r, storage.Open(name));
  if (r->size() > max) {
    return Corruption(storage.Describe(name) + ": unexpectedly large (" +
                      std::to_string(r->size()) + " bytes)");
  }
  std::vector<std::byte> data(r->size());
  SP_RETURN_IF_ERROR(r->ReadAt(0, data));
  return data;
}

}  // namespace safepoint::internal
