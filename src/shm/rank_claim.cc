// RankClaim (src/shm/rank_claim.h).
#include "shm/rank_claim.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "base/clock.h"
#include "base/random.h"
#include "base/unique_fd.h"

namespace safepoint {

namespace {

using internal::ProcessId;

constexpr char kClaimMagic[8] = {'S', 'P', 'C', 'L', 'A', 'I', 'M', '1'};
constexpr uint32_t kClaimVersion = 1;
constexpr uint64_t kClaimFileBytes = 4096;

struct FencedEntry {
  std::atomic<uint32_t> pid;
  std::atomic<uint32_t> by_pid;
  std::atomic<uint64_t> start_ticks;
  std::atomic<uint64_t> attempt;
  std::atomic<uint64_t> by_start_ticks;
  std::atomic<uint64_t> by_attempt;
  std::atomic<int64_t> time_ns;
};

// "2026-12-05 03:51:56 UTC" (the wall clock `ns` names), for messages.
std::string WallTime(int64_t ns) {
  const time_t secs = static_cast<time_t>(ns / 1000000000);
  struct tm tm {};
  ::gmtime_r(&secs, &tm);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// The file's layout. Only the atomics change after creation, and only the agent changes them:
// `seq` is odd while it writes the owner or a superseded entry (readers retry), `epoch` is also
// read alone by writers of slots on every save (one load).
struct ClaimHeader {
  char magic[8];
  uint32_t version;
  uint32_t rank;
  std::atomic<uint64_t> seq;
  std::atomic<uint64_t> epoch;
  std::atomic<uint64_t> attempt;
  std::atomic<uint32_t> owner_pid;
  std::atomic<uint32_t> superseded_total;  // ever recorded; entry i % kFencedSlots
  std::atomic<uint64_t> owner_start_ticks;
  std::atomic<int64_t> since_ns;
  FencedEntry superseded[RankClaim::kFencedSlots];
};
static_assert(sizeof(ClaimHeader) <= kClaimFileBytes);
static_assert(offsetof(ClaimHeader, epoch) == 24);  // docs/format.md, "Rank claim files"
static_assert(offsetof(ClaimHeader, owner_pid) == 40);
static_assert(offsetof(ClaimHeader, owner_start_ticks) == 48);
static_assert(offsetof(ClaimHeader, since_ns) == 56);
static_assert(offsetof(ClaimHeader, superseded) == 64 && sizeof(FencedEntry) == 48);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

ClaimHeader* HeaderOf(void* map) { return static_cast<ClaimHeader*>(map); }

}  // namespace

std::string ClaimPath(const std::string& job_dir, uint32_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "/claim-%05u", rank);
  return job_dir + buf;
}

RankClaim::~RankClaim() {
  if (map_ != nullptr) ::munmap(map_, kClaimFileBytes);
}

Result<std::unique_ptr<RankClaim>> RankClaim::Open(const std::string& job_dir, uint32_t rank) {
  auto c = std::unique_ptr<RankClaim>(new RankClaim());
  c->path_ = ClaimPath(job_dir, rank);
  c->rank_ = rank;
  const internal::UniqueFd fd(::open(c->path_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return ErrnoStatus("open", c->path_, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat", c->path_, errno);
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return InvalidArgument(c->path_ +
                           ": not a private regular file of this user; refusing to use it");
  }
  if (static_cast<uint64_t>(st.st_size) != kClaimFileBytes) {
    return Corruption(c->path_ + ": a rank's claim file has the wrong size");
  }
  void* p = ::mmap(nullptr, kClaimFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoStatus("mmap", c->path_, errno);
  c->map_ = p;
  c->ino_ = st.st_ino;
  const ClaimHeader* h = HeaderOf(c->map_);
  if (std::memcmp(h->magic, kClaimMagic, 8) != 0 || h->version != kClaimVersion ||
      h->rank != rank) {
    return Corruption(c->path_ + ": not a valid claim file of rank " + std::to_string(rank));
  }
  return c;
}

Result<std::unique_ptr<RankClaim>> RankClaim::OpenOrCreate(const std::string& job_dir,
                                                           uint32_t rank) {
  auto opened = Open(job_dir, rank);
  if (opened.ok() || opened.status().code() != StatusCode::kNotFound) return opened;
  const std::string path = ClaimPath(job_dir, rank);
  const std::string tmp = path + ".tmp." + internal::RandomHex16();
  {
    internal::UniqueFd fd(
        ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) return ErrnoStatus("create", tmp, errno);
    std::string bytes(kClaimFileBytes, '\0');
    std::memcpy(bytes.data(), kClaimMagic, 8);
    std::memcpy(bytes.data() + 8, &kClaimVersion, 4);
    std::memcpy(bytes.data() + 12, &rank, 4);
    // Epochs start at the wall clock: a claim removed and written again never repeats an epoch
    // that a process of the earlier one still holds.
    const uint64_t first_epoch = static_cast<uint64_t>(UnixNanos());
    std::memcpy(bytes.data() + offsetof(ClaimHeader, epoch), &first_epoch, 8);
    if (::pwrite(fd.get(), bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
      const Status s = ErrnoStatus("write", tmp, errno == 0 ? ENOSPC : errno);
      ::unlink(tmp.c_str());
      return s;
    }
  }
  // The agent is the claim's only writer (one agent per job), so nobody else creates it now.
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const Status s = ErrnoStatus("rename", tmp, errno);
    ::unlink(tmp.c_str());
    return s;
  }
  return Open(job_dir, rank);
}

uint64_t RankClaim::epoch() const { return HeaderOf(map_)->epoch.load(std::memory_order_seq_cst); }

ClaimOwner RankClaim::Owner() const {
  const ClaimHeader* h = HeaderOf(map_);
  ClaimOwner o;
  for (;;) {
    const uint64_t s1 = h->seq.load(std::memory_order_acquire);
    o.process.pid = h->owner_pid.load(std::memory_order_relaxed);
    o.process.start_ticks = h->owner_start_ticks.load(std::memory_order_relaxed);
    o.attempt = h->attempt.load(std::memory_order_relaxed);
    o.epoch = h->epoch.load(std::memory_order_relaxed);
    o.since_ns = h->since_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if ((s1 & 1) == 0 && h->seq.load(std::memory_order_relaxed) == s1) return o;
  }
}

std::vector<SupersededProcess> RankClaim::Superseded() const {
  const ClaimHeader* h = HeaderOf(map_);
  for (;;) {
    const uint64_t s1 = h->seq.load(std::memory_order_acquire);
    std::vector<SupersededProcess> out;
    const uint32_t total = h->superseded_total.load(std::memory_order_relaxed);
    const uint32_t n = std::min(total, kFencedSlots);
    for (uint32_t i = 0; i < n; ++i) {
      const FencedEntry& e = h->superseded[(total - 1 - i) % kFencedSlots];  // newest first
      SupersededProcess s;
      s.process = {e.pid.load(std::memory_order_relaxed),
                   e.start_ticks.load(std::memory_order_relaxed)};
      s.attempt = e.attempt.load(std::memory_order_relaxed);
      s.by = {e.by_pid.load(std::memory_order_relaxed),
              e.by_start_ticks.load(std::memory_order_relaxed)};
      s.by_attempt = e.by_attempt.load(std::memory_order_relaxed);
      s.time_ns = e.time_ns.load(std::memory_order_relaxed);
      out.push_back(s);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if ((s1 & 1) == 0 && h->seq.load(std::memory_order_relaxed) == s1) return out;
  }
}

std::optional<SupersededProcess> RankClaim::FindSuperseded(const ProcessId& p) const {
  if (p.pid == 0) return std::nullopt;
  for (const SupersededProcess& s : Superseded()) {
    if (s.process == p) return s;
  }
  return std::nullopt;
}

uint64_t RankClaim::SetOwner(const ProcessId& owner, uint64_t attempt) {
  ClaimHeader* h = HeaderOf(map_);
  const bool same = h->owner_pid.load(std::memory_order_relaxed) == owner.pid &&
                    h->owner_start_ticks.load(std::memory_order_relaxed) == owner.start_ticks;
  if (same && h->attempt.load(std::memory_order_relaxed) == attempt) {
    return h->epoch.load(std::memory_order_relaxed);
  }
  const uint64_t seq = h->seq.load(std::memory_order_relaxed);
  h->seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  h->owner_pid.store(owner.pid, std::memory_order_relaxed);
  h->owner_start_ticks.store(owner.start_ticks, std::memory_order_relaxed);
  h->attempt.store(attempt, std::memory_order_relaxed);
  if (!same) h->since_ns.store(UnixNanos(), std::memory_order_relaxed);
  // The takeover's point: a writer that loads the epoch after this store sees itself
  // superseded. Sequentially consistent, and before the agent looks at the slots (arena.cc).
  const uint64_t epoch = h->epoch.load(std::memory_order_relaxed) + (same ? 0 : 1);
  h->epoch.store(epoch, std::memory_order_seq_cst);
  h->seq.store(seq + 2, std::memory_order_release);
  return epoch;
}

void RankClaim::AddSuperseded(const SupersededProcess& s) {
  ClaimHeader* h = HeaderOf(map_);
  const uint64_t seq = h->seq.load(std::memory_order_relaxed);
  h->seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  const uint32_t total = h->superseded_total.load(std::memory_order_relaxed);
  FencedEntry& e = h->superseded[total % kFencedSlots];
  e.pid.store(s.process.pid, std::memory_order_relaxed);
  e.start_ticks.store(s.process.start_ticks, std::memory_order_relaxed);
  e.attempt.store(s.attempt, std::memory_order_relaxed);
  e.by_pid.store(s.by.pid, std::memory_order_relaxed);
  e.by_start_ticks.store(s.by.start_ticks, std::memory_order_relaxed);
  e.by_attempt.store(s.by_attempt, std::memory_order_relaxed);
  e.time_ns.store(s.time_ns, std::memory_order_relaxed);
  h->superseded_total.store(total + 1, std::memory_order_relaxed);
  h->seq.store(seq + 2, std::memory_order_release);
}

Status RemoveClaimUnlessNeeded(const std::string& job_dir, uint32_t rank) {
  auto claim = RankClaim::Open(job_dir, rank);
  if (!claim.ok()) {
    return claim.status().code() == StatusCode::kNotFound ? Status::OK() : claim.status();
  }
  for (const SupersededProcess& s : (*claim)->Superseded()) {
    if (internal::ProcessAlive(s.process)) return Status::OK();  // it must stay refused
  }
  const std::string path = ClaimPath(job_dir, rank);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink", path, errno);
  return Status::OK();
}

std::string SupersededMessage(const std::string& job_dir, uint32_t rank, const ProcessId& self,
                              const ClaimOwner& owner) {
  std::string msg = job_dir + ": rank " + std::to_string(rank) +
                    " belongs to a newer run of the job on this node";
  if (owner.process.pid != 0) {
    msg += " (process " + std::to_string(owner.process.pid) + ", save attempt " +
           std::to_string(owner.attempt) + ", since " + WallTime(owner.since_ns) + ")";
  }
  msg += "; this process (pid " + std::to_string(self.pid) +
         ") was superseded and may no longer save or restore through the agent: nothing it "
         "writes now can be taken for the job's newest snapshot. It is a stale process of an "
         "earlier run (e.g. left hung in a collective by a network partition): end it";
  return msg;
}

}  // namespace safepoint
