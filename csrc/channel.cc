#include "channel.h"

#include <utility>

namespace tfray {
namespace {

using Clock = std::chrono::steady_clock;

int64_t ElapsedNs(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() -
                                                              start)
      .count();
}

// Waits on `cv` until `ready()`. A negative, NaN or huge timeout waits
// without limit: wait_for() would overflow converting it to nanoseconds.
template <typename Pred>
bool WaitFor(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
             double timeout_s, Pred ready) {
  if (!(timeout_s >= 0 && timeout_s < 1e9)) {
    cv.wait(lock, ready);
    return true;
  }
  return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
}

}  // namespace

std::shared_ptr<ReleaseQueue> ReleaseQueue::Global() {
  // Leaked on purpose: tensors may be freed by TF threads during interpreter
  // and static teardown, after any static destructor would have run.
  static auto* queue = new std::shared_ptr<ReleaseQueue>(new ReleaseQueue);
  return *queue;
}

void ReleaseQueue::Release(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    released_.push_back(id);
  }
  cv_.notify_one();
}

std::vector<uint64_t> ReleaseQueue::Drain(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  WaitFor(cv_, lock, timeout_s, [this] { return !released_.empty(); });
  std::vector<uint64_t> out;
  out.swap(released_);
  return out;
}

Channel::Channel(size_t capacity)
    : created_(Clock::now()), capacity_(capacity == 0 ? 1 : capacity) {}

Channel::~Channel() { Cancel(); }

Channel::Item Channel::BatchItem(Batch batch) {
  Item item;
  for (const ArrayRef& a : batch.arrays) {
    item.bytes += a.nbytes;
    if (a.in_store) {
      item.bytes_in_store += a.nbytes;
      ++item.arrays_in_store;
    }
  }
  item.batch = std::move(batch);
  return item;
}

Channel::PushResult Channel::Push(Batch batch, double timeout_s,
                                  int64_t bytes_copied, int64_t arrays_copied) {
  return PushItem(BatchItem(std::move(batch)), timeout_s, bytes_copied,
                  arrays_copied);
}

Channel::PushResult Channel::PushError(Code code, std::string message,
                                       double timeout_s) {
  Item item;
  item.code = code == Code::kOk ? Code::kUnknown : code;
  item.message = std::move(message);
  return PushItem(std::move(item), timeout_s, 0, 0);
}

Channel::PushResult Channel::PushItem(Item item, double timeout_s,
                                      int64_t bytes_copied,
                                      int64_t arrays_copied) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto start = Clock::now();
  const bool ready = WaitFor(not_full_, lock, timeout_s, [this] {
    return cancelled_ || items_.size() < capacity_;
  });
  stats_.producer_wait_ns += ElapsedNs(start);
  if (cancelled_) return PushResult::kCancelled;
  if (!ready) return PushResult::kTimeout;
  if (item.code == Code::kOk) {
    ++stats_.batches_pushed;
    stats_.bytes_pushed += item.bytes;
  }
  item.bytes_copied = bytes_copied;
  item.arrays_copied = arrays_copied;
  items_.push_back(std::move(item));
  lock.unlock();
  not_empty_.notify_one();
  return PushResult::kOk;
}

void Channel::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  not_empty_.notify_all();
}

Channel::PopResult Channel::Pop(Batch* batch, Code* code,
                                std::string* message, bool wait) {
  Item item;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [this] { return cancelled_ || closed_ || !items_.empty(); };
    if (!wait && !ready()) return PopResult::kEmpty;
    ++stats_.get_next_calls;
    const auto start = Clock::now();
    not_empty_.wait(lock, ready);
    stats_.consumer_wait_ns += ElapsedNs(start);
    stats_.active_ns = ElapsedNs(created_);
    if (cancelled_) return PopResult::kCancelled;
    if (items_.empty()) return PopResult::kEnd;
    item = std::move(items_.front());
    items_.pop_front();
    ++items_taken_;
    if (item.code == Code::kOk) {
      ++stats_.batches_delivered;
      stats_.bytes_delivered += item.bytes;
      stats_.arrays_delivered += item.batch.arrays.size();
      stats_.bytes_in_store += item.bytes_in_store;
      stats_.arrays_in_store += item.arrays_in_store;
      stats_.bytes_copied += item.bytes_copied;
      stats_.arrays_copied += item.arrays_copied;
    }
  }
  not_full_.notify_one();
  if (item.code != Code::kOk) {
    *code = item.code;
    *message = std::move(item.message);
    return PopResult::kError;
  }
  if (item.batch.token) item.batch.token->Hold(held_, item.bytes_in_store);
  *batch = std::move(item.batch);
  return PopResult::kBatch;
}

void Channel::Cancel() {
  std::deque<Item> dropped;  // Released outside the lock.
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    dropped.swap(items_);
  }
  not_empty_.notify_all();
  not_full_.notify_all();
}

void Channel::Preload(const std::vector<Batch>& batches, size_t start) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = start; i < batches.size(); ++i) {
      Item item = BatchItem(batches[i]);
      ++stats_.batches_pushed;
      stats_.bytes_pushed += item.bytes;
      items_.push_back(std::move(item));
    }
    closed_ = true;
  }
  not_empty_.notify_all();
}

size_t Channel::capacity() const { return Locked(capacity_); }

size_t Channel::room() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_ || items_.size() >= capacity_) return 0;
  return capacity_ - items_.size();
}

void Channel::SetCapacity(size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    capacity_ = capacity == 0 ? 1 : capacity;
  }
  not_full_.notify_all();
}

bool Channel::cancelled() const { return Locked(cancelled_); }

int64_t Channel::items_taken() const { return Locked(items_taken_); }

bool Channel::claimed() const { return Locked(claimed_); }

std::string Channel::resume_info() const { return Locked(resume_info_); }

void Channel::SetResumeInfo(std::string info) {
  std::lock_guard<std::mutex> lock(mu_);
  resume_info_ = std::move(info);
}

void Channel::Claim() {
  std::lock_guard<std::mutex> lock(mu_);
  claimed_ = true;
}

ChannelStats Channel::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ChannelStats s = stats_;
  s.queued = static_cast<int64_t>(items_.size());
  s.bytes_held = bytes_held();
  s.closed = closed_;
  s.cancelled = cancelled_;
  return s;
}

void Progress::Took(const Origin& origin) {
  if (origin.unit < 0) return;
  Unit& unit = units_[origin.unit];
  ++unit.batches;
  if (origin.index == 0) ++unit.bundles;
  last_ = origin;
}

std::vector<int64_t> Progress::Encode() const {
  std::vector<int64_t> out;
  if (units_.empty()) return out;
  out.reserve(3 + 3 * units_.size());
  out.insert(out.end(), {last_.unit, last_.index + 1, last_.size});
  for (const auto& [id, unit] : units_) {
    out.insert(out.end(), {id, unit.batches, unit.bundles});
  }
  return out;
}

bool Progress::Decode(const std::vector<int64_t>& encoded) {
  if (encoded.empty()) {
    *this = Progress();
    return true;
  }
  if (encoded.size() < 6 || encoded.size() % 3 != 0) return false;
  Progress decoded;
  decoded.last_ = {encoded[0], encoded[1] - 1, encoded[2]};
  if (decoded.last_.index < 0 || decoded.last_.index >= decoded.last_.size) {
    return false;
  }
  for (size_t i = 3; i < encoded.size(); i += 3) {
    if (encoded[i + 1] < 0 || encoded[i + 2] < 0) return false;
    decoded.units_[encoded[i]] = {encoded[i + 1], encoded[i + 2]};
  }
  if (decoded.units_.count(decoded.last_.unit) == 0) return false;
  *this = std::move(decoded);
  return true;
}

void Recording::Add(const Batch& batch) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const ArrayRef& a : batch.arrays) bytes_ += a.nbytes;
  batches_.push_back(batch);
}

size_t Recording::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return batches_.size();
}

int64_t Recording::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

std::vector<Batch> Recording::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ = 0;
  return std::move(batches_);
}

SourceRegistry& SourceRegistry::Global() {
  static auto* registry = new SourceRegistry;  // Leaked, like the queue.
  return *registry;
}

void SourceRegistry::Register(int64_t key, SourceInfo info) {
  std::lock_guard<std::mutex> lock(mu_);
  sources_[key] = info;
}

void SourceRegistry::Unregister(int64_t key) {
  std::shared_ptr<Channel> offered;
  std::shared_ptr<const std::vector<Batch>> replay;  // Released outside the lock.
  {
    std::lock_guard<std::mutex> lock(mu_);
    sources_.erase(key);
    auto it = offered_.find(key);
    if (it != offered_.end()) {
      offered = std::move(it->second);
      offered_.erase(it);
    }
    auto r = replays_.find(key);
    if (r != replays_.end()) {
      replay = std::move(r->second);
      replays_.erase(r);
    }
  }
  if (offered) offered->Cancel();  // Stops its feeder; no iterator will read it.
}

bool SourceRegistry::Lookup(int64_t key, SourceInfo* info) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sources_.find(key);
  if (it == sources_.end()) return false;
  *info = it->second;
  return true;
}

bool SourceRegistry::RequestEpoch(Request request,
                                  std::shared_ptr<Channel>* reads) {
  std::shared_ptr<const std::vector<Batch>> replay;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sources_.count(request.key) == 0) return false;
    auto r = replays_.find(request.key);
    if (r != replays_.end() && request.skip >= 0 &&
        static_cast<size_t>(request.skip) <= r->second->size()) {
      replay = r->second;
    }
  }
  bool (*alive)() = session_alive_.load();
  if (replay && (alive == nullptr || !alive())) replay = nullptr;
  request.replayed = replay != nullptr;
  if (replay) {  // Outside the lock: copying the batches takes a while.
    request.channel->Preload(*replay, static_cast<size_t>(request.skip));
    if (reads != nullptr) *reads = request.channel;
    {
      std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(std::move(request));
    }
    cv_.notify_all();
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sources_.count(request.key) == 0) return false;
    auto offer = offered_.find(request.key);
    if (offer != offered_.end() && request.skip == 0) {
      request.channel = std::move(offer->second);
      request.channel->Claim();
      request.offered = true;
      offered_.erase(offer);
    }
    if (reads != nullptr) *reads = request.channel;
    requests_.push_back(std::move(request));
  }
  cv_.notify_all();
  return true;
}

bool SourceRegistry::OfferEpoch(int64_t key, std::shared_ptr<Channel> channel) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sources_.count(key) == 0 || offered_.count(key) != 0 ||
      replays_.count(key) != 0) {
    return false;
  }
  offered_[key] = std::move(channel);
  return true;
}

bool SourceRegistry::SetReplay(int64_t key, std::vector<Batch> batches) {
  auto replay =
      std::make_shared<const std::vector<Batch>>(std::move(batches));
  std::shared_ptr<Channel> offered;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sources_.count(key) == 0) return false;
    replays_[key] = std::move(replay);
    auto it = offered_.find(key);
    if (it != offered_.end()) {
      offered = std::move(it->second);
      offered_.erase(it);
    }
  }
  if (offered) offered->Cancel();
  return true;
}

bool SourceRegistry::HasReplay(int64_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return replays_.count(key) != 0;
}

size_t SourceRegistry::ReplayedBatches() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& entry : replays_) n += entry.second->size();
  return n;
}

void SourceRegistry::SetSessionProbe(bool (*alive)()) {
  session_alive_.store(alive);
}

void SourceRegistry::EndSession() {
  std::unordered_map<int64_t, std::shared_ptr<Channel>> offered;
  std::unordered_map<int64_t, std::shared_ptr<const std::vector<Batch>>>
      replays;  // Released outside the lock.
  {
    std::lock_guard<std::mutex> lock(mu_);
    offered.swap(offered_);
    replays.swap(replays_);
  }
  for (auto& entry : offered) entry.second->Cancel();
}

void SourceRegistry::PostEnded(int64_t key, std::shared_ptr<Channel> channel) {
  Request notice;
  notice.key = key;
  notice.channel = std::move(channel);
  notice.ended = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    requests_.push_back(std::move(notice));
  }
  cv_.notify_all();
}

std::vector<SourceRegistry::Request> SourceRegistry::WaitRequests(
    double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  WaitFor(cv_, lock, timeout_s, [this] { return !requests_.empty(); });
  std::vector<Request> out;
  out.swap(requests_);
  return out;
}

}  // namespace tfray
