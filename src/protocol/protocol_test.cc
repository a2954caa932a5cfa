#include "protocol/protocol.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <thread>

#include "base/bytes.h"
#include "base/unique_fd.h"
#include "testing/protocol_util.h"
#include "testing/test_util.h"

namespace safepoint::protocol_test {
namespace {

using namespace safepoint::protocol;  // NOLINT: the protocol under test

using internal::AppendLE;
using test::AsBytes;
using test::FrameHeader;

// Everything the decoder yields until it needs more bytes; fails the test on an error.
std::vector<Message> Drain(FrameDecoder& d) {
  std::vector<Message> out;
  for (;;) {
    auto m = d.Next();
    EXPECT_OK(m);
    if (!m.ok() || !*m) return out;
    out.push_back(std::move(**m));
  }
}

constexpr MessageType kAllTypes[] = {
    MessageType::kHello,          MessageType::kHelloReply,    MessageType::kSnapshot,
    MessageType::kStatus,         MessageType::kStatusReply,   MessageType::kWait,
    MessageType::kWaitReply,      MessageType::kClose,         MessageType::kCloseReply,
    MessageType::kError,          MessageType::kShutdown,      MessageType::kPeerSetup,
    MessageType::kPeerSetupReply, MessageType::kMembership,    MessageType::kAck,
    MessageType::kPeerList,       MessageType::kPeerListReply, MessageType::kPeerFetch,
    MessageType::kPeerFetchReply, MessageType::kPause,         MessageType::kReport};

TEST(ProtocolTest, EncodeFrameLayout) {
  const std::string frame = EncodeFrame(MessageType::kStatus, R"({"a":1})");
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + 7);
  EXPECT_EQ(frame.substr(0, 8), FrameHeader(4 + 7, kProtocolVersion, 4));
  EXPECT_EQ(frame.substr(8), R"({"a":1})");
  EXPECT_EQ(EncodeFrame(MessageType::kClose, ""), FrameHeader(4, kProtocolVersion, 8));
}

TEST(ProtocolTest, FrameRoundTrip) {
  for (MessageType type : kAllTypes) {
    for (const std::string payload :
         {std::string(), std::string("{}"), std::string(R"({"step":42,"name":"x\u00e9"})"),
          std::string("\0binary\xff\0", 10)}) {
      FrameDecoder d;
      d.Feed(AsBytes(EncodeFrame(type, payload)));
      auto m = d.Next();
      ASSERT_OK(m);
      ASSERT_TRUE(*m);
      EXPECT_EQ((*m)->type, type);
      EXPECT_EQ((*m)->payload, payload);
      auto none = d.Next();
      ASSERT_OK(none);
      EXPECT_FALSE(*none);
      EXPECT_EQ(d.buffered(), 0u);
    }
  }
}

TEST(ProtocolTest, LargestMessageRoundTrips) {
  const std::string payload(kMaxMessageBytes - 4, 'p');
  FrameDecoder d;
  const std::string frame = EncodeFrame(MessageType::kStatusReply, payload);
  d.Feed(AsBytes(frame).subspan(0, frame.size() - 1));
  auto partial = d.Next();
  ASSERT_OK(partial);
  EXPECT_FALSE(*partial);
  d.Feed(AsBytes(frame).subspan(frame.size() - 1));
  auto m = d.Next();
  ASSERT_OK(m);
  ASSERT_TRUE(*m);
  EXPECT_EQ((*m)->payload, payload);
}

TEST(ProtocolTest, ByteByByteFeeding) {
  std::vector<Message> want;
  std::string stream;
  for (int i = 0; i < 40; ++i) {
    Message m;
    m.type = kAllTypes[i % std::size(kAllTypes)];
    m.payload = std::string(i * 3, char('a' + i % 26));
    stream += EncodeFrame(m.type, m.payload);
    want.push_back(m);
  }
  FrameDecoder d;
  std::vector<Message> got;
  for (size_t i = 0; i < stream.size(); ++i) {
    d.Feed(AsBytes(stream).subspan(i, 1));
    auto more = Drain(d);
    ASSERT_LE(more.size(), 1u) << "one byte completes at most one frame";
    got.insert(got.end(), more.begin(), more.end());
  }
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].type, want[i].type) << i;
    EXPECT_EQ(got[i].payload, want[i].payload) << i;
  }
  EXPECT_EQ(d.buffered(), 0u);
}

TEST(ProtocolTest, ManyFramesInOneFeed) {
  std::string stream;
  constexpr int kFrames = 5000;
  for (int i = 0; i < kFrames; ++i) {
    stream += EncodeFrame(MessageType::kSnapshot, "{\"step\":" + std::to_string(i) + "}");
  }
  // Plus the first half of one more frame.
  const std::string last = EncodeFrame(MessageType::kWait, "{\"step\":99}");
  stream += last.substr(0, 5);
  FrameDecoder d;
  d.Feed(AsBytes(stream));
  auto got = Drain(d);
  ASSERT_EQ(got.size(), size_t{kFrames});
  for (int i = 0; i < kFrames; ++i) {
    EXPECT_EQ(got[i].type, MessageType::kSnapshot);
    ASSERT_EQ(got[i].payload, "{\"step\":" + std::to_string(i) + "}");
  }
  EXPECT_EQ(d.buffered(), 5u);
  d.Feed(AsBytes(last).subspan(5));
  got = Drain(d);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].type, MessageType::kWait);
  EXPECT_EQ(got[0].payload, "{\"step\":99}");
}

// Large frames, interleaved with feeds of arbitrary sizes (exercises the buffer compaction).
TEST(ProtocolTest, LargeFramesInRandomPieces) {
  std::mt19937_64 rng(7);
  std::vector<std::string> payloads;
  std::string stream;
  for (int i = 0; i < 12; ++i) {
    std::string p(std::uniform_int_distribution<size_t>(0, 700 << 10)(rng), '\0');
    for (auto& c : p) c = char(rng());
    stream += EncodeFrame(MessageType::kStatusReply, p);
    payloads.push_back(std::move(p));
  }
  FrameDecoder d;
  std::vector<Message> got;
  for (size_t off = 0; off < stream.size();) {
    const size_t n =
        std::min(stream.size() - off, std::uniform_int_distribution<size_t>(1, 3 << 20)(rng));
    d.Feed(AsBytes(stream).subspan(off, n));
    off += n;
    auto more = Drain(d);
    got.insert(got.end(), more.begin(), more.end());
  }
  ASSERT_EQ(got.size(), payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) EXPECT_EQ(got[i].payload, payloads[i]) << i;
  EXPECT_EQ(d.buffered(), 0u);
}

void ExpectRejected(const std::string& bytes, const std::string& what) {
  SCOPED_TRACE(what);
  FrameDecoder d;
  d.Feed(AsBytes(bytes));
  auto m = d.Next();
  ASSERT_FALSE(m.ok()) << "accepted";
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("protocol error"), std::string::npos) << m.status().message();
  // The stream cannot be resynchronised: the decoder keeps refusing it.
  d.Feed(AsBytes(EncodeFrame(MessageType::kStatus, "{}")));
  EXPECT_FALSE(d.Next().ok());
}

TEST(ProtocolTest, RejectsWrongVersion) {
  for (uint16_t v : {uint16_t{0}, uint16_t{kProtocolVersion + 1}, uint16_t{0xFFFF}}) {
    ExpectRejected(FrameHeader(4 + 2, v, 4) + "{}", "version " + std::to_string(v));
  }
}

TEST(ProtocolTest, RejectsUnknownType) {
  for (uint16_t t :
       {uint16_t{0}, static_cast<uint16_t>(static_cast<uint16_t>(kLastMessageType) + 1),
        uint16_t{0x100}, uint16_t{0xFFFF}}) {
    ExpectRejected(FrameHeader(4 + 2, kProtocolVersion, t) + "{}", "type " + std::to_string(t));
  }
}

TEST(ProtocolTest, RejectsLengthBelowHeader) {
  for (uint32_t len : {0u, 1u, 3u}) {
    // Only the length field has to arrive to reject it.
    std::string b;
    AppendLE<uint32_t>(b, len);
    ExpectRejected(b, "length " + std::to_string(len));
    ExpectRejected(b + std::string(16, '\0'), "length " + std::to_string(len) + " + bytes");
  }
}

TEST(ProtocolTest, RejectsOversizedLengthBeforeItsPayload) {
  for (uint32_t len : {kMaxMessageBytes + 1, 0x7FFFFFFFu, 0xFFFFFFFFu}) {
    std::string b;
    AppendLE<uint32_t>(b, len);
    ExpectRejected(b, "length " + std::to_string(len));
  }
  // Exactly the maximum is a valid length (it only needs its bytes).
  FrameDecoder d;
  d.Feed(AsBytes(FrameHeader(kMaxMessageBytes, kProtocolVersion, 4)));
  auto m = d.Next();
  ASSERT_OK(m);
  EXPECT_FALSE(*m);
}

TEST(ProtocolTest, ErrorAfterValidFramesKeepsThem) {
  std::string stream = EncodeFrame(MessageType::kHello, "{}") +
                       EncodeFrame(MessageType::kStatus, "{}") + FrameHeader(6, 9, 4) + "{}";
  FrameDecoder d;
  d.Feed(AsBytes(stream));
  for (MessageType want : {MessageType::kHello, MessageType::kStatus}) {
    auto m = d.Next();
    ASSERT_OK(m);
    ASSERT_TRUE(*m);
    EXPECT_EQ((*m)->type, want);
  }
  EXPECT_FALSE(d.Next().ok());
}

// Random damage to a valid stream never crashes the decoder, and it only ever yields errors or
// well-formed messages.
TEST(ProtocolTest, FuzzedStreamsYieldErrorsOrValidMessages) {
  const uint64_t seed = 20240611;
  std::mt19937_64 rng(seed);
  std::string base;
  for (int i = 0; i < 16; ++i) {
    base += EncodeFrame(kAllTypes[i % std::size(kAllTypes)],
                        std::string(i * 5, char('A' + i)) + "{\"k\":" + std::to_string(i) + "}");
  }
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  size_t errors = 0, messages = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " iteration " + std::to_string(iter));
    std::string s = base;
    const int mutations = 1 + static_cast<int>(pick(6));
    for (int k = 0; k < mutations; ++k) {
      switch (pick(6)) {
        case 0:  // flip a byte
          if (!s.empty()) s[pick(s.size())] = char(rng());
          break;
        case 1:  // flip a bit
          if (!s.empty()) s[pick(s.size())] ^= char(1 << pick(8));
          break;
        case 2:  // insert random bytes
          s.insert(pick(s.size() + 1), std::string(1 + pick(12), char(rng())));
          break;
        case 3:  // delete a range
          if (s.size() > 1) {
            const size_t at = pick(s.size());
            s.erase(at, 1 + pick(std::min<size_t>(16, s.size() - at)));
          }
          break;
        case 4: {  // overwrite 4 bytes with an interesting u32
          static const uint32_t kInteresting[] = {
              0, 3, 4, 5, kMaxMessageBytes, kMaxMessageBytes + 1, 0xFFFFFFFF, 0x80000000};
          if (s.size() >= 4) {
            const uint32_t v = kInteresting[pick(std::size(kInteresting))];
            std::memcpy(s.data() + pick(s.size() - 3), &v, 4);
          }
          break;
        }
        case 5:  // truncate
          s.resize(pick(s.size() + 1));
          break;
      }
    }
    FrameDecoder d;
    bool failed = false;
    for (size_t off = 0; off < s.size() && !failed;) {
      const size_t n = std::min(s.size() - off, 1 + pick(64));
      d.Feed(AsBytes(s).subspan(off, n));
      off += n;
      for (;;) {
        auto m = d.Next();
        if (!m.ok()) {
          ++errors;
          EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().ToString();
          failed = true;
          break;
        }
        if (!*m) break;
        ++messages;
        const auto type = static_cast<uint16_t>((*m)->type);
        EXPECT_GE(type, static_cast<uint16_t>(MessageType::kHello));
        EXPECT_LE(type, static_cast<uint16_t>(kLastMessageType));
        EXPECT_LE((*m)->payload.size() + 4, kMaxMessageBytes);
      }
    }
    EXPECT_LE(d.buffered(), s.size());
  }
  // Both outcomes actually happened.
  EXPECT_GT(errors, 0u);
  EXPECT_GT(messages, 0u);
}

// --- Blocking helpers over a socket pair ------------------------------------------------------

class ProtocolSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    a_.Reset(fds[0]);
    b_.Reset(fds[1]);
  }

  internal::UniqueFd a_, b_;  // the two ends of the socket pair
};

TEST_F(ProtocolSocketTest, SendAndReceive) {
  ASSERT_OK(SendMessage(a_.get(), MessageType::kHello, R"({"rank":0})"));
  ASSERT_OK(SendMessage(a_.get(), MessageType::kStatus, ""));
  FrameDecoder d;
  auto a = ReceiveMessage(b_.get(), d, 10);
  ASSERT_OK(a);
  EXPECT_EQ(a->type, MessageType::kHello);
  EXPECT_EQ(a->payload, R"({"rank":0})");
  auto b = ReceiveMessage(b_.get(), d, 10);
  ASSERT_OK(b);
  EXPECT_EQ(b->type, MessageType::kStatus);
  EXPECT_EQ(b->payload, "");
}

TEST_F(ProtocolSocketTest, LargeMessageThroughASmallSocketBuffer) {
  const std::string payload(kMaxMessageBytes - 4, 'z');
  std::thread sender([&] { EXPECT_OK(SendMessage(a_.get(), MessageType::kStatusReply, payload)); });
  FrameDecoder d;
  auto m = ReceiveMessage(b_.get(), d, 30);
  sender.join();
  ASSERT_OK(m);
  EXPECT_EQ(m->payload, payload);
}

TEST_F(ProtocolSocketTest, TooLargeToSend) {
  EXPECT_EQ(
      SendMessage(a_.get(), MessageType::kStatus, std::string(kMaxMessageBytes - 3, 'x')).code(),
      StatusCode::kInvalidArgument);
}

TEST_F(ProtocolSocketTest, TimeoutAndPeerClose) {
  FrameDecoder d;
  EXPECT_EQ(ReceiveMessage(b_.get(), d, 0.05).status().code(), StatusCode::kCancelled);
  // Half a frame, then the peer goes away.
  const std::string frame = EncodeFrame(MessageType::kStatus, "{}");
  ASSERT_EQ(::write(a_.get(), frame.data(), 5), 5);
  a_.Reset();
  EXPECT_EQ(ReceiveMessage(b_.get(), d, 10).status().code(), StatusCode::kUnavailable);
}

TEST_F(ProtocolSocketTest, MalformedFrameIsAnError) {
  const std::string bad = FrameHeader(6, kProtocolVersion + 1, 4) + "{}";
  ASSERT_EQ(::write(a_.get(), bad.data(), bad.size()), static_cast<ssize_t>(bad.size()));
  FrameDecoder d;
  EXPECT_EQ(ReceiveMessage(b_.get(), d, 10).status().code(), StatusCode::kInvalidArgument);
}

// --- typed messages ---------------------------------------------------------------------------

TEST(MessageTest, EveryMessageRoundTrips) {
  HelloRequest hello{3, 8, "/ckpt/run", 5, 4242}, hello_out;
  ASSERT_OK(Decode(Encode(hello), &hello_out));
  EXPECT_EQ(hello_out.rank, 3u);
  EXPECT_EQ(hello_out.world_size, 8u);
  EXPECT_EQ(hello_out.storage, "/ckpt/run");
  EXPECT_EQ(hello_out.keep, 5u);
  EXPECT_EQ(hello_out.pid, 4242u);
  EXPECT_EQ(hello_out.metrics, "");
  hello.metrics = "127.0.0.1:0";
  hello.event_log = "/var/log/job.jsonl";
  ASSERT_OK(Decode(Encode(hello), &hello_out));
  EXPECT_EQ(hello_out.metrics, "127.0.0.1:0");
  EXPECT_EQ(hello_out.event_log, "/var/log/job.jsonl");
  EXPECT_EQ(hello_out.attempt, 0u);  // none given: absent on the wire
  hello.attempt = (uint64_t{1} << 55) + 3;
  ASSERT_OK(Decode(Encode(hello), &hello_out));
  EXPECT_EQ(hello_out.attempt, (uint64_t{1} << 55) + 3);

  SnapshotNote note{1, (uint64_t{1} << 40) + 7, 99, true, false, {{0, 2}, {5, 9}}}, note_out;
  ASSERT_OK(Decode(Encode(note), &note_out));
  EXPECT_EQ(note_out.slot, 1u);
  EXPECT_EQ(note_out.generation, (uint64_t{1} << 40) + 7);
  EXPECT_EQ(note_out.step, 99u);
  EXPECT_TRUE(note_out.persist);
  EXPECT_FALSE(note_out.leased);
  EXPECT_EQ(note_out.skip, (SkipRanges{{0, 2}, {5, 9}}));
  EXPECT_FALSE(note_out.report.has_value());

  // One message per save: the note carries the save's report (issue 21).
  note.report = ReportNote{"save", 99, true, 2500000, 1 << 20, "", ""};
  ASSERT_OK(Decode(Encode(note), &note_out));
  ASSERT_TRUE(note_out.report.has_value());
  EXPECT_EQ(note_out.report->event, "save");
  EXPECT_EQ(note_out.report->step, 99u);
  EXPECT_EQ(note_out.report->nanos, 2500000u);
  EXPECT_EQ(note_out.report->bytes, uint64_t{1} << 20);
  EXPECT_EQ(note_out.slot, 1u);
  // A note without one (an older client) leaves no report from the previous decode behind.
  note.report.reset();
  ASSERT_OK(Decode(Encode(note), &note_out));
  EXPECT_FALSE(note_out.report.has_value());

  WaitReply failed{7, Status(StatusCode::kResourceExhausted, "disk full")}, failed_out;
  ASSERT_OK(Decode(Encode(failed), &failed_out));
  EXPECT_EQ(failed_out.step, 7u);
  EXPECT_EQ(failed_out.status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(failed_out.status.message(), "disk full");
  WaitReply ok{8, Status::OK()}, ok_out;
  ASSERT_OK(Decode(Encode(ok), &ok_out));
  EXPECT_OK(ok_out.status);

  CloseReply close{IOError("gone")}, close_out;
  ASSERT_OK(Decode(Encode(close), &close_out));
  EXPECT_EQ(close_out.status.code(), StatusCode::kIOError);
  ErrorReply error{"no"}, error_out;
  ASSERT_OK(Decode(Encode(error), &error_out));
  EXPECT_EQ(error_out.error, "no");
  HelloReply reply{12, "/dev/shm/x"}, reply_out;
  ASSERT_OK(Decode(Encode(reply), &reply_out));
  EXPECT_EQ(reply_out.job_dir, "/dev/shm/x");
  EXPECT_EQ(reply_out.claim_epoch, 0u);
  reply.claim_epoch = 7;
  ASSERT_OK(Decode(Encode(reply), &reply_out));
  EXPECT_EQ(reply_out.claim_epoch, 7u);
  // A status of every code survives the wire, the newest code included.
  WaitReply superseded{3, Superseded("stale")}, superseded_out;
  ASSERT_OK(Decode(Encode(superseded), &superseded_out));
  EXPECT_EQ(superseded_out.status.code(), StatusCode::kSuperseded);
}

TEST(MessageTest, PeerReplicationMessagesRoundTrip) {
  PeerSetupRequest setup{"node2", "10.1.2.3", 2500, 7001, uint64_t{3} << 33}, setup_out;
  ASSERT_OK(Decode(Encode(setup), &setup_out));
  EXPECT_EQ(setup_out.node, "node2");
  EXPECT_EQ(setup_out.bind_host, "10.1.2.3");
  EXPECT_EQ(setup_out.timeout_ms, 2500u);
  EXPECT_EQ(setup_out.port, 7001u);
  EXPECT_EQ(setup_out.max_shm_bytes, uint64_t{3} << 33);
  // An older client's request has no cap: none.
  PeerSetupRequest older;
  ASSERT_OK(Decode(R"({"node":"n","bind_host":"h"})", &older));
  EXPECT_EQ(older.max_shm_bytes, 0u);

  Membership note{"e1", 1, {{"a", "10.0.0.1:1"}, {"b", "10.0.0.2:2"}}, "ec:2+1", "00ff", 7},
      note_out;
  ASSERT_OK(Decode(Encode(note), &note_out));
  EXPECT_EQ(note_out.epoch, "e1");
  EXPECT_EQ(note_out.node_index, 1u);
  ASSERT_EQ(note_out.nodes.size(), 2u);
  EXPECT_EQ(note_out.nodes[1].node, "b");
  EXPECT_EQ(note_out.nodes[1].address, "10.0.0.2:2");
  EXPECT_EQ(note_out.redundancy, "ec:2+1");
  EXPECT_EQ(note_out.secret_hex, "00ff");
  EXPECT_EQ(note_out.bandwidth, 7u);

  PeerListReply list{{{5, 9, 11, 4096}, {6, 9, 12, 8192}}}, list_out;
  ASSERT_OK(Decode(Encode(list), &list_out));
  ASSERT_EQ(list_out.snapshots.size(), 2u);
  EXPECT_EQ(list_out.snapshots[1].step, 6u);
  EXPECT_EQ(list_out.snapshots[1].attempt, 9u);
  EXPECT_EQ(list_out.snapshots[1].complete_ns, 12u);
  EXPECT_EQ(list_out.snapshots[1].image_bytes, 8192u);

  PeerFetchRequest fetch{3, 6, 9}, fetch_out;
  ASSERT_OK(Decode(Encode(fetch), &fetch_out));
  EXPECT_EQ(fetch_out.rank, 3u);
  EXPECT_EQ(fetch_out.step, 6u);
  EXPECT_EQ(fetch_out.attempt, 9u);
  PeerFetchReply fetched{Status::OK(), 1, 44, 8192, "a,b"}, fetched_out;
  ASSERT_OK(Decode(Encode(fetched), &fetched_out));
  EXPECT_OK(fetched_out.status);
  EXPECT_EQ(fetched_out.slot, 1u);
  EXPECT_EQ(fetched_out.generation, 44u);
  EXPECT_EQ(fetched_out.source, "a,b");
  PeerFetchReply missing{NotFound("no copy")}, missing_out;
  ASSERT_OK(Decode(Encode(missing), &missing_out));
  EXPECT_EQ(missing_out.status.code(), StatusCode::kNotFound);

  AckReply ack{InvalidArgument("too few nodes")}, ack_out;
  ASSERT_OK(Decode(Encode(ack), &ack_out));
  EXPECT_EQ(ack_out.status.message(), "too few nodes");
  PauseNote pause{true}, pause_out;
  ASSERT_OK(Decode(Encode(pause), &pause_out));
  EXPECT_TRUE(pause_out.paused);

  ReportNote report{"restore", 7, true, 1500000000, 4096, "memory", ""}, report_out;
  report_out.error = "left from before";
  ASSERT_OK(Decode(Encode(report), &report_out));
  EXPECT_EQ(report_out.event, "restore");
  EXPECT_EQ(report_out.step, 7u);
  EXPECT_EQ(report_out.nanos, 1500000000u);
  EXPECT_EQ(report_out.bytes, 4096u);
  EXPECT_EQ(report_out.source, "memory");
  EXPECT_EQ(report_out.error, "");
  EXPECT_EQ(report_out.level, "");
  report.level = "tier 1";
  ASSERT_OK(Decode(Encode(report), &report_out));
  EXPECT_EQ(report_out.level, "tier 1");
  EXPECT_NE(Decode(R"({"event":"save","step":1,"saved":true,"nanos":-1,"bytes":0})", &report_out)
                .message()
                .find("'nanos'"),
            std::string::npos);

  // A wait for replication only; an older client's wait (no field) is for a persisted step.
  WaitRequest wait{4, false}, wait_out;
  ASSERT_OK(Decode(Encode(wait), &wait_out));
  EXPECT_FALSE(wait_out.persisted);
  ASSERT_OK(Decode(R"({"step": 4})", &wait_out));
  EXPECT_TRUE(wait_out.persisted);
}

TEST(MessageTest, MembershipIsCheckedBeforeUse) {
  Membership out;
  // node_index outside the list of nodes
  EXPECT_NE(Decode(R"({"epoch":"e","node_index":2,"nodes":[{"node":"a","address":"x:1"}],)"
                   R"("redundancy":"mirror","secret":"00","bandwidth":0})",
                   &out)
                .message()
                .find("node_index 2"),
            std::string::npos);
  // a node without its address
  EXPECT_NE(Decode(R"({"epoch":"e","node_index":0,"nodes":[{"node":"a"}],)"
                   R"("redundancy":"mirror","secret":"00","bandwidth":0})",
                   &out)
                .message()
                .find("field 'address' is missing"),
            std::string::npos);
  EXPECT_NE(Decode(R"({"epoch":"e","node_index":0,"nodes":5,)"
                   R"("redundancy":"mirror","secret":"00","bandwidth":0})",
                   &out)
                .message()
                .find("'nodes'"),
            std::string::npos);
  PeerListReply list;
  EXPECT_NE(
      Decode(R"({"snapshots":[{"step":1}]})", &list).message().find("field 'attempt' is missing"),
      std::string::npos);
}

// Every defect in a payload is an InvalidArgument that names what is wrong; nothing throws.
TEST(MessageTest, MalformedPayloadsAreErrorsNamingTheField) {
  struct Case {
    std::string payload;
    std::string says;
  };
  const Case cases[] = {
      {"", "field 'rank' is missing"},
      {"{", "not valid JSON"},
      {"[1]", "not a JSON object"},
      {R"({"rank": 0, "world_size": 1, "storage": "/c"})", "field 'keep' is missing"},
      {R"({"rank": -1, "world_size": 1, "storage": "/c", "keep": 1})", "field 'rank'"},
      {R"({"rank": 4294967296, "world_size": 1, "storage": "/c", "keep": 1})", "field 'rank'"},
      {R"({"rank": 0, "world_size": "1", "storage": "/c", "keep": 1})", "field 'world_size'"},
      {R"({"rank": 0, "world_size": 1, "storage": 5, "keep": 1})", "field 'storage'"},
      {R"({"rank": 0.5, "world_size": 1, "storage": "/c", "keep": 1})", "field 'rank'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.payload);
    HelloRequest out;
    const Status s = Decode(c.payload, &out);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s.message();
  }
  // A snapshot note's skip ranges and its report (a REPORT's object), each malformed.
  const std::pair<std::string, std::string> bad_fields[] = {{"skip", R"([[1]])"},
                                                            {"skip", R"([[1, 2, 3]])"},
                                                            {"skip", R"([["a", 2]])"},
                                                            {"skip", R"({"a": 1})"},
                                                            {"skip", R"([[1, 4294967296]])"},
                                                            {"report", R"("save")"},
                                                            {"report", R"({"event": "save"})"}};
  for (const auto& [field, value] : bad_fields) {
    SCOPED_TRACE(field + ": " + value);
    SnapshotNote note;
    const std::string payload = R"({"slot": 0, "generation": 1, "step": 2, "persist": true,
                                    "leased": false, ")" +
                                field + "\": " + value + "}";
    EXPECT_EQ(Decode(payload, &note).code(), StatusCode::kInvalidArgument);
  }
  WaitReply reply;
  EXPECT_EQ(Decode(R"({"step": 1, "ok": false})", &reply).code(), StatusCode::kInvalidArgument);
  EmptyRequest empty;
  EXPECT_OK(Decode("", &empty));
  EXPECT_OK(Decode("{}", &empty));
  EXPECT_EQ(Decode("[]", &empty).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace safepoint::protocol_test
