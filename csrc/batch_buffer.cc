#include "batch_buffer.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "tensorflow/core/common_runtime/dma_helper.h"
#include "tensorflow/core/framework/allocation_description.pb.h"

namespace tfray {
namespace {

using ::tensorflow::AllocationDescription;
using ::tensorflow::TensorBuffer;

constexpr char kAllocatorName[] = "tfray";

// Why two buffers per tensor. Tensor::RefCountIsOne() (tensor.h) is
//   buf_->RefCountIsOne() && buf_->root_buffer()->RefCountIsOne() &&
//   buf_->OwnsMemory()
// A tensor's own buffer can say OwnsMemory() == false, but a slice of it
// (Tensor::Slice/SubSlice: b[1:], tf.split, unbatch, a strategy's
// per-replica split) is TF's SubBuffer, which says it owns its memory and
// holds a reference to the root buffer only. Once the sliced tensor is gone
// the root's count would be one, and the next elementwise op would write
// into the store. So the memory is a root (BatchMemory) on which tfray keeps
// a reference of its own, the hold, for as long as anything else refers to
// it: its count is then never one while in use, whatever shares it (slices,
// slices of slices, bitcasts, reshapes, Tensor copies, TensorReference).

// The root: every buffer TF makes over the batch's memory refers to it.
class BatchMemory : public TensorBuffer {
 public:
  BatchMemory(void* data, size_t size, std::shared_ptr<ReleaseToken> token)
      : TensorBuffer(data), size_(size), token_(std::move(token)) {}

  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(
      AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(size_));
    proto->set_allocator_name(kAllocatorName);
  }
  bool OwnsMemory() const override { return false; }

 private:
  ~BatchMemory() override = default;  // Drops the token: the batch's release.

  const size_t size_;
  const std::shared_ptr<ReleaseToken> token_;
};

// Drops tfray's hold on a BatchMemory once nothing else refers to it. A
// slice's end cannot be observed (TF's SubBuffer unrefs its root directly),
// so memory still used by slices is checked again every millisecond by one
// native thread, which sleeps while there is none.
class HoldReleaser {
 public:
  static HoldReleaser& Global() {
    // Leaked on purpose: tensors may be freed during static teardown.
    static auto* releaser = new HoldReleaser;
    return *releaser;
  }

  void Release(BatchMemory* memory) {
    // Only the hold is left: no one else can take a reference any more
    // (references are taken from existing buffers, which hold one).
    if (memory->RefCountIsOne()) {
      memory->Unref();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_.push_back(memory);
      if (!started_) {
        started_ = true;
        std::thread([this] { Run(); }).detach();
      }
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return !held_.empty(); });
      std::vector<BatchMemory*> unused;
      std::vector<BatchMemory*> still;
      for (BatchMemory* memory : held_) {
        (memory->RefCountIsOne() ? unused : still).push_back(memory);
      }
      held_.swap(still);
      lock.unlock();
      for (BatchMemory* memory : unused) memory->Unref();
      lock.lock();
      if (!held_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(1));
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<BatchMemory*> held_;  // Guarded by mu_; each with its hold.
  bool started_ = false;            // Guarded by mu_.
};

// A tensor's own buffer. Tensors copied from the one GetNext made share it;
// when the last goes, its hold on the memory goes to the HoldReleaser.
class BatchView : public TensorBuffer {
 public:
  // Takes over the hold: `memory` comes with the reference it was made with.
  explicit BatchView(BatchMemory* memory)
      : TensorBuffer(memory->data()), memory_(memory) {}

  size_t size() const override { return memory_->size(); }
  TensorBuffer* root_buffer() override { return memory_; }
  void FillAllocationDescription(
      AllocationDescription* proto) const override {
    memory_->FillAllocationDescription(proto);
  }
  bool OwnsMemory() const override { return false; }

 private:
  ~BatchView() override { HoldReleaser::Global().Release(memory_); }

  BatchMemory* const memory_;
};

}  // namespace

tensorflow::core::RefCountPtr<TensorBuffer> MakeBatchBuffer(
    void* data, size_t size, std::shared_ptr<ReleaseToken> token) {
  return tensorflow::core::RefCountPtr<TensorBuffer>(
      new BatchView(new BatchMemory(data, size, std::move(token))));
}

bool IsBatchMemory(const tensorflow::Tensor& tensor) {
  const TensorBuffer* buffer = tensorflow::DMAHelper::buffer(&tensor);
  if (buffer == nullptr) return false;
  AllocationDescription description;
  const_cast<TensorBuffer*>(buffer)->root_buffer()->FillAllocationDescription(
      &description);
  return description.allocator_name() == kAllocatorName;
}

}  // namespace tfray
