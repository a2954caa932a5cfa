// PeerService over UCX, the server side (see peer_service_impl.h for how the three files divide
// the work): accepting a peer's connection, the hello/challenge/auth exchange that authenticates
// it, and what it may then ask: a push (put-begin, chunks, commit into the ReplicaStore), a list
// of the replicas held here, or a fetch of one of them (its chunks stream back). Everything runs
// on the progress thread; store operations that take long run on the service's store thread
// (Offload).
#include <algorithm>
#include <string>

#include "base/log.h"
#include "replica/peer_service_impl.h"

namespace safepoint::replica::ucx {
namespace {

constexpr size_t kMaxServerConns = 256;  // accepted connections at once

}  // namespace

void PeerServiceImpl::OnConnRequest(ucp_conn_request_h request) {
  Lock lk(mu_);
  size_t servers = 0;
  for (auto& [ep, c] : eps_) servers += !c->client;
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string from = "peer at ?";
  if (ucp_conn_request_query(request, &attr) == UCS_OK)
    from = "peer at " + FormatAddress(attr.client_address);
  if (stop_ || servers >= kMaxServerConns) {
    spdlog::warn(
        "peer service: refusing {}: {}", from,
        stop_ ? std::string("the service stopped") : std::to_string(servers) + " connections open");
    ucp_listener_reject(listener_, request);
    return;
  }
  auto c = std::make_shared<Conn>();
  c->name = from;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = EpErrorCb;
  ep.err_handler.arg = this;
  if (ucs_status_t s = ucp_ep_create(hub_->worker(), &ep, &c->ep); s != UCS_OK) {
    spdlog::warn("peer service: cannot accept {}: {}", from, UcsError(s));
    return;
  }
  eps_[c->ep] = c;
}

void PeerServiceImpl::HandleServer(const ConnPtr& c, MsgType type, const json& body) {
  auto protocol_error = [&](const std::string& what) {
    ++peers_rejected_;
    Drop(c, Corruption(c->name + ": " + what), /*tell_peer=*/true);
  };
  if (type == MsgType::kError) {
    Drop(c, StatusFromJson(body, c->name), false);
    return;
  }
  switch (c->auth) {
    case Conn::Auth::kHello: {
      std::string job, node;
      if (type != MsgType::kHello || !GetString(body, "job", &job) ||
          !GetString(body, "node", &node, 64) ||
          !GetHex(body, "nonce", c->client_nonce.data(), kNonceBytes))
        return protocol_error(std::string("expected hello, got a malformed ") + MsgTypeName(type));
      if (job != options_.job) {
        ++peers_rejected_;
        return Drop(
            c, Unavailable(c->name + ": is of job '" + job + "', this is '" + options_.job + "'"),
            true);
      }
      Result<Nonce> nonce = NewNonce();
      if (!nonce.ok()) return Drop(c, nonce.status(), true);
      c->server_nonce = *nonce;
      c->client_node = node;
      c->name = "peer " + node + " (" + c->name.substr(std::string("peer at ").size()) + ")";
      c->auth = Conn::Auth::kAuth;
      const Mac proof = AuthProof(secret_, AuthRole::kServer, options_.job, node, options_.node,
                                  c->client_nonce, c->server_nonce);
      SendControlNow(c, MsgType::kChallenge,
                     {{"node", options_.node},
                      {"nonce", ToHex(c->server_nonce.data(), kNonceBytes)},
                      {"proof", ToHex(proof.data(), kMacBytes)}});
      return;
    }
    case Conn::Auth::kAuth: {
      Mac got{};
      if (type != MsgType::kAuth || !GetHex(body, "proof", got.data(), kMacBytes))
        return protocol_error(std::string("expected auth, got a malformed ") + MsgTypeName(type));
      const Mac want = AuthProof(secret_, AuthRole::kClient, options_.job, c->client_node,
                                 options_.node, c->client_nonce, c->server_nonce);
      if (!MacEqual(got, want)) {
        ++peers_rejected_;
        return Drop(c, Unavailable(c->name + ": authentication failed (not the job's secret)"),
                    true);
      }
      c->auth = Conn::Auth::kReady;
      SendControlNow(c, MsgType::kAuthOk, json::object());
      return;
    }
    case Conn::Auth::kReady:
      break;
  }
  if (c->busy) return protocol_error(std::string(MsgTypeName(type)) + " before the last reply");
  // put-begin and fetch: a replica's meta and the chunk size, on a connection with no transfer.
  auto transfer_request = [&](uint64_t* chunk) -> Result<ReplicaMeta> {
    std::string meta_text;
    if (c->writer || c->view || !GetU64(body, "chunk_bytes", chunk) ||
        !GetString(body, "meta", &meta_text, 4096))
      return Corruption(std::string("malformed or unexpected ") + MsgTypeName(type));
    return MetaFromJson(meta_text);
  };
  switch (type) {
    case MsgType::kPutBegin: {
      uint64_t chunk = 0;
      Result<ReplicaMeta> meta = transfer_request(&chunk);
      if (!meta.ok()) return protocol_error(meta.status().message());
      if (Status s = ValidateDeclaredMeta(*meta, c->client_node, options_.max_image_bytes);
          !s.ok()) {
        ++peers_rejected_;
        return Drop(c, s, true);
      }
      ChunkLayout layout{meta->payload_bytes, chunk};
      if (Status s = layout.Validate(); !s.ok()) return protocol_error(s.message());
      // Reserving the file (fallocate allocates every page) is slow for big images: off the
      // progress thread.
      auto writer = std::make_shared<Result<std::unique_ptr<ReplicaWriter>>>(Cancelled(""));
      Offload(
          c, [this, writer, m = *meta] { *writer = store_->Begin(m); },
          [this, c, writer, m = *meta, layout] {
            if (!writer->ok()) return Drop(c, writer->status(), true);
            c->meta = m;
            c->writer = std::move(**writer);
            c->layout = layout;
            c->got.assign(layout.chunks(), 0);
            c->chunk_crcs.assign(layout.chunks(), 0);
            c->received = 0;
            c->all_received = false;
            SendControlNow(c, MsgType::kPutReady, json::object());
          });
      return;
    }
    case MsgType::kCommit: {
      if (!c->writer || !c->all_received) return protocol_error("commit before every chunk");
      uint64_t image_crc = 0, payload_crc = 0;
      if (!GetU64(body, "image_crc", &image_crc) || !GetU64(body, "payload_crc", &payload_crc) ||
          image_crc > UINT32_MAX || payload_crc > UINT32_MAX)
        return protocol_error("malformed commit");
      c->meta.image_crc = static_cast<uint32_t>(image_crc);
      c->meta.payload_crc = static_cast<uint32_t>(payload_crc);
      // What landed, chunk by chunk (each checked as it arrived), folded into the payload's CRC:
      // the commit compares it with the sender's without reading the payload again.
      uint32_t received_crc = 0;
      for (uint64_t i = 0; i < c->layout.chunks(); ++i)
        received_crc = Crc32cCombine(
            received_crc, c->chunk_crcs[i],
            std::min(c->layout.chunk_bytes, c->layout.total - i * c->layout.chunk_bytes));
      std::shared_ptr<ReplicaWriter> writer = std::move(c->writer);
      auto status = std::make_shared<Status>();
      Offload(
          c,
          [this, writer, status, m = c->meta, received_crc] {
            *status = writer->Commit(m.image_crc, m.payload_crc, received_crc);
            if (status->ok())
              if (Result<uint64_t> freed = store_->Prune(options_.keep); !freed.ok())
                spdlog::warn("peer service: pruning replicas: {}", freed.status().ToString());
          },
          [this, c, status] {
            if (status->ok()) {
              ++replicas_received_;
              bytes_received_ += c->meta.payload_bytes;
            } else {
              ++transfers_failed_;
            }
            SendControlNow(c, MsgType::kCommitted, StatusToJson(*status));
          });
      return;
    }
    case MsgType::kPing:  // a paused or throttled sender; OnAm noted the progress
      return;
    case MsgType::kCancel:
      c->writer.reset();
      return Drop(c, Cancelled(c->name + ": cancelled the transfer"), false);
    case MsgType::kList: {
      std::optional<uint32_t> rank;
      uint64_t r = 0;
      if (GetU64(body, "rank", &r)) {
        if (r > UINT32_MAX) return protocol_error("rank out of range");
        rank = static_cast<uint32_t>(r);
      }
      Result<std::vector<ReplicaMeta>> list = store_->List(rank);
      if (!list.ok()) return Drop(c, list.status(), true);
      json metas = json::array();
      for (const ReplicaMeta& m : *list) {
        if (metas.size() >= kMaxListed) break;
        metas.push_back(MetaToJson(m));
      }
      json reply = {{"metas", std::move(metas)}};
      if (reply.dump().size() > kMaxControlBytes)
        return Drop(c, ResourceExhausted("list reply too long"), true);
      SendControlNow(c, MsgType::kListReply, reply);
      return;
    }
    case MsgType::kFetch: {
      uint64_t chunk = 0;
      Result<ReplicaMeta> want = transfer_request(&chunk);
      if (!want.ok()) return protocol_error(want.status().message());
      Result<std::vector<ReplicaMeta>> list = store_->List(want->rank);
      if (!list.ok()) return Drop(c, list.status(), true);
      auto it = std::find_if(list->begin(), list->end(),
                             [&](const ReplicaMeta& m) { return SameReplica(m, *want); });
      if (it == list->end())
        return Drop(
            c,
            NotFound("no replica " + want->source_node + " rank " + std::to_string(want->rank) +
                     " step " + std::to_string(want->step) + " here"),
            true);
      ChunkLayout layout{it->payload_bytes, chunk};
      if (Status s = layout.Validate(); !s.ok()) return protocol_error(s.message());
      // Read verifies the payload's CRC: off the progress thread.
      auto view = std::make_shared<Result<ReplicaView>>(Cancelled(""));
      Offload(
          c, [this, view, m = *it] { *view = store_->Read(m); },
          [this, c, view, layout] {
            if (!view->ok()) return Drop(c, view->status(), true);
            c->view = std::make_shared<ReplicaView>(std::move(**view));
            c->send_layout = layout;
            c->next_chunk = 0;
            SendControlNow(c, MsgType::kFetchBegin, {{"meta", MetaToJson(c->view->meta)}});
            PumpFetch(c);
          });
      return;
    }
    case MsgType::kFetchSnapshot:
      return ServeSnapshot(c, body);
    case MsgType::kNote: {
      std::string kind, text;
      if (!GetString(body, "kind", &kind, 64) ||
          !GetString(body, "body", &text, PeerService::kMaxNoteBytes))
        return protocol_error("malformed note");
      // The agent's handler queues the note and returns (it never blocks the progress thread).
      const Status s = note_handler_ ? note_handler_(c->client_node, kind, text)
                                     : Unavailable("node " + options_.node + " takes no notes");
      if (s.ok()) ++notes_received_;
      SendControlNow(c, MsgType::kNoteReply, StatusToJson(s));
      return;
    }
    default:
      return protocol_error(std::string("unexpected ") + MsgTypeName(type) + " message");
  }
}

void PeerServiceImpl::Offload(const ConnPtr& c, std::function<void()> work,
                              std::function<void()> then) {
  c->busy = true;
  std::lock_guard lk(store_mu_);
  store_tasks_.push_back([this, c, work = std::move(work), then = std::move(then)] {
    work();
    Submit([this, c, then] {
      Lock lk(mu_);
      c->busy = false;
      c->last_progress = Clock::now();
      if (!c->closing && !c->dropping) then();
    });
  });
  store_cv_.notify_one();
}

void PeerServiceImpl::RunStore() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock lk(store_mu_);
      store_cv_.wait(lk, [&] { return store_stop_ || !store_tasks_.empty(); });
      if (store_stop_) return;  // what is left is dropped (uncommitted files are removed)
      task = std::move(store_tasks_.front());
      store_tasks_.pop_front();
    }
    task();
  }
}

void PeerServiceImpl::PumpFetch(const ConnPtr& c) {
  Lock lk(mu_);
  while (c->view && !c->closing && !c->dropping && c->outstanding < kSendWindow &&
         c->next_chunk < c->send_layout.chunks()) {
    const uint64_t offset = c->next_chunk * c->send_layout.chunk_bytes;
    const uint64_t len = std::min(c->send_layout.chunk_bytes, c->send_layout.total - offset);
    const std::byte* p = c->view->payload.data() + offset;
    if (c->served && !ServedStillValid(c)) return;  // dropped: the snapshot was superseded
    const uint32_t crc = c->served ? ServedChunkCrc(*c, offset, p, len) : Crc32c(0, p, len);
    ++c->next_chunk;
    ++c->outstanding;
    SendNow(c, ChunkHeader(offset, len, crc), {}, p, len, c->view);
  }
}

}  // namespace safepoint::replica::ucx
