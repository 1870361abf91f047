// Tensor buffers over batch memory tfray does not own: Ray's shared object
// store, or a numpy array the feeder keeps alive. TensorFlow must never
// write there, yet its kernels forward an input's buffer to their output
// (and write in place) whenever Tensor::RefCountIsOne() says the input is
// the buffer's only user. See MakeBatchBuffer for how that is kept false.
#ifndef TFRAY_CSRC_BATCH_BUFFER_H_
#define TFRAY_CSRC_BATCH_BUFFER_H_

#include <cstddef>
#include <memory>

#include "channel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfray {

// A buffer for one tensor over `size` bytes at `data`, which `token` keeps
// valid. When the last tensor, slice or reference over it is gone, the token
// is dropped (natively, on whichever thread notices; never the GIL).
tensorflow::core::RefCountPtr<tensorflow::TensorBuffer> MakeBatchBuffer(
    void* data, size_t size, std::shared_ptr<ReleaseToken> token);

// True if `tensor`'s memory is a tfray batch's (it, or a slice of it).
bool IsBatchMemory(const tensorflow::Tensor& tensor);

}  // namespace tfray

#endif  // TFRAY_CSRC_BATCH_BUFFER_H_
