// Unit test for the native channel (csrc/channel.h). Plain C++17, no gtest:
// the channel has no TensorFlow or Python dependency, and keeping the test
// equally bare lets tests/test_channel_native.py build it with nothing but
// g++ and run it under ASan/UBSan.
//
// Every wait in here is bounded, so a broken wake-up shows up as a failed
// CHECK instead of a hung test run.
#include <algorithm>
#include <atomic>
#include <functional>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "channel.h"

namespace tfray {
namespace {

// On failure, _Exit rather than exit: a failed wake-up check leaves a thread
// blocked on a channel, and running static teardown around it helps nobody.
#define CHECK(cond)                                                    \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__,      \
                   __LINE__, #cond);                                   \
      std::fflush(stderr);                                             \
      std::fflush(stdout);                                             \
      std::_Exit(1);                                                   \
    }                                                                  \
  } while (0)

using Clock = std::chrono::steady_clock;

// Long enough that a correct wake-up is never mistaken for a hang, even
// under sanitizers on a loaded machine; short enough to fail quickly.
constexpr double kWakeDeadlineS = 10.0;
// How long a thread must stay blocked before we believe it really blocks.
constexpr auto kBlockProbe = std::chrono::milliseconds(50);

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A batch whose arrays point at static bytes (their contents never matter
// here) and whose token posts `id` to the global ReleaseQueue.
Batch MakeBatch(uint64_t id, std::vector<size_t> nbytes) {
  static const char kBytes[1024] = {};
  Batch batch;
  batch.token = std::make_shared<ReleaseToken>(ReleaseQueue::Global(), id);
  for (size_t n : nbytes) {
    ArrayRef ref;
    ref.data = kBytes;
    ref.nbytes = n;
    ref.dtype = 1;
    ref.shape = {static_cast<int64_t>(n)};
    batch.arrays.push_back(std::move(ref));
  }
  return batch;
}

// Drops whatever earlier tests left in the process-wide release queue.
void ClearReleased() { ReleaseQueue::Global()->Drain(0); }

// Collects released ids until `want` of them arrived or the deadline passed;
// returns them sorted so callers can compare against a fixed list.
std::vector<uint64_t> DrainIds(size_t want) {
  std::vector<uint64_t> ids;
  const auto start = Clock::now();
  while (ids.size() < want) {
    const double left = kWakeDeadlineS - SecondsSince(start);
    if (left <= 0) break;
    for (uint64_t id : ReleaseQueue::Global()->Drain(left)) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Spins (politely) until `flag` is set or the deadline passes.
bool WaitForFlag(const std::atomic<bool>& flag) {
  const auto start = Clock::now();
  while (!flag.load()) {
    if (SecondsSince(start) > kWakeDeadlineS) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Starts a consumer on the empty `ch`, checks that it blocks, calls `wake`
// and returns what the consumer's Pop returned once woken.
Channel::PopResult PopWhileBlocked(Channel& ch,
                                   const std::function<void()>& wake) {
  std::atomic<bool> done{false};
  Channel::PopResult result = Channel::PopResult::kBatch;
  std::thread consumer([&] {
    Batch batch;
    Code code;
    std::string message;
    result = ch.Pop(&batch, &code, &message);
    done.store(true);
  });
  std::this_thread::sleep_for(kBlockProbe);
  CHECK(!done.load());
  wake();
  CHECK(WaitForFlag(done));
  consumer.join();
  return result;
}

// Guards that batches and errors reach the consumer in push order, and that
// Close lets queued items drain before a sticky end of sequence.
void TestFifoAndCloseDrains() {
  ClearReleased();
  Channel ch(8);
  Batch first = MakeBatch(101, {10});
  const void* first_data = first.arrays[0].data;
  CHECK(ch.Push(std::move(first), 0) == Channel::PushResult::kOk);
  CHECK(ch.PushError(Code::kInvalidArgument, "bad", 0) ==
        Channel::PushResult::kOk);
  CHECK(ch.Push(MakeBatch(102, {20, 30}), 0) == Channel::PushResult::kOk);
  // kOk is not an error; the channel must not let it pass as a batch.
  CHECK(ch.PushError(Code::kOk, "no code", 0) == Channel::PushResult::kOk);
  ch.Close();

  Batch batch;
  Code code = Code::kOk;
  std::string message;
  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kBatch);
  CHECK(batch.arrays.size() == 1);
  CHECK(batch.arrays[0].nbytes == 10);
  CHECK(batch.arrays[0].data == first_data);
  CHECK(batch.token != nullptr);

  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kError);
  CHECK(code == Code::kInvalidArgument);
  CHECK(message == "bad");

  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kBatch);
  CHECK(batch.arrays.size() == 2);
  CHECK(batch.arrays[1].nbytes == 30);

  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kError);
  CHECK(code == Code::kUnknown);
  CHECK(message == "no code");

  for (int i = 0; i < 3; ++i) {
    CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kEnd);
  }
  CHECK(ch.Stats().closed);
  CHECK(!ch.cancelled());

  // Popping batch 102 over batch 101 dropped 101's last holder; 102 is still
  // held by `batch`.
  batch = Batch();
  CHECK((DrainIds(2) == std::vector<uint64_t>{101, 102}));
}

// Guards that Close wakes a consumer already blocked on an empty channel,
// which would otherwise wait forever for an item that never comes.
// Pop without `wait` never blocks: kEmpty on an empty open channel, not
// counted as a GetNext; the item, the end or the cancellation otherwise.
void TestPopWithoutWaiting() {
  Channel ch(2);
  Batch batch;
  Code code = Code::kOk;
  std::string message;
  CHECK(ch.Pop(&batch, &code, &message, /*wait=*/false) ==
        Channel::PopResult::kEmpty);
  CHECK(ch.Stats().get_next_calls == 0);
  CHECK(ch.Push(MakeBatch(201, {8}), 0) == Channel::PushResult::kOk);
  CHECK(ch.Pop(&batch, &code, &message, /*wait=*/false) ==
        Channel::PopResult::kBatch);
  CHECK(ch.Stats().get_next_calls == 1 && ch.Stats().batches_delivered == 1);
  ch.Close();
  CHECK(ch.Pop(&batch, &code, &message, /*wait=*/false) ==
        Channel::PopResult::kEnd);
  Channel cancelled(1);
  cancelled.Cancel();
  CHECK(cancelled.Pop(&batch, &code, &message, /*wait=*/false) ==
        Channel::PopResult::kCancelled);
}

void TestCloseWakesBlockedConsumer() {
  Channel ch(1);
  CHECK(PopWhileBlocked(ch, [&] { ch.Close(); }) == Channel::PopResult::kEnd);
}

// Guards backpressure: a full channel blocks (or times out) the producer
// until the consumer makes room, and a refused batch is not kept.
void TestBoundedCapacityBlocksProducer() {
  ClearReleased();
  CHECK(Channel(0).capacity() == 1);  // Zero would deadlock every Push.

  Channel ch(2);
  CHECK(ch.capacity() == 2);
  CHECK(ch.Push(MakeBatch(201, {1}), 0) == Channel::PushResult::kOk);
  CHECK(ch.Push(MakeBatch(202, {1}), 0) == Channel::PushResult::kOk);

  const auto start = Clock::now();
  CHECK(ch.Push(MakeBatch(203, {1}), 0.05) == Channel::PushResult::kTimeout);
  CHECK(SecondsSince(start) >= 0.045);
  CHECK(ch.Stats().queued == 2);
  CHECK(ch.Stats().batches_pushed == 2);
  // The refused batch was dropped, so its token went with it.
  CHECK((DrainIds(1) == std::vector<uint64_t>{203}));

  std::atomic<bool> done{false};
  Channel::PushResult result = Channel::PushResult::kTimeout;
  std::thread producer([&] {
    // Twice the deadline WaitForFlag allows: only a wake-up by Pop, not the
    // timeout running out, can let this return in time.
    result = ch.Push(MakeBatch(204, {1}), 2 * kWakeDeadlineS);
    done.store(true);
  });
  std::this_thread::sleep_for(kBlockProbe);
  CHECK(!done.load());  // Still full: the producer must be waiting.

  Batch batch;
  Code code;
  std::string message;
  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kBatch);
  CHECK(WaitForFlag(done));
  producer.join();
  CHECK(result == Channel::PushResult::kOk);

  ChannelStats stats = ch.Stats();
  CHECK(stats.queued == 2);
  CHECK(stats.batches_pushed == 3);
  CHECK(stats.producer_wait_ns > 0);
}

// Guards that Cancel unblocks both sides, makes the channel refuse further
// work, and releases the tokens of batches it drops.
void TestCancelWakesBothSidesAndReleases() {
  ClearReleased();
  {
    // A producer stuck with no timeout on a full channel.
    Channel ch(1);
    CHECK(ch.Push(MakeBatch(301, {8}), 0) == Channel::PushResult::kOk);
    std::atomic<bool> done{false};
    Channel::PushResult result = Channel::PushResult::kOk;
    std::thread producer([&] {
      result = ch.Push(MakeBatch(302, {8}), -1);
      done.store(true);
    });
    std::this_thread::sleep_for(kBlockProbe);
    CHECK(!done.load());
    ch.Cancel();
    CHECK(WaitForFlag(done));
    producer.join();
    CHECK(result == Channel::PushResult::kCancelled);
    // 301 was queued and dropped by Cancel; 302 was refused.
    CHECK((DrainIds(2) == std::vector<uint64_t>{301, 302}));
    CHECK(ch.Stats().queued == 0);
    CHECK(ch.Stats().cancelled);
  }
  {
    // A consumer stuck on an empty channel.
    Channel ch(1);
    CHECK(PopWhileBlocked(ch, [&] { ch.Cancel(); }) ==
          Channel::PopResult::kCancelled);
  }
  {
    // After Cancel nothing gets in or out, even items queued before a Close.
    Channel ch(4);
    CHECK(ch.Push(MakeBatch(303, {8}), 0, /*bytes_copied=*/8,
                  /*arrays_copied=*/1) == Channel::PushResult::kOk);
    CHECK(ch.Push(MakeBatch(304, {8}), 0) == Channel::PushResult::kOk);
    ch.Close();
    ch.Cancel();
    CHECK((DrainIds(2) == std::vector<uint64_t>{303, 304}));
    CHECK(ch.cancelled());

    CHECK(ch.Push(MakeBatch(305, {8}), -1) ==
          Channel::PushResult::kCancelled);
    CHECK(ch.PushError(Code::kInternal, "late", -1) ==
          Channel::PushResult::kCancelled);
    CHECK((DrainIds(1) == std::vector<uint64_t>{305}));

    Batch batch;
    Code code;
    std::string message;
    for (int i = 0; i < 2; ++i) {
      CHECK(ch.Pop(&batch, &code, &message) ==
            Channel::PopResult::kCancelled);
    }
    CHECK(batch.token == nullptr);
    ChannelStats stats = ch.Stats();
    CHECK(stats.queued == 0);
    CHECK(stats.batches_pushed == 2);
    CHECK(stats.batches_delivered == 0);
    CHECK(stats.bytes_copied == 0);  // Dropped batches' copies never count.
    CHECK(stats.arrays_copied == 0);
  }
  {
    // The destructor cancels too, so a channel dropped with queued batches
    // does not pin their memory forever.
    auto ch = std::make_unique<Channel>(2);
    CHECK(ch->Push(MakeBatch(306, {8}), 0) == Channel::PushResult::kOk);
    ch.reset();
    CHECK((DrainIds(1) == std::vector<uint64_t>{306}));
  }
}

// Guards that a token shared by all of a batch's tensors posts its id once,
// and only when the last holder lets go.
void TestReleaseTokenPostsOnceOnLastHolder() {
  ClearReleased();
  auto token = std::make_shared<ReleaseToken>(ReleaseQueue::Global(), 401);
  std::shared_ptr<ReleaseToken> a = token;
  std::shared_ptr<ReleaseToken> b = token;
  Batch batch;
  batch.token = token;

  token.reset();
  a.reset();
  batch = Batch();
  CHECK(ReleaseQueue::Global()->Drain(0).empty());  // `b` still holds it.

  // An unrelated token is released on its own schedule.
  std::make_shared<ReleaseToken>(ReleaseQueue::Global(), 402).reset();
  CHECK((DrainIds(1) == std::vector<uint64_t>{402}));

  b.reset();
  CHECK((DrainIds(1) == std::vector<uint64_t>{401}));
  CHECK(ReleaseQueue::Global()->Drain(0).empty());  // Exactly once.

  // Drain honours its timeout when nothing comes...
  const auto start = Clock::now();
  CHECK(ReleaseQueue::Global()->Drain(0.05).empty());
  CHECK(SecondsSince(start) >= 0.045);

  // ...and wakes as soon as another thread releases a token.
  auto shared = std::make_shared<ReleaseToken>(ReleaseQueue::Global(), 403);
  std::thread releaser([held = std::move(shared)]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    held.reset();
  });
  const auto wake_start = Clock::now();
  std::vector<uint64_t> ids = ReleaseQueue::Global()->Drain(kWakeDeadlineS);
  CHECK(SecondsSince(wake_start) < kWakeDeadlineS);
  releaser.join();
  CHECK((ids == std::vector<uint64_t>{403}));
}

// Guards the counters the Python side reports: what each call adds, that
// copies count only once their batch is delivered, and that refused pushes
// and errors add no batch traffic.
void TestStats() {
  ClearReleased();
  Channel ch(3);
  ChannelStats s = ch.Stats();
  CHECK(s.batches_pushed == 0 && s.queued == 0 && s.get_next_calls == 0);
  CHECK(!s.closed && !s.cancelled);

  Batch first = MakeBatch(501, {100, 28});
  first.arrays[1].in_store = true;  // 28 bytes read in the store itself.
  CHECK(ch.Push(std::move(first), 0, /*bytes_copied=*/100,
                /*arrays_copied=*/1) == Channel::PushResult::kOk);
  CHECK(ch.Push(MakeBatch(502, {64}), 0, /*bytes_copied=*/64,
                /*arrays_copied=*/1) == Channel::PushResult::kOk);
  CHECK(ch.PushError(Code::kDataLoss, "lost", 0) == Channel::PushResult::kOk);
  // Full now: this one is refused and must not count, copies included.
  CHECK(ch.Push(MakeBatch(503, {1000}), 0.01, 7, 7) ==
        Channel::PushResult::kTimeout);

  s = ch.Stats();
  CHECK(s.batches_pushed == 2);
  CHECK(s.bytes_pushed == 192);
  CHECK(s.bytes_copied == 0);  // Nothing delivered yet.
  CHECK(s.arrays_copied == 0);
  CHECK(s.batches_delivered == 0);
  CHECK(s.bytes_delivered == 0);
  CHECK(s.get_next_calls == 0);
  CHECK(s.queued == 3);

  Batch batch;
  Code code;
  std::string message;
  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kBatch);
  s = ch.Stats();
  CHECK(s.batches_delivered == 1);
  CHECK(s.bytes_delivered == 128);
  CHECK(s.arrays_delivered == 2);
  CHECK(s.bytes_in_store == 28 && s.arrays_in_store == 1);
  CHECK(s.bytes_copied == 100);
  CHECK(s.arrays_copied == 1);
  CHECK(s.get_next_calls == 1);
  CHECK(s.queued == 2);

  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kBatch);
  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kError);
  CHECK(code == Code::kDataLoss);
  ch.Close();
  CHECK(ch.Pop(&batch, &code, &message) == Channel::PopResult::kEnd);

  s = ch.Stats();
  CHECK(s.batches_pushed == 2);
  CHECK(s.bytes_pushed == 192);
  CHECK(s.batches_delivered == 2);
  CHECK(s.bytes_delivered == 192);
  CHECK(s.arrays_delivered == 3);
  CHECK(s.bytes_in_store == 28 && s.arrays_in_store == 1);
  CHECK(s.bytes_copied == 164);
  CHECK(s.arrays_copied == 2);
  CHECK(s.get_next_calls == 4);  // Every Pop counts, the end included.
  CHECK(s.queued == 0);
  CHECK(s.closed);
  CHECK(!s.cancelled);
  CHECK(s.consumer_wait_ns >= 0 && s.producer_wait_ns >= 0);
}

// Guards bytes_held: a delivered batch's store bytes count until the last
// holder of its token lets go, in the channel that delivered it first, and
// once only (a replay delivers the same token again; it is pinned once).
void TestBytesHeld() {
  ClearReleased();
  auto first = std::make_unique<Channel>(4);
  Channel again(4);
  Batch stored = MakeBatch(701, {100, 28});
  stored.arrays[1].in_store = true;
  Batch copied = MakeBatch(702, {64});  // Not in the store: holds nothing there.
  std::vector<Batch> kept = {stored, copied};  // A recording's copies.
  CHECK(first->Push(std::move(stored), 0) == Channel::PushResult::kOk);
  CHECK(first->Push(std::move(copied), 0) == Channel::PushResult::kOk);
  CHECK(first->bytes_held() == 0);  // Queued is not delivered.

  Batch a, b;
  Code code;
  std::string message;
  CHECK(first->Pop(&a, &code, &message) == Channel::PopResult::kBatch);
  CHECK(first->bytes_held() == 28 && first->Stats().bytes_held == 28);
  CHECK(first->Pop(&b, &code, &message) == Channel::PopResult::kBatch);
  CHECK(first->bytes_held() == 28);

  again.Preload(kept, 0);
  Batch replayed;
  CHECK(again.Pop(&replayed, &code, &message) == Channel::PopResult::kBatch);
  CHECK(again.bytes_held() == 0);  // Counted where it was first delivered.

  a = Batch();  // TensorFlow drops its tensor; the recording and replay still hold it.
  CHECK(first->bytes_held() == 28);
  kept.clear();
  replayed = Batch();
  CHECK(first->bytes_held() == 0);
  again.Cancel();  // Drops the preloaded copy of the second batch.
  b = Batch();
  CHECK(DrainIds(2) == (std::vector<uint64_t>{701, 702}));

  // The counter outlives its channel: a batch let go after the channel is
  // gone still finds it (ASan would see a use after free).
  Batch late = MakeBatch(703, {16});
  late.arrays[0].in_store = true;
  CHECK(first->Push(std::move(late), 0) == Channel::PushResult::kOk);
  CHECK(first->Pop(&a, &code, &message) == Channel::PopResult::kBatch);
  CHECK(first->bytes_held() == 16);
  first.reset();
  a = Batch();
  CHECK(DrainIds(1) == (std::vector<uint64_t>{703}));
}

// Guards the key -> epoch-request handoff between TF iterators and the
// Python dispatcher.
void TestSourceRegistry() {
  SourceRegistry& registry = SourceRegistry::Global();
  registry.WaitRequests(0);  // Start from no pending requests.
  constexpr int64_t kKeyA = 1001;
  constexpr int64_t kKeyB = 1002;
  constexpr int64_t kUnknown = 1003;

  SourceRegistry::SourceInfo info;
  CHECK(!registry.Lookup(kUnknown, &info));
  auto unknown_channel = std::make_shared<Channel>(1);
  CHECK(!registry.RequestEpoch({kUnknown, unknown_channel}));
  CHECK(unknown_channel.use_count() == 1);  // Not kept anywhere.

  registry.Register(kKeyA, {/*cardinality=*/10, /*capacity=*/3});
  registry.Register(kKeyB, {/*cardinality=*/-1, /*capacity=*/1});
  CHECK(registry.Lookup(kKeyA, &info));
  CHECK(info.cardinality == 10 && info.capacity == 3);
  registry.Register(kKeyA, {/*cardinality=*/20, /*capacity=*/4});
  CHECK(registry.Lookup(kKeyA, &info));
  CHECK(info.cardinality == 20 && info.capacity == 4);  // Last one wins.

  // No requests: WaitRequests returns empty, but only after its timeout.
  auto start = Clock::now();
  CHECK(registry.WaitRequests(0.05).empty());
  CHECK(SecondsSince(start) >= 0.045);

  auto ch1 = std::make_shared<Channel>(4);
  auto ch2 = std::make_shared<Channel>(1);
  auto ch3 = std::make_shared<Channel>(4);
  CHECK(registry.RequestEpoch({kKeyA, ch1}));
  CHECK(registry.RequestEpoch({kKeyB, ch2}));
  CHECK(registry.RequestEpoch({kKeyA, ch3}));
  std::vector<SourceRegistry::Request> requests =
      registry.WaitRequests(kWakeDeadlineS);
  CHECK(requests.size() == 3);
  CHECK(requests[0].key == kKeyA && requests[0].channel == ch1);
  CHECK(requests[1].key == kKeyB && requests[1].channel == ch2);
  CHECK(requests[2].key == kKeyA && requests[2].channel == ch3);
  CHECK(registry.WaitRequests(0).empty());  // Taken, not copied.
  requests.clear();
  CHECK(ch1.use_count() == 1);

  // A request from another thread wakes a waiting dispatcher early.
  std::thread requester([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    registry.RequestEpoch({kKeyB, ch2});
  });
  start = Clock::now();
  requests = registry.WaitRequests(kWakeDeadlineS);
  CHECK(SecondsSince(start) < kWakeDeadlineS);
  requester.join();
  CHECK(requests.size() == 1);
  CHECK(requests[0].key == kKeyB && requests[0].channel == ch2);

  // A feeder's notice that its epoch ended wakes the dispatcher too.
  std::thread feeder([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    registry.PostEnded(kKeyA, ch1);
  });
  start = Clock::now();
  requests = registry.WaitRequests(kWakeDeadlineS);
  CHECK(SecondsSince(start) < kWakeDeadlineS);
  feeder.join();
  CHECK(requests.size() == 1);
  CHECK(requests[0].ended && requests[0].key == kKeyA &&
        requests[0].channel == ch1);
  CHECK(!requests[0].offered && !requests[0].replayed);
  requests.clear();

  registry.Unregister(kKeyA);
  CHECK(!registry.Lookup(kKeyA, &info));
  CHECK(!registry.RequestEpoch({kKeyA, ch1}));
  CHECK(registry.Lookup(kKeyB, &info));  // Only the named key goes.
  registry.Unregister(kKeyB);
  registry.Unregister(kUnknown);  // Unknown keys are a no-op.
  CHECK(!registry.Lookup(kKeyB, &info));
  CHECK(registry.WaitRequests(0).empty());
}

// An epoch offered ahead goes to the next request without skip, once; the
// dispatcher hears it was taken; unregistering cancels an untaken offer.
void TestOfferedEpochs() {
  SourceRegistry& registry = SourceRegistry::Global();
  registry.WaitRequests(0);
  constexpr int64_t kKey = 2001;
  auto offered = std::make_shared<Channel>(2);
  CHECK(!registry.OfferEpoch(kKey, offered));  // Not registered.
  CHECK(offered.use_count() == 1);
  registry.Register(kKey, {/*cardinality=*/5, /*capacity=*/2});
  CHECK(registry.OfferEpoch(kKey, offered));
  CHECK(!registry.OfferEpoch(kKey, std::make_shared<Channel>(2)));  // One at a time.

  // A restore (skip > 0) must replay from its position: not the offer.
  auto own = std::make_shared<Channel>(2);
  std::shared_ptr<Channel> reads;
  CHECK(registry.RequestEpoch({kKey, own, true, /*skip=*/3}, &reads));
  CHECK(reads == own);
  auto requests = registry.WaitRequests(0);
  CHECK(requests.size() == 1 && !requests[0].offered && requests[0].skip == 3);

  auto next = std::make_shared<Channel>(2);
  CHECK(registry.RequestEpoch({kKey, next}, &reads));
  CHECK(reads == offered);
  requests = registry.WaitRequests(0);
  CHECK(requests.size() == 1 && requests[0].offered);
  CHECK(requests[0].channel == offered);
  requests.clear();
  CHECK(registry.RequestEpoch({kKey, next}, &reads));
  CHECK(reads == next);  // Taken once only.
  CHECK(registry.WaitRequests(0).size() == 1);

  auto untaken = std::make_shared<Channel>(2);
  CHECK(registry.OfferEpoch(kKey, untaken));
  registry.Unregister(kKey);
  CHECK(untaken->Stats().cancelled);  // Its feeder stops.
  CHECK(untaken.use_count() == 1);
}

// Pops everything `ch` holds (it must be closed); returns the batches.
std::vector<Batch> PopAll(Channel& ch) {
  std::vector<Batch> out;
  Batch batch;
  Code code;
  std::string message;
  while (ch.Pop(&batch, &code, &message) == Channel::PopResult::kBatch) {
    out.push_back(std::move(batch));
  }
  return out;
}

// A replay serves every later request natively, from its position, sharing
// the recorded batches' tokens (released once, when the replay and every
// served copy are gone); it replaces and withdraws an offer, and
// EndSession or Unregister drops it.
void TestReplays() {
  SourceRegistry& registry = SourceRegistry::Global();
  registry.WaitRequests(0);
  ClearReleased();
  constexpr int64_t kKey = 3001;
  Recording recording;
  for (uint64_t id = 31; id <= 33; ++id) recording.Add(MakeBatch(id, {8, 4}));
  CHECK(recording.size() == 3 && recording.bytes() == 36);
  CHECK(!registry.SetReplay(kKey, recording.Take()));  // Not registered.
  CHECK(recording.size() == 0 && recording.bytes() == 0);
  CHECK(DrainIds(3) == (std::vector<uint64_t>{31, 32, 33}));  // Dropped.

  registry.Register(kKey, {/*cardinality=*/3, /*capacity=*/1});
  auto offered = std::make_shared<Channel>(1);
  CHECK(registry.OfferEpoch(kKey, offered));
  for (uint64_t id = 34; id <= 36; ++id) recording.Add(MakeBatch(id, {8}));
  CHECK(registry.SetReplay(kKey, recording.Take()));
  CHECK(registry.HasReplay(kKey) && registry.ReplayedBatches() == 3);
  CHECK(offered->Stats().cancelled);  // Withdrawn: its feeder stops.
  CHECK(!registry.OfferEpoch(kKey, std::make_shared<Channel>(1)));

  // Only while the session is up (and known to be): else the dispatcher's.
  for (bool (*probe)() : {static_cast<bool (*)()>(nullptr),
                          +[] { return false; }}) {
    registry.SetSessionProbe(probe);
    auto own = std::make_shared<Channel>(1);
    CHECK(registry.RequestEpoch({kKey, own}));
    CHECK(own->Stats().queued == 0 && !own->Stats().closed);
    auto requests = registry.WaitRequests(0);
    CHECK(requests.size() == 1 && !requests[0].replayed);
  }
  registry.SetSessionProbe(+[] { return true; });

  // Every request is served at once, whatever the capacity, from its skip.
  std::vector<Batch> served;
  for (int64_t skip : {0, 0, 2}) {
    auto own = std::make_shared<Channel>(1);
    std::shared_ptr<Channel> reads;
    CHECK(registry.RequestEpoch({kKey, own, true, skip}, &reads));
    CHECK(reads == own);
    ChannelStats stats = own->Stats();
    CHECK(stats.closed && stats.queued == 3 - skip);
    for (Batch& b : PopAll(*own)) served.push_back(std::move(b));
  }
  CHECK(served.size() == 3 + 3 + 1);
  CHECK(served[6].token == served[2].token);  // The same batch, shared.
  auto requests = registry.WaitRequests(0);
  CHECK(requests.size() == 3 && requests[0].replayed && !requests[0].offered);
  requests.clear();
  // Past its end: the dispatcher's.
  auto past = std::make_shared<Channel>(1);
  CHECK(registry.RequestEpoch({kKey, past, true, /*skip=*/4}));
  requests = registry.WaitRequests(0);
  CHECK(requests.size() == 1 && !requests[0].replayed);
  requests.clear();

  registry.EndSession();  // Ray shut down.
  registry.SetSessionProbe(nullptr);
  CHECK(!registry.HasReplay(kKey) && registry.ReplayedBatches() == 0);
  CHECK(ReleaseQueue::Global()->Drain(0.05).empty());  // Still served.
  served.clear();
  CHECK(DrainIds(3) == (std::vector<uint64_t>{34, 35, 36}));
  auto after = std::make_shared<Channel>(1);
  std::shared_ptr<Channel> reads;
  CHECK(registry.RequestEpoch({kKey, after}, &reads) && reads == after);
  CHECK(after->Stats().queued == 0);  // For the dispatcher to report.
  registry.WaitRequests(0);

  for (uint64_t id = 37; id <= 39; ++id) recording.Add(MakeBatch(id, {8}));
  CHECK(registry.SetReplay(kKey, recording.Take()));
  registry.Unregister(kKey);
  CHECK(!registry.HasReplay(kKey));
  CHECK(DrainIds(3) == (std::vector<uint64_t>{37, 38, 39}));
}

}  // namespace
}  // namespace tfray

int main() {
  struct TestCase {
    const char* name;
    void (*fn)();
  };
  const TestCase kTests[] = {
      {"FifoAndCloseDrains", tfray::TestFifoAndCloseDrains},
      {"PopWithoutWaiting", tfray::TestPopWithoutWaiting},
      {"OfferedEpochs", tfray::TestOfferedEpochs},
      {"Replays", tfray::TestReplays},
      {"CloseWakesBlockedConsumer", tfray::TestCloseWakesBlockedConsumer},
      {"BoundedCapacityBlocksProducer",
       tfray::TestBoundedCapacityBlocksProducer},
      {"CancelWakesBothSidesAndReleases",
       tfray::TestCancelWakesBothSidesAndReleases},
      {"ReleaseTokenPostsOnceOnLastHolder",
       tfray::TestReleaseTokenPostsOnceOnLastHolder},
      {"Stats", tfray::TestStats},
      {"BytesHeld", tfray::TestBytesHeld},
      {"SourceRegistry", tfray::TestSourceRegistry},
  };
  int passed = 0;
  for (const TestCase& test : kTests) {
    std::printf("[ RUN  ] %s\n", test.name);
    std::fflush(stdout);
    test.fn();  // A failed CHECK exits the process.
    std::printf("[  OK  ] %s\n", test.name);
    ++passed;
  }
  std::printf("%d passed, 0 failed\n", passed);
  return 0;
}
