// CancellableStorage: what a Storage whose requests can block for long (a remote tier that
// stalls: S3, RADOS) offers so that its owner can end them within a grace period instead of
// after every request's timeout times its attempts. Private to the library; found on a Storage
// with dynamic_cast.
//
// CancelRequests() is final: every request in flight ends promptly with Cancelled (its socket
// wait or backoff is interrupted), and every later request fails with Cancelled without being
// sent. Thread-safe; callable from any thread while other threads use the storage.
#pragma once

namespace safepoint::internal {

class CancellableStorage {
 public:
  virtual void CancelRequests() = 0;

 protected:
  ~CancellableStorage() = default;
};

// Cancels the requests of `storage` if it is a CancellableStorage; nothing otherwise.
template <typename S>
void CancelStorageRequests(S& storage) {
  if (auto* c = dynamic_cast<CancellableStorage*>(&storage)) c->CancelRequests();
}

}  // namespace safepoint::internal
