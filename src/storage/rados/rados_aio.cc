// Parallel librados aio of RadosStorage, with retries and time bounds (rados_aio.h).
#include "storage/rados/rados_aio.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <rados/librados.hpp>
#include <thread>
#include <utility>

#include "storage/rados/rados_cluster.h"
#include "storage/uri_options.h"

namespace safepoint::internal::rados {

namespace {

constexpr int kBackstopSlackS = 10;                    // our own bound beyond librados's op timeout
constexpr std::chrono::milliseconds kCancelPoll{100};  // how often waits look at `cancelled`

std::chrono::steady_clock::time_point Now() { return std::chrono::steady_clock::now(); }

class AioBatch {
 public:
  AioBatch(const std::shared_ptr<Cluster>& cluster, int timeout_s, int retries,
           const std::atomic<bool>* cancelled)
      : cluster_(cluster), timeout_s_(timeout_s), retries_(retries), cancelled_(cancelled) {}

  void Run(std::vector<AioOp>& ops, size_t window) {
    std::vector<size_t> pending(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) pending[i] = i;
    if (!ops.empty()) RefreshMapIfSuspect(cluster_, timeout_s_, cancelled_);
    for (int attempt = 0; !pending.empty(); ++attempt) {
      if (attempt > 0) {
        const auto until = Now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(RetryBackoffSeconds(attempt)));
        while (!Cancelled() && Now() < until) {
          std::this_thread::sleep_for(
              std::min<std::chrono::steady_clock::duration>(kCancelPoll, until - Now()));
        }
        if (Cancelled()) {
          for (size_t i : pending) ops[i].rv = -ECANCELED;
          return;
        }
        // A timed-out op may have gone to an OSD that died and came back elsewhere: librados
        // learns the new address only from a newer OSD map, which it does not always ask for on
        // its own (a lone OSD killed and restarted: every retry would go to the dead address).
        RefreshMap(cluster_, timeout_s_, cancelled_);
      }
      RunRound(ops, pending, window);
      std::vector<size_t> again;
      for (size_t i : pending) {
        if (!Transient(ops[i].rv)) continue;
        if (attempt < retries_) {
          again.push_back(i);
        } else {
          cluster_->map_suspect.store(true, std::memory_order_release);  // for the next call
        }
      }
      pending = std::move(again);
    }
  }

 private:
  bool Cancelled() const {
    return cancelled_ != nullptr && cancelled_->load(std::memory_order_acquire);
  }

  struct Slot {
    AioBatch* batch;
    size_t index;
  };

  static void OnComplete(void*, void* arg) {  // rados_completion_t or librados::completion_t
    auto* slot = static_cast<Slot*>(arg);
    AioBatch* b = slot->batch;
    std::lock_guard<std::mutex> lock(b->mu_);
    b->done_.push_back(slot->index);
    b->cv_.notify_all();
  }

  // An op in flight. A read goes through librados's C++ API: its C API (rados_aio_read) copies
  // what arrived into the caller's buffer on the messenger thread that reads the OSD's socket,
  // the one thread every byte of a load passes (a profile of a 1 GiB load: 86% of the loading
  // process's samples on msgr-worker-0, 35% in that copy). The C++ API hands over the received
  // buffers instead; the copy into the caller's buffer runs in finish, on the thread that
  // called RunAio (a reader of ReadImage: several copy at once).
  struct InFlight {
    rados_completion_t c = nullptr;          // every other op (C API)
    librados::AioCompletion* cxx = nullptr;  // a read
    librados::IoCtx io;                      // a read's
    ceph::bufferlist received;               // a read's, until finish copies it out
    bool Complete() const { return cxx != nullptr ? cxx->is_complete() : rados_aio_is_complete(c); }
  };

  static int Submit(AioOp& op, InFlight& f, Slot* slot) {
    ++op.attempts;
    if (op.kind == AioOp::kRead) {
      librados::IoCtx::from_rados_ioctx_t(op.io, f.io);
      f.cxx = librados::Rados::aio_create_completion(slot, &AioBatch::OnComplete);
      if (f.cxx == nullptr) return -ENOMEM;
      return f.io.aio_read(op.oid, f.cxx, &f.received, op.len, op.off);
    }
    const int rv = rados_aio_create_completion2(slot, &AioBatch::OnComplete, &f.c);
    if (rv < 0) {
      f.c = nullptr;
      return rv;
    }
    rados_completion_t c = f.c;
    switch (op.kind) {
      case AioOp::kRead:
        return -EINVAL;  // above
      case AioOp::kWrite:
      case AioOp::kWriteFull:
      case AioOp::kCreateExclusive:
      case AioOp::kTouch:
      case AioOp::kRemove: {
        op.wop = rados_create_write_op();
        int flags = LIBRADOS_OPERATION_FULL_TRY;
        if (op.kind == AioOp::kWrite) {
          rados_write_op_write(op.wop, op.wbuf, op.len, op.off);
        } else if (op.kind == AioOp::kWriteFull) {
          rados_write_op_write_full(op.wop, op.wbuf, op.len);
        } else if (op.kind == AioOp::kCreateExclusive) {
          rados_write_op_create(op.wop, LIBRADOS_CREATE_EXCLUSIVE, nullptr);
          rados_write_op_write_full(op.wop, op.wbuf, op.len);
        } else if (op.kind == AioOp::kTouch) {
          rados_write_op_create(op.wop, LIBRADOS_CREATE_IDEMPOTENT, nullptr);
        } else {
          rados_write_op_remove(op.wop);
          flags = LIBRADOS_OPERATION_FULL_FORCE;
        }
        return rados_aio_write_op_operate(op.wop, op.io, c, op.oid.c_str(), nullptr, flags);
      }
    }
    return -EINVAL;
  }

  void RunRound(std::vector<AioOp>& ops, const std::vector<size_t>& pending, size_t window) {
    std::vector<Slot> slots(ops.size());
    std::vector<InFlight> flights(ops.size());
    size_t next = 0, inflight = 0;
    done_.clear();
    // Releases op i's completion (waiting for its result first: the callback may run before the
    // return value is ready) and, for a read, copies what arrived into the caller's buffer.
    auto finish = [&](size_t i) {
      AioOp& op = ops[i];
      InFlight& f = flights[i];
      if (f.cxx != nullptr) {
        f.cxx->wait_for_complete();
        op.rv = f.cxx->get_return_value();
        f.cxx->release();
        f.cxx = nullptr;
        if (op.rv >= 0) {
          const size_t n = std::min<size_t>(f.received.length(), op.len);
          f.received.begin().copy(static_cast<unsigned>(n), op.rbuf);
          op.rv = static_cast<int>(n);
        }
        f.received.clear();
        f.io.close();
      } else if (f.c != nullptr) {
        rados_aio_wait_for_complete(f.c);
        op.rv = rados_aio_get_return_value(f.c);
        rados_aio_release(f.c);
        f.c = nullptr;
      }
      if (op.wop) {
        rados_release_write_op(op.wop);
        op.wop = nullptr;
      }
    };
    while (next < pending.size() || inflight > 0) {
      while (next < pending.size() && inflight < window) {
        const size_t i = pending[next++];
        if (Cancelled()) {
          ops[i].rv = -ECANCELED;
          continue;
        }
        slots[i] = Slot{this, i};
        const int rv = Submit(ops[i], flights[i], &slots[i]);
        if (rv < 0) {
          // Not submitted: nothing will complete; release what was made.
          InFlight& f = flights[i];
          if (f.cxx != nullptr) f.cxx->release();
          if (f.c != nullptr) rados_aio_release(f.c);
          f = InFlight{};
          if (ops[i].wop) {
            rados_release_write_op(ops[i].wop);
            ops[i].wop = nullptr;
          }
          ops[i].rv = rv;
          continue;
        }
        ++inflight;
      }
      if (inflight == 0) continue;
      std::vector<size_t> finished;
      {
        std::unique_lock<std::mutex> lock(mu_);
        const auto bound = Now() + std::chrono::seconds(timeout_s_ + kBackstopSlackS);
        while (done_.empty() && !Cancelled() && Now() < bound) {
          cv_.wait_for(lock, kCancelPoll);
        }
        if (done_.empty()) {
          // librados did not time the ops out itself, or the storage is cancelled: cancel what
          // is in flight, then wait for the cancellations (each completes promptly with
          // ECANCELED).
          lock.unlock();
          for (size_t j = 0; j < ops.size(); ++j) {
            InFlight& f = flights[j];
            if ((f.cxx == nullptr && f.c == nullptr) || f.Complete()) continue;
            if (f.cxx != nullptr) {
              f.io.aio_cancel(f.cxx);
            } else {
              rados_aio_cancel(ops[j].io, f.c);
            }
          }
          lock.lock();
          cv_.wait(lock, [&] { return !done_.empty(); });
        }
        finished.swap(done_);
      }
      for (size_t i : finished) {
        finish(i);
        --inflight;
      }
    }
  }

  const std::shared_ptr<Cluster> cluster_;
  const int timeout_s_;
  const int retries_;
  const std::atomic<bool>* const cancelled_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<size_t> done_;
};

}  // namespace

void RunAio(const std::shared_ptr<Cluster>& cluster, int timeout_s, int retries,
            std::vector<AioOp>& ops, size_t window, const std::atomic<bool>* cancelled) {
  AioBatch(cluster, timeout_s, retries, cancelled).Run(ops, window);
}

bool Transient(int rv) {
  switch (-rv) {
    case ETIMEDOUT:
    case EAGAIN:
    case ENOTCONN:
    case ECONNRESET:
    case ECONNREFUSED:
    case ESHUTDOWN:
    case EBUSY:
    case EIO:
    case EINTR:
      return true;
    default:
      return false;
  }
}

Status OpStatus(const std::string& what, const AioOp& op, const std::string& pool, int timeout_s) {
  const int rv = op.rv;
  if (rv >= 0) return Status::OK();
  std::string m = what + ": " + RadosError(rv);
  if (op.attempts > 1) m += " (after " + std::to_string(op.attempts) + " attempts)";
  switch (-rv) {
    case ENOENT:
      return NotFound(std::move(m));
    case EDQUOT:
    case ENOSPC:
      return ResourceExhausted(what + ": pool \"" + pool +
                               "\" is full (quota or space: " + RadosError(rv) + ")");
    case EEXIST:
      return AlreadyExists(std::move(m));
    case ETIMEDOUT:
    case ECANCELED:
      return Unavailable(what + ": no answer within the " + std::to_string(timeout_s) +
                         " s timeout (" + RadosError(rv) + ", " + std::to_string(op.attempts) +
                         " attempts)");
    case ENOTCONN:
    case ECONNREFUSED:
    case ECONNRESET:
    case ESHUTDOWN:
    case EAGAIN:
    case EBUSY:
      return Unavailable(std::move(m));
    default:
      return IOError(std::move(m));
  }
}

std::string DataOid(const std::string& head_oid, const std::string& id, uint64_t chunk) {
  return head_oid + "@" + id + "." + std::to_string(chunk);
}

std::vector<AioOp> SplitAtChunks(const AioOp& proto, const std::string& head_oid,
                                 const std::string& id, uint64_t chunk_size, uint64_t offset,
                                 uint64_t len) {
  std::vector<AioOp> ops;
  ops.reserve((offset % chunk_size + len + chunk_size - 1) / chunk_size);
  const uint64_t end = offset + len;
  for (uint64_t pos = offset; pos < end;) {
    const uint64_t chunk = pos / chunk_size;
    const uint64_t in_chunk = pos - chunk * chunk_size;
    AioOp& op = ops.emplace_back(proto);
    op.oid = DataOid(head_oid, id, chunk);
    op.off = in_chunk;
    op.len = std::min(end - pos, chunk_size - in_chunk);
    if (op.wbuf != nullptr) op.wbuf += pos - offset;
    if (op.rbuf != nullptr) op.rbuf += pos - offset;
    pos += op.len;
  }
  return ops;
}

}  // namespace safepoint::internal::rados
