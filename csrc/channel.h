// The native channel between one feeder (Python, in the trainer process) and
// one tf.data iterator (C++). Plain C++17: no TensorFlow, no Python, so it can
// be tested alone (tests/native/channel_test.cc).
//
// Ownership of batch memory never moves through here: a batch carries a
// ReleaseToken, and whoever drops the last copy of that token (normally the
// last tf.Tensor that aliases the batch) posts its id to the ReleaseQueue,
// from which the feeder side drops the Python reference. Nothing in this file
// ever calls into Python, so no TensorFlow thread can take the GIL through it.
#ifndef TFRAY_CSRC_CHANNEL_H_
#define TFRAY_CSRC_CHANNEL_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace tfray {

// Process-wide queue of released token ids. TF threads push (never block for
// long: one mutex, one notify); one Python thread drains.
class ReleaseQueue {
 public:
  static std::shared_ptr<ReleaseQueue> Global();

  void Release(uint64_t id);
  // Waits up to `timeout_s` for released ids and returns all of them.
  std::vector<uint64_t> Drain(double timeout_s);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> released_;  // Guarded by mu_.
};

// Posts `id` to its queue when destroyed. Shared by every tensor of a batch.
class ReleaseToken {
 public:
  ReleaseToken(std::shared_ptr<ReleaseQueue> queue, uint64_t id)
      : queue_(std::move(queue)), id_(id) {}
  ~ReleaseToken() {
    if (held_) held_->fetch_sub(held_bytes_, std::memory_order_relaxed);
    queue_->Release(id_);
  }
  ReleaseToken(const ReleaseToken&) = delete;
  ReleaseToken& operator=(const ReleaseToken&) = delete;

  // Adds `bytes` to `held` until the token goes: the batch's store bytes
  // TensorFlow holds, counted by the first channel to deliver it (a
  // replayed batch is delivered again, but pinned once).
  void Hold(const std::shared_ptr<std::atomic<int64_t>>& held, int64_t bytes) {
    if (bytes <= 0 || holding_.exchange(true)) return;
    held_ = held;
    held_bytes_ = bytes;
    held->fetch_add(bytes, std::memory_order_relaxed);
  }

 private:
  std::shared_ptr<ReleaseQueue> queue_;
  uint64_t id_;
  std::atomic<bool> holding_{false};
  // Set once by Hold, read by the destructor: the last owner's release
  // orders the two.
  std::shared_ptr<std::atomic<int64_t>> held_;
  int64_t held_bytes_ = 0;
};

// Whether memory at `data` may back a tensor as it is: TensorFlow's kernels
// assume tensors aligned to `alignment` bytes (TFRAY_TENSOR_ALIGNMENT).
inline bool IsAligned(const void* data, size_t alignment) {
  return reinterpret_cast<uintptr_t>(data) % alignment == 0;
}

// One tensor's worth of memory, described but not owned.
struct ArrayRef {
  const void* data = nullptr;
  size_t nbytes = 0;
  int dtype = 0;  // A tensorflow::DataType value; opaque here.
  std::vector<int64_t> shape;
  // Whether the bytes lie in Ray's object store, by address (store_map.h),
  // decided when the batch is made: zero-copy in the stats.
  bool in_store = false;
};

// Where a batch lies in its epoch, for a source made of work units (a
// generator's shards): its unit, and its place in the bundle (the one Ray
// object of consecutive batches) it came in. A unit below 0: none.
struct Origin {
  int64_t unit = -1;
  int64_t index = 0;  // In its bundle.
  int64_t size = 1;   // Its bundle's batches.
};

struct Batch {
  std::vector<ArrayRef> arrays;
  std::shared_ptr<ReleaseToken> token;  // Keeps `arrays` valid while held.
  Origin origin;
};

// What an iterator has handed out of each work unit: the resume point its
// checkpoint saves (dataset_op.cc) and a restored epoch starts its units
// from (sources/resume.py reads the same encoding). One owner: the
// iterator, under its lock.
class Progress {
 public:
  // Counts one batch handed out.
  void Took(const Origin& origin);
  // Empty when no batch had a unit. Otherwise the last batch's unit, how
  // many of its bundle were handed out and the bundle's size; then, per
  // unit in increasing order, the unit, its batches and its bundles begun.
  std::vector<int64_t> Encode() const;
  // The inverse of Encode; false (and nothing changed) if `encoded` is not
  // one of its results.
  bool Decode(const std::vector<int64_t>& encoded);

 private:
  struct Unit {
    int64_t batches = 0;
    int64_t bundles = 0;
  };
  std::map<int64_t, Unit> units_;
  Origin last_;
};

// Status codes follow absl::StatusCode numbering so the kernel can map them
// one to one, without this file depending on absl.
enum class Code : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kNotFound = 5,
  kFailedPrecondition = 9,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

struct ChannelStats {
  int64_t batches_pushed = 0;
  int64_t bytes_pushed = 0;
  int64_t batches_delivered = 0;
  int64_t bytes_delivered = 0;
  int64_t arrays_delivered = 0;
  // Of the delivered arrays, those whose bytes lie in Ray's object store
  // (ArrayRef::in_store): TensorFlow reads the store's own bytes.
  int64_t bytes_in_store = 0;
  int64_t arrays_in_store = 0;
  // Of the delivered batches, what the feeder had to copy (it reports the
  // copies it made with each batch): tfray's copies, apart from upstream's.
  int64_t bytes_copied = 0;
  int64_t arrays_copied = 0;
  int64_t get_next_calls = 0;
  int64_t consumer_wait_ns = 0;  // GetNext waiting on an empty channel.
  int64_t producer_wait_ns = 0;  // Feeder waiting on a full channel.
  int64_t queued = 0;
  // Store bytes of delivered batches that TensorFlow still holds (a
  // shuffle buffer, a cache, tensors kept): each pins its Ray object.
  int64_t bytes_held = 0;
  // From the channel's creation (the iterator's) to the last Pop's return:
  // the span of the epoch the consumer saw.
  int64_t active_ns = 0;
  bool closed = false;     // The feeder has said the epoch is over.
  bool cancelled = false;  // The consumer has gone away.
};

// A bounded FIFO of batches and errors, one per iterator (= one epoch).
class Channel {
 public:
  enum class PushResult { kOk, kCancelled, kTimeout };
  // kEmpty: nothing to pop yet (Pop without `wait` only).
  enum class PopResult { kBatch, kError, kEnd, kCancelled, kEmpty };

  explicit Channel(size_t capacity);
  ~Channel();

  // Producer side (one producer per channel; nothing may be pushed after
  // Close). Push blocks while the channel is full, up to `timeout_s`
  // (negative: no limit), and returns early when the consumer cancels. A
  // batch that is not queued is dropped, releasing its token.
  // `bytes_copied`/`arrays_copied` account copies the feeder had to make.
  PushResult Push(Batch batch, double timeout_s, int64_t bytes_copied = 0,
                  int64_t arrays_copied = 0);
  // Queues an error in order with the batches; the stream may go on after it.
  PushResult PushError(Code code, std::string message, double timeout_s);
  // No more items: the consumer sees end of sequence after the queued ones.
  void Close();

  // Consumer side. Blocks until an item, the end, or cancellation; without
  // `wait`, returns kEmpty at once instead of blocking (a GetNext records a
  // wait only when there is one). The call that returns anything else is
  // the one counted in `get_next_calls`.
  PopResult Pop(Batch* batch, Code* code, std::string* message,
                bool wait = true);
  // Wakes both sides and drops queued batches (releasing their tokens).
  void Cancel();

  // Queues copies of batches[start:] whatever the capacity, then closes:
  // an epoch already in memory (SourceRegistry::SetReplay). Nothing may be
  // pushed before or after.
  void Preload(const std::vector<Batch>& batches, size_t start);

  bool cancelled() const;
  // Items (batches and errors) the consumer has popped, in the order they
  // were pushed: what TensorFlow has taken of the epoch.
  int64_t items_taken() const;
  // Whether an iterator reads this channel; set when one takes an offered
  // epoch (SourceRegistry::RequestEpoch), before the dispatcher hears of it.
  bool claimed() const;
  void Claim();
  // What a restore must know of how this epoch was made (its source's
  // JSON: the job's generation, the share, the interleave), saved with a
  // checkpoint; empty: nothing. Set by the dispatcher before the feeder
  // starts.
  std::string resume_info() const;
  void SetResumeInfo(std::string info);
  size_t capacity() const;
  // Batches the channel takes now without waiting (0 once cancelled). Only
  // its one producer fills it, so that many pushes in a row will not block.
  size_t room() const;
  // Lets the producer adapt how far ahead it may run (its look-ahead).
  void SetCapacity(size_t capacity);
  ChannelStats Stats() const;
  // ChannelStats::bytes_held alone, without the lock.
  int64_t bytes_held() const { return held_->load(std::memory_order_relaxed); }

 private:
  struct Item {
    Batch batch;
    Code code = Code::kOk;  // kOk: a batch; otherwise an error.
    std::string message;
    int64_t bytes = 0;
    int64_t bytes_in_store = 0;
    int64_t arrays_in_store = 0;
    int64_t bytes_copied = 0;
    int64_t arrays_copied = 0;
  };

  // An item carrying `batch`, its byte counts filled in.
  static Item BatchItem(Batch batch);

  PushResult PushItem(Item item, double timeout_s, int64_t bytes_copied,
                      int64_t arrays_copied);

  // A field guarded by mu_, read under it.
  template <typename T>
  T Locked(const T& field) const {
    std::lock_guard<std::mutex> lock(mu_);
    return field;
  }

  const std::chrono::steady_clock::time_point created_;
  mutable std::mutex mu_;
  size_t capacity_;  // Guarded by mu_.
  std::condition_variable not_empty_;
  std::condition_variable not_full_;
  std::deque<Item> items_;  // Guarded by mu_.
  bool closed_ = false;     // Guarded by mu_.
  bool cancelled_ = false;  // Guarded by mu_.
  bool claimed_ = false;    // Guarded by mu_.
  std::string resume_info_;  // Guarded by mu_.
  int64_t items_taken_ = 0;  // Guarded by mu_.
  ChannelStats stats_;      // Guarded by mu_.
  // Delivered batches' store bytes not yet released (ReleaseToken::Hold);
  // shared with their tokens, which may outlive the channel.
  const std::shared_ptr<std::atomic<int64_t>> held_ =
      std::make_shared<std::atomic<int64_t>>(0);
};

// The batches of one epoch as they were pushed, kept so that later epochs
// can be served from them (SourceRegistry::SetReplay). A kept batch keeps
// its token, so its memory stays valid and pinned while the recording, a
// replay or a tensor holds it.
class Recording {
 public:
  void Add(const Batch& batch);
  size_t size() const;
  int64_t bytes() const;
  // Moves the batches out; the recording is empty after.
  std::vector<Batch> Take();

 private:
  mutable std::mutex mu_;
  std::vector<Batch> batches_;  // Guarded by mu_.
  int64_t bytes_ = 0;           // Guarded by mu_.
};

// Maps a source key (what the dataset graph serializes) to the requests for
// new epochs. A TF iterator asks for an epoch by handing over a fresh channel;
// the Python dispatcher takes the request and starts a feeder on it. For a
// source that replays the same batches every epoch, the dispatcher may offer
// a channel a feeder is already filling with the next epoch: the next
// iterator takes it at once, with no Python on its path. A source whose
// whole epoch stays pinned within its bounds may go further: the dispatcher
// sets a replay, the batches of a recorded epoch, and every later iterator
// is served from it here, natively (no feeder, no Ray call, no GIL).
class SourceRegistry {
 public:
  static SourceRegistry& Global();

  struct SourceInfo {
    int64_t cardinality = -2;  // tf.data's UNKNOWN_CARDINALITY.
    size_t capacity = 1;       // Batches each epoch's channel may hold.
  };

  void Register(int64_t key, SourceInfo info);
  void Unregister(int64_t key);
  // Returns false if `key` is not registered (its dataset was collected).
  bool Lookup(int64_t key, SourceInfo* info) const;
  struct Request {
    int64_t key = 0;
    std::shared_ptr<Channel> channel;
    // tf.data.Options().deterministic as the pipeline set it (default true):
    // sources that can interleave producers follow it unless told otherwise.
    bool deterministic = true;
    // Items of the epoch to pass over before the first one delivered: the
    // position a restored checkpoint resumes from.
    int64_t skip = 0;
    // The restored checkpoint's Progress (encoded), for a source that can
    // start each unit where it was; empty if it saved none.
    std::vector<int64_t> progress;
    // The restored checkpoint's Channel::resume_info, if any.
    std::string resume_info;
    // Set on the notice the dispatcher gets when an iterator took an
    // offered channel (`channel`); no new feeder is wanted for it.
    bool offered = false;
    // Set on the notice the dispatcher gets when the iterator was served
    // from the source's replay: nothing to start, only to count.
    bool replayed = false;
    // Set on the notice a feeder posts once every batch of its epoch is in
    // `channel`: the dispatcher, not the feeder's thread, decides whether
    // to keep the epoch to replay or to open the next one.
    bool ended = false;
  };
  // Returns false if `key` is not registered. Otherwise `*reads` (if given)
  // is the channel the iterator reads: `request.channel`, preloaded and
  // closed if the source has a replay; else an offered one when there is
  // one and nothing is to be skipped; else `request.channel`, for the
  // dispatcher to start a feeder on.
  bool RequestEpoch(Request request, std::shared_ptr<Channel>* reads = nullptr);
  // Offers `channel` to the next iterator of `key`. False (and nothing kept)
  // if `key` is not registered or already has an offer.
  bool OfferEpoch(int64_t key, std::shared_ptr<Channel> channel);
  // Serves every later epoch of `key` from `batches` (a whole epoch, in
  // order) until Unregister or EndSession, and withdraws its offer. False
  // (and nothing kept) if `key` is not registered.
  bool SetReplay(int64_t key, std::vector<Batch> batches);
  bool HasReplay(int64_t key) const;
  // The batches every replay keeps, in all: pinned by design, not leaked.
  size_t ReplayedBatches() const;
  // Ray shut down: drops every replay and offer, so that each new epoch
  // goes to the dispatcher, which reports the shutdown.
  void EndSession();
  // `alive()` says whether this process's Ray session is up; asked (without
  // the GIL) before a replay serves an epoch, so that none is served once
  // ray.shutdown() began. Without one, no replay serves.
  void SetSessionProbe(bool (*alive)());
  // Posts the notice that the epoch `channel` carries of `key` has ended.
  void PostEnded(int64_t key, std::shared_ptr<Channel> channel);
  // Waits up to `timeout_s` for requests and returns all pending ones.
  std::vector<Request> WaitRequests(double timeout_s);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int64_t, SourceInfo> sources_;  // Guarded by mu_.
  std::vector<Request> requests_;                     // Guarded by mu_.
  std::unordered_map<int64_t, std::shared_ptr<Channel>>
      offered_;  // Guarded by mu_.
  std::unordered_map<int64_t, std::shared_ptr<const std::vector<Batch>>>
      replays_;  // Guarded by mu_.
  std::atomic<bool (*)()> session_alive_{nullptr};
};

}  // namespace tfray

#endif  // TFRAY_CSRC_CHANNEL_H_
