// PeerService over UCX, the client side (see peer_service_impl.h for how the three files divide
// the work): connecting to a peer and authenticating both ways, pushing a snapshot to its targets
// (a whole copy each, or erasure-coded fragments encoded stripe by stripe as they are sent), with
// pause, bandwidth cap and cancellation; listing what peers hold; fetching replicas and rebuilding
// an image from a copy or from K fragments. These run on the callers' threads and hand every UCX
// call to the progress thread.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "base/host_port.h"
#include "base/kill_point.h"
#include "base/log.h"
#include "replica/erasure.h"
#include "replica/peer_service_impl.h"

namespace safepoint::replica::ucx {
namespace {

// The encoded stripes of an image being pushed with ec:K+P: stripe s holds piece f of every
// fragment at f * piece_bytes. Targets progress at their own pace; the newest few stripes are
// cached, an older one a slow target still needs is encoded again (memory stays bounded).
class StripeSource {
 public:
  StripeSource(const EcLayout& layout, const EcCodec* codec, std::span<const std::byte> image)
      : layout_(layout), codec_(codec), image_(image) {}

  struct Stripe {
    std::vector<std::byte> bytes;  // piece f at f * piece_bytes
    std::vector<uint32_t> crcs;    // CRC32C of each piece
  };

  std::shared_ptr<const Stripe> Get(uint64_t stripe) {
    std::lock_guard lk(mu_);
    if (auto it = cache_.find(stripe); it != cache_.end()) return it->second;
    auto buf = Encode(stripe);
    if (!image_crcs_[stripe]) {
      // The stripe's share of the image CRC: its data pieces' CRCs, unless the image ends in it
      // (then the bytes themselves: the pieces are zero-padded).
      const uint64_t begin = stripe * layout_.stripe_bytes();
      const uint64_t len = std::min(layout_.stripe_bytes(), layout_.image_bytes - begin);
      uint32_t crc = 0;
      if (len == layout_.stripe_bytes()) {
        for (uint32_t f = 0; f < layout_.k; ++f)
          crc = Crc32cCombine(crc, buf->crcs[f], layout_.piece_bytes);
      } else {
        crc = Crc32c(0, image_.data() + begin, len);
      }
      image_crcs_[stripe] = crc;
    }
    while (cache_.size() >= kCachedStripes) cache_.erase(cache_.begin());
    cache_[stripe] = buf;
    return buf;
  }

  // The image's CRC32C, once every stripe was encoded (a target has been sent all of its
  // chunks).
  uint32_t ImageCrc() {
    std::lock_guard lk(mu_);
    uint32_t crc = 0;
    for (uint64_t s = 0; s < layout_.stripes(); ++s) {
      const uint64_t begin = s * layout_.stripe_bytes();
      const uint64_t len = std::min(layout_.stripe_bytes(), layout_.image_bytes - begin);
      const uint32_t part =
          image_crcs_[s] ? *image_crcs_[s] : Crc32c(0, image_.data() + begin, len);
      crc = Crc32cCombine(crc, part, len);
    }
    return crc;
  }

 private:
  static constexpr size_t kCachedStripes = 2 * kSendWindow;

  std::shared_ptr<Stripe> Encode(uint64_t stripe) const {
    const uint32_t n = layout_.k + layout_.p;
    auto buf = std::make_shared<Stripe>();
    buf->bytes.resize(n * layout_.piece_bytes);
    std::vector<std::byte*> out(n);
    for (uint32_t f = 0; f < n; ++f) out[f] = buf->bytes.data() + f * layout_.piece_bytes;
    codec_->EncodeStripe(layout_, image_, stripe, out);
    for (uint32_t f = 0; f < n; ++f) buf->crcs.push_back(Crc32c(0, out[f], layout_.piece_bytes));
    return buf;
  }

  const EcLayout layout_;
  const EcCodec* const codec_;
  const std::span<const std::byte> image_;
  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<const Stripe>> cache_;
  std::vector<std::optional<uint32_t>> image_crcs_ =
      std::vector<std::optional<uint32_t>>(layout_.stripes());  // per stripe, once encoded
};

}  // namespace

Result<ConnPtr> PeerServiceImpl::Connect(const Peer& peer, const SnapshotOrigin* as) {
  const std::string job = as ? as->job : options_.job;
  auto c = std::make_shared<Conn>();
  c->client = true;
  c->name = "peer " + peer.node + " (" + peer.address + ")";
  if (!ucx_ready_.load(std::memory_order_acquire)) {
    return Unavailable(c->name + ": not reachable from node " + options_.node +
                       ": its peer service waits for the interface " + bind_iface_ + " of " +
                       options_.bind_host + " to come up (it was down when the service started)");
  }
  Result<internal::HostPort> hp = internal::ParseHostPort(peer.address);
  if (!hp.ok()) return hp.status().WithContext(c->name);
  if (hp->host.empty() || hp->port == 0)
    return InvalidArgument(c->name + ": address '" + peer.address +
                           "' needs a host and a port other than 0");
  socklen_t len = 0;
  Result<sockaddr_storage> addr = ResolveAddress(hp->host, hp->port, &len);
  if (!addr.ok()) return addr.status().WithContext(c->name);
  Result<Nonce> nonce = NewNonce();
  if (!nonce.ok()) return nonce.status();
  const Nonce client_nonce = *nonce;
  {
    Lock lk(mu_);
    c->last_progress = Clock::now();
    ++c->outstanding;  // the hello
  }
  const sockaddr_storage ss = *addr;
  Submit([this, c, ss, len, client_nonce, job] {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    ep.sockaddr.addrlen = len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = EpErrorCb;
    ep.err_handler.arg = this;
    Lock lk(mu_);
    if (ucs_status_t s = ucp_ep_create(hub_->worker(), &ep, &c->ep); s != UCS_OK) {
      c->ep = nullptr;
      c->error = Unavailable(c->name + ": cannot connect: " + UcsError(s));
      c->outstanding = 0;
      cv_.notify_all();
      return;
    }
    eps_[c->ep] = c;
    std::string text = json{{"job", job},
                            {"node", options_.node},
                            {"nonce", ToHex(client_nonce.data(), kNonceBytes)}}
                           .dump();
    const WireHeader h = ControlHeader(MsgType::kHello, text.size());
    SendNow(c, h, std::move(text), nullptr, 0, nullptr);
  });
  auto fail = [&](Status s) -> Result<ConnPtr> {
    Close(c);
    return s;
  };
  Result<json> challenge = WaitMessage(c, MsgType::kChallenge);
  if (!challenge.ok()) return fail(challenge.status());
  std::string node;
  Nonce server_nonce{};
  Mac proof{};
  if (!GetString(*challenge, "node", &node, 64) ||
      !GetHex(*challenge, "nonce", server_nonce.data(), kNonceBytes) ||
      !GetHex(*challenge, "proof", proof.data(), kMacBytes))
    return fail(Corruption(c->name + ": malformed challenge"));
  std::string secret;
  {
    Lock lk(mu_);
    secret = as ? as->secret : secret_;
  }
  if (node != peer.node) return fail(Unavailable(c->name + ": answers as node '" + node + "'"));
  if (!MacEqual(proof, AuthProof(secret, AuthRole::kServer, job, options_.node, node, client_nonce,
                                 server_nonce)))
    return fail(Unavailable(c->name + ": authentication failed (not the job's secret)"));
  const Mac mine =
      AuthProof(secret, AuthRole::kClient, job, options_.node, node, client_nonce, server_nonce);
  SendControl(c, MsgType::kAuth, {{"proof", ToHex(mine.data(), kMacBytes)}});
  Result<json> ok = WaitMessage(c, MsgType::kAuthOk);
  if (!ok.ok()) return fail(ok.status());
  return c;
}

void PeerServiceImpl::SendControl(const ConnPtr& c, MsgType type, json body) {
  {
    Lock lk(mu_);
    ++c->outstanding;
  }
  Submit([this, c, type, body = std::move(body)] {
    std::string text = body.dump();
    const WireHeader h = ControlHeader(type, text.size());
    SendNow(c, h, std::move(text), nullptr, 0, nullptr);
  });
}

void PeerServiceImpl::SendChunk(const ConnPtr& c, uint64_t offset, std::span<const std::byte> bytes,
                                uint32_t crc, std::shared_ptr<const void> keep) {
  {
    Lock lk(mu_);
    ++c->outstanding;
  }
  Submit([this, c, offset, bytes, crc, keep = std::move(keep)] {
    SendNow(c, ChunkHeader(offset, bytes.size(), crc), {}, bytes.data(), bytes.size(), keep);
  });
}

Status PeerServiceImpl::WaitUntil(const ConnPtr& c, const std::function<bool()>& done) {
  Lock lk(mu_);
  while (true) {
    if (!c->inbox.empty() && c->inbox.front().type == MsgType::kError)
      return StatusFromJson(c->inbox.front().body, c->name);
    if (done()) return Status::OK();
    if (!c->error.ok()) return c->error;
    const auto deadline = c->last_progress + timeout();
    const auto now = Clock::now();
    if (now >= deadline) {
      ++transfers_failed_;
      return Unavailable(c->name + ": no progress for " + Seconds(options_.timeout_s) + " s");
    }
    cv_.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(200)));
  }
}

Result<json> PeerServiceImpl::WaitMessage(const ConnPtr& c, MsgType expected) {
  SP_RETURN_IF_ERROR(WaitUntil(c, [&] { return !c->inbox.empty(); }));
  Lock lk(mu_);
  Message m = std::move(c->inbox.front());
  c->inbox.pop_front();
  if (m.type != expected)
    return Corruption(c->name + ": sent " + MsgTypeName(m.type) + " where " +
                      MsgTypeName(expected) + " was due");
  return std::move(m.body);
}

// Force-closes and waits until no request of ours still points into the caller's buffers.
void PeerServiceImpl::Close(const ConnPtr& c) {
  Submit([this, c] { CloseNow(c, Cancelled(c->name + ": closed")); });
  Lock lk(mu_);
  const auto deadline = Clock::now() + std::max(timeout(), std::chrono::nanoseconds(1000000000));
  while (!(c->closed && c->outstanding == 0 && c->receiving == 0)) {
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      spdlog::error("peer service: {} still has {} sends and {} receives after closing", c->name,
                    c->outstanding, c->receiving);
      break;
    }
  }
}

Result<double> PeerServiceImpl::Throttle(const ConnPtr& c, uint64_t bytes,
                                         const std::function<bool()>& still_valid,
                                         const Status& cancelled) {
  const auto start = Clock::now();
  // Waits in slices, pinging the receiver so that it does not drop a connection that is only
  // paused, and polling still_valid and the connection.
  const auto slice =
      std::max<std::chrono::nanoseconds>(timeout() / 3, std::chrono::milliseconds(1));
  auto ping = [&]() -> Status {
    {
      Lock lk(mu_);
      if (!c->error.ok()) return c->error;
      c->last_progress = Clock::now();
    }
    SendControl(c, MsgType::kPing, json::object());
    return StillValid(still_valid) ? Status::OK() : cancelled;
  };
  bool waited = false;
  while (true) {
    std::unique_lock lk(pause_mu_);
    if (!paused_ || stop_) break;
    waited = true;
    if (pause_cv_.wait_for(lk, slice, [&] { return !paused_ || stop_; })) break;
    lk.unlock();
    SP_RETURN_IF_ERROR(ping());
  }
  double wait_s = 0;
  {
    std::lock_guard lk(bucket_mu_);
    const auto now = Clock::now();
    if (rate_ > 0) {
      const double burst = std::max<double>(static_cast<double>(options_.chunk_bytes), rate_ / 10);
      tokens_ = std::min(
          burst, tokens_ + std::chrono::duration<double>(now - bucket_time_).count() * rate_);
      tokens_ -= static_cast<double>(bytes);
      if (tokens_ < 0) wait_s = -tokens_ / rate_;
    }
    bucket_time_ = now;
  }
  if (wait_s > 0) waited = true;
  const auto until = Clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::duration<double>(wait_s));
  while (Clock::now() < until) {
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(slice, until - Clock::now()));
    if (Clock::now() < until) SP_RETURN_IF_ERROR(ping());
  }
  {
    Lock lk(mu_);
    c->last_progress = Clock::now();
  }
  return waited ? std::chrono::duration<double>(Clock::now() - start).count() : 0.0;
}

Status PeerServiceImpl::PushOne(const Peer& target, const ReplicaMeta& meta, uint64_t chunk_bytes,
                                const ChunkOf& chunk_of,
                                const std::function<uint32_t(uint32_t)>& image_crc_of,
                                const std::function<bool()>& still_valid, double* paused_seconds) {
  SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(target));
  const Status cancelled = Cancelled("snapshot rank " + std::to_string(meta.rank) + " step " +
                                     std::to_string(meta.step) + " is no longer valid");
  auto finish = [&](Status s) {
    // A snapshot overwritten while it is sent fails the receiver's checks (its chunks no longer
    // match the checksums it recorded): whatever failed, a push of a snapshot that is no longer
    // valid was superseded, not refused.
    if (!s.ok() && s.code() != StatusCode::kCancelled && !StillValid(still_valid)) s = cancelled;
    if (s.code() == StatusCode::kCancelled) {
      SendControl(c, MsgType::kCancel, json::object());
      // Let the cancel leave before the force close (best effort; the receiver also drops an
      // unfinished replica when the connection goes).
      WaitUntil(c, [&] { return c->outstanding == 0; }).IgnoreError();
    }
    Close(c);
    if (!s.ok()) spdlog::warn("peer service: push to {} failed: {}", c->name, s.ToString());
    return s;
  };
  SendControl(c, MsgType::kPutBegin, {{"meta", MetaToJson(meta)}, {"chunk_bytes", chunk_bytes}});
  if (Result<json> r = WaitMessage(c, MsgType::kPutReady); !r.ok()) return finish(r.status());
  const ChunkLayout layout{meta.payload_bytes, chunk_bytes};
  uint32_t payload_crc = 0;
  for (uint64_t i = 0; i < layout.chunks(); ++i) {
    if (!StillValid(still_valid)) return finish(cancelled);
    const uint64_t offset = i * layout.chunk_bytes;
    const uint64_t len = std::min(layout.chunk_bytes, layout.total - offset);
    Result<double> waited = Throttle(c, len, still_valid, cancelled);
    if (!waited.ok()) return finish(waited.status());
    *paused_seconds += *waited;
    if (Status s = WaitUntil(c, [&] { return c->outstanding < kSendWindow; }); !s.ok())
      return finish(s);
    auto [bytes, keep, crc] = chunk_of(i);
    if (bytes.size() != len) return finish(InvalidArgument("push: chunk of the wrong size"));
    payload_crc = Crc32cCombine(payload_crc, crc, len);
    if (options_.test_mangle_chunk) {
      auto copy = std::make_shared<std::vector<std::byte>>(bytes.begin(), bytes.end());
      options_.test_mangle_chunk(offset, *copy);
      bytes = *copy;
      keep = copy;
    }
    SendChunk(c, offset, bytes, crc, keep);
    bytes_sent_ += len;
    SP_KILL_POINT("replica.push.after_chunk");
  }
  if (Result<json> r = WaitMessage(c, MsgType::kPutDone); !r.ok()) return finish(r.status());
  if (!StillValid(still_valid)) return finish(cancelled);
  SendControl(c, MsgType::kCommit,
              {{"image_crc", image_crc_of(payload_crc)}, {"payload_crc", payload_crc}});
  Result<json> committed = WaitMessage(c, MsgType::kCommitted);
  if (!committed.ok()) return finish(committed.status());
  uint64_t code = 0;
  if (GetU64(*committed, "code", &code) && code == 0) return finish(Status::OK());
  return finish(StatusFromJson(*committed, c->name));
}

Result<PushResult> PeerServiceImpl::Push(const SnapshotId& id, std::span<const std::byte> image,
                                         const Redundancy& redundancy,
                                         const std::vector<Peer>& targets,
                                         const std::function<bool()>& still_valid,
                                         const RecordedCrcs& recorded) {
  if (!redundancy.enabled()) return InvalidArgument("push: redundancy is none");
  if (targets.size() != redundancy.targets())
    return InvalidArgument("push: " + redundancy.ToString() + " needs " +
                           std::to_string(redundancy.targets()) + " targets, got " +
                           std::to_string(targets.size()));
  if (image.empty()) return InvalidArgument("push: empty image");
  const auto start = Clock::now();
  ++pushes_;
  ReplicaMeta base;
  base.source_node = options_.node;
  base.rank = id.rank;
  base.step = id.step;
  base.complete_ns = id.complete_ns;
  base.attempt = id.attempt;
  base.image_bytes = image.size();
  const uint64_t chunk_bytes = options_.chunk_bytes;
  // No pass over the image ahead of the sends: each chunk's CRC is the one the snapshot
  // recorded, or computed as it is first sent (shared by all targets); the payload's and
  // image's are folded from them and go with the commit.
  std::vector<ReplicaMeta> metas(targets.size(), base);
  std::vector<ChunkOf> chunk_of(targets.size());
  std::function<uint32_t(uint32_t)> image_crc_of;
  std::unique_ptr<EcCodec> codec;
  std::unique_ptr<StripeSource> stripes;
  struct ChunkCrcs {
    explicit ChunkCrcs(size_t n) : once(n), crc(n) {}
    std::vector<std::once_flag> once;
    std::vector<uint32_t> crc;
  };
  std::unique_ptr<ChunkCrcs> sent_crcs;
  if (redundancy.kind == Redundancy::Kind::kMirror) {
    const uint64_t chunks = ChunkLayout{image.size(), chunk_bytes}.chunks();
    std::span<const uint32_t> chunk_crcs;
    if (recorded.chunk_bytes == chunk_bytes) chunk_crcs = recorded.crcs;
    if (chunk_crcs.size() >= chunks) {  // the last chunk holds the checksums: never recorded
      return InvalidArgument("push: " + std::to_string(chunk_crcs.size()) +
                             " recorded chunk checksums for an image of " + std::to_string(chunks) +
                             " chunks");
    }
    sent_crcs = std::make_unique<ChunkCrcs>(chunks);
    image_crc_of = [](uint32_t payload_crc) { return payload_crc; };  // a copy is the image
    for (size_t t = 0; t < targets.size(); ++t) {
      metas[t].payload_bytes = image.size();
      chunk_of[t] = [image, chunk_bytes, crcs = sent_crcs.get(), chunk_crcs](uint64_t i) {
        const uint64_t offset = i * chunk_bytes;
        const auto bytes = image.subspan(offset, std::min(chunk_bytes, image.size() - offset));
        std::call_once(crcs->once[i], [&] {
          crcs->crc[i] = i < chunk_crcs.size() ? chunk_crcs[i] : Crc32c(bytes);
        });
        return Chunk{bytes, nullptr, crcs->crc[i]};
      };
    }
  } else {
    // One chunk of fragment f is piece f of one stripe, encoded as it is sent (StripeSource),
    // once for all targets unless one falls behind the cache.
    EcLayout layout{redundancy.k, redundancy.p, image.size(), chunk_bytes};
    SP_RETURN_IF_ERROR(layout.Validate());
    SP_ASSIGN_OR_RETURN(codec, EcCodec::Create(layout.k, layout.p));
    stripes = std::make_unique<StripeSource>(layout, codec.get(), image);
    image_crc_of = [src = stripes.get()](uint32_t) { return src->ImageCrc(); };
    for (uint32_t f = 0; f < layout.k + layout.p; ++f) {
      metas[f].kind = ReplicaMeta::Kind::kFragment;
      metas[f].index = f;
      metas[f].k = layout.k;
      metas[f].p = layout.p;
      metas[f].piece_bytes = layout.piece_bytes;
      metas[f].payload_bytes = layout.fragment_bytes();
      chunk_of[f] = [src = stripes.get(), f, piece = layout.piece_bytes](uint64_t i) {
        std::shared_ptr<const StripeSource::Stripe> stripe = src->Get(i);
        return Chunk{std::span<const std::byte>(stripe->bytes.data() + f * piece, piece), stripe,
                     stripe->crcs[f]};
      };
    }
  }

  PushResult result;
  result.targets.assign(targets.size(), Status::OK());
  std::vector<double> paused(targets.size(), 0);
  const uint64_t sent_before = bytes_sent_;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < targets.size(); ++t)
    threads.emplace_back([&, t] {
      result.targets[t] = PushOne(targets[t], metas[t], chunk_bytes, chunk_of[t], image_crc_of,
                                  still_valid, &paused[t]);
    });
  for (auto& th : threads) th.join();
  result.bytes_sent = bytes_sent_ - sent_before;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (double p : paused) result.paused_seconds = std::max(result.paused_seconds, p);
  for (const Status& s : result.targets)
    if (s.code() == StatusCode::kCancelled) return s;
  return result;
}

std::vector<Holding> PeerServiceImpl::List(const std::vector<Peer>& peers,
                                           std::optional<uint32_t> rank,
                                           std::vector<Status>* errors) {
  std::vector<std::vector<Holding>> found(peers.size());
  std::vector<Status> status(peers.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < peers.size(); ++i)
    threads.emplace_back([&, i] {
      status[i] = [&]() -> Status {
        SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(peers[i]));
        json req = json::object();
        if (rank) req["rank"] = *rank;
        SendControl(c, MsgType::kList, req);
        Result<json> reply = WaitMessage(c, MsgType::kListReply);
        Close(c);
        if (!reply.ok()) return reply.status();
        auto it = reply->find("metas");
        if (it == reply->end() || !it->is_array() || it->size() > kMaxListed)
          return Corruption(c->name + ": malformed list reply");
        for (const json& m : *it) {
          if (!m.is_string()) return Corruption(c->name + ": malformed list reply");
          Result<ReplicaMeta> meta = MetaFromJson(m.get<std::string>());
          if (!meta.ok()) return meta.status().WithContext(c->name);
          if (rank && meta->rank != *rank) continue;
          found[i].push_back({peers[i], *meta});
        }
        return Status::OK();
      }();
    });
  for (auto& th : threads) th.join();
  std::vector<Holding> out;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!status[i].ok()) spdlog::warn("peer service: list: {}", status[i].ToString());
    for (auto& h : found[i]) out.push_back(std::move(h));
  }
  if (errors) *errors = std::move(status);
  return out;
}

Status PeerServiceImpl::FetchOne(const Holding& holding, std::span<std::byte> dest,
                                 std::shared_ptr<void> dest_owner) {
  const ReplicaMeta& meta = holding.meta;
  if (dest.size() != meta.payload_bytes)
    return InvalidArgument("fetch: buffer of " + std::to_string(dest.size()) + " bytes for " +
                           std::to_string(meta.payload_bytes));
  SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(holding.holder));
  const ChunkLayout layout{meta.payload_bytes, options_.chunk_bytes};
  {
    Lock lk(mu_);
    c->sink = dest;
    c->sink_owner = std::move(dest_owner);
    c->layout = layout;
    c->got.assign(layout.chunks(), 0);
  }
  SendControl(c, MsgType::kFetch,
              {{"meta", MetaToJson(meta)}, {"chunk_bytes", layout.chunk_bytes}});
  Status s = [&]() -> Status {
    SP_ASSIGN_OR_RETURN(json begin, WaitMessage(c, MsgType::kFetchBegin));
    std::string text;
    if (!GetString(begin, "meta", &text, 4096))
      return Corruption(c->name + ": malformed fetch-begin");
    SP_ASSIGN_OR_RETURN(ReplicaMeta got, MetaFromJson(text));
    if (!SameContent(got, meta))
      return Corruption(c->name + ": holds a different replica than it listed");
    SP_RETURN_IF_ERROR(WaitUntil(c, [&] { return c->received == layout.total; }));
    return Status::OK();
  }();
  Close(c);
  {
    Lock lk(mu_);
    c->EndSink();
  }
  if (!s.ok()) {
    spdlog::warn("peer service: fetch from {} failed: {}", c->name, s.ToString());
    return s;
  }
  if (Crc32c(dest) != meta.payload_crc)
    return Corruption(c->name + ": replica payload fails its CRC32C");
  return Status::OK();
}

Status PeerServiceImpl::FetchImage(const std::vector<Holding>& holdings, const SnapshotId& id,
                                   std::span<std::byte> image) {
  const std::string what = "rank " + std::to_string(id.rank) + " step " + std::to_string(id.step);
  Status last = NotFound("no peer holds enough of " + what + " to rebuild it");
  std::vector<Holding> copies, frags;
  for (const Holding& h : holdings) {
    const ReplicaMeta& m = h.meta;
    if (m.rank != id.rank || m.step != id.step || m.complete_ns != id.complete_ns ||
        m.attempt != id.attempt) {
      continue;
    }
    if (m.image_bytes != image.size()) continue;
    // What a peer listed is checked like what a peer declares before anything is sized by it.
    if (Status v = ValidateDeclaredMeta(m, m.source_node, image.size()); !v.ok()) {
      last = v.WithContext(h.holder.node);
      continue;
    }
    (m.kind == ReplicaMeta::Kind::kCopy ? copies : frags).push_back(h);
  }
  for (const Holding& h : copies) {
    if (Status s = FetchOne(h, image, nullptr); !s.ok()) {
      last = s;
      continue;
    }
    if (Crc32c(std::span<const std::byte>(image)) != h.meta.image_crc) {
      last = Corruption("copy of " + what + " from " + h.holder.node + " fails the image CRC32C");
      continue;
    }
    return Status::OK();
  }
  // Fragments of one code (the first one listed), candidates in order of index.
  if (frags.empty()) return last;
  const ReplicaMeta& first = frags.front().meta;
  EcLayout layout{first.k, first.p, first.image_bytes, first.piece_bytes};
  std::vector<Holding> cands;
  for (const Holding& h : frags)
    if (h.meta.k == layout.k && h.meta.p == layout.p && h.meta.piece_bytes == layout.piece_bytes &&
        h.meta.image_crc == first.image_crc && h.meta.source_node == first.source_node)
      cands.push_back(h);
  std::stable_sort(cands.begin(), cands.end(),
                   [](const Holding& a, const Holding& b) { return a.meta.index < b.meta.index; });
  {
    std::vector<uint32_t> distinct;
    for (const Holding& h : cands)
      if (distinct.empty() || distinct.back() != h.meta.index) distinct.push_back(h.meta.index);
    if (distinct.size() < layout.k) return last;
  }
  SP_RETURN_IF_ERROR(layout.Validate());
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EcCodec> codec, EcCodec::Create(layout.k, layout.p));

  // K workers; each takes the first untried candidate whose index is neither fetched nor being
  // fetched, so a failed holder's index passes to another holder of it.
  std::mutex m;
  std::vector<bool> tried(cands.size(), false);
  std::vector<bool> busy(layout.k + layout.p, false);  // index fetched or being fetched
  std::vector<uint32_t> indices;
  std::vector<std::shared_ptr<std::vector<std::byte>>> buffers;
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < layout.k; ++w)
    threads.emplace_back([&] {
      while (true) {
        Holding h;
        {
          std::lock_guard lk(m);
          if (indices.size() >= layout.k) return;
          size_t i = 0;
          while (i < cands.size() && (tried[i] || busy[cands[i].meta.index])) ++i;
          if (i == cands.size()) return;
          tried[i] = true;
          h = cands[i];
          busy[h.meta.index] = true;
        }
        auto buf = std::make_shared<std::vector<std::byte>>(h.meta.payload_bytes);
        Status s = FetchOne(h, *buf, buf);
        std::lock_guard lk(m);
        if (s.ok() && indices.size() < layout.k) {
          indices.push_back(h.meta.index);
          buffers.push_back(buf);
        } else if (!s.ok()) {
          last = s;
          busy[h.meta.index] = false;
        }
      }
    });
  for (auto& th : threads) th.join();
  if (indices.size() < layout.k) return last;
  std::vector<std::span<const std::byte>> spans;
  for (auto& b : buffers) spans.emplace_back(*b);
  SP_RETURN_IF_ERROR(codec->Decode(layout, indices, spans, image));
  if (Crc32c(std::span<const std::byte>(image)) != first.image_crc)
    return Corruption(what + " rebuilt from fragments fails the image CRC32C");
  return Status::OK();
}

}  // namespace safepoint::replica::ucx
