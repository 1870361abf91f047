// A window of resolved batches, checked, pinned and pushed in one call.
//
// The feeder hands a whole window of values (as Ray resolved them) to
// PushWindow, which, under the GIL once for the window, walks each value's
// nest against the element spec (SpecTemplate), checks dtype, shape,
// contiguity and alignment, pins the value (NativePins) and makes its Batch;
// then pushes them, releasing the GIL only to wait for room. A value it
// cannot take as it is (an error in its place, one that needs a copy, one
// that does not match) stops the run: the Python feeder handles that one,
// with the message that says what is wrong, and goes on with the rest. So
// tfray runs no Python per batch on the fast path; only per window.
#ifndef TFRAY_CSRC_WINDOW_H_
#define TFRAY_CSRC_WINDOW_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "channel.h"
#include "store_map.h"

namespace tfray {

// The Python objects that batches pushed by PushWindow live in, kept alive
// until TF frees the batch (its ReleaseToken posts the id). Their ids have
// the top bit set; ids of batches the Python feeder pins (pins.py) do not.
class NativePins {
 public:
  static constexpr uint64_t kNativeBit = uint64_t{1} << 63;
  static NativePins& Global();

  // Under the GIL: keeps `obj` alive; returns its token id.
  uint64_t Pin(pybind11::handle obj);
  // Under the GIL: drops the native pins among `ids`; returns the others.
  std::vector<uint64_t> Unpin(const std::vector<uint64_t>& ids);
  size_t size();

 private:
  std::mutex mu_;
  uint64_t next_ = 1;                               // Guarded by mu_.
  std::unordered_map<uint64_t, PyObject*> pinned_;  // Guarded by mu_.
};

// An element spec as a template a value's nest is matched against.
class SpecTemplate {
 public:
  // `structure`: the spec's nest with each leaf replaced by its index in
  // flat (tf.nest) order: dicts (keys in sorted order) and tuples of ints.
  // `leaves`: per index, (numpy dtype, shape tuple with None for unknown
  // dimensions or None for unknown rank, TF dtype enum).
  SpecTemplate(pybind11::handle structure, const pybind11::list& leaves,
               size_t alignment);

  // Under the GIL: the arrays of `value` in flat order, if it matches the
  // spec and no array needs a copy (C-contiguous and aligned).
  bool Match(pybind11::handle value, std::vector<pybind11::array>* arrays) const;
  // Per leaf, its TF dtype enum.
  const std::vector<int>& tf_dtypes() const { return tf_dtypes_; }

 private:
  struct Node {
    int leaf = -1;  // >= 0: a leaf, this index; else a dict or a sequence.
    bool is_dict = false;
    std::vector<pybind11::object> keys;  // A dict's, in the spec's order.
    std::vector<Node> children;
  };
  struct Leaf {
    pybind11::dtype dtype;
    int rank = -1;               // -1: any rank.
    std::vector<int64_t> shape;  // -1: any size.
  };

  static Node Parse(pybind11::handle structure);
  bool Walk(pybind11::handle value, const Node& node,
            std::vector<pybind11::array>* arrays) const;

  Node root_;
  std::vector<Leaf> leaves_;
  std::vector<int> tf_dtypes_;
  size_t alignment_;
};

// The one way a batch is made, under the GIL: over `arrays` (C-contiguous,
// in flat spec order, kept alive by the pin `id` names), typed by
// `tf_dtypes`, each array's place (in the store or not) asked of `store`.
Batch MakeBatch(const std::vector<pybind11::array>& arrays,
                const std::vector<int>& tf_dtypes, uint64_t id,
                StoreLookup* store);

// How far PushWindow got: `taken` values made into batches (from the first),
// of which `pushed` went into the channel (fewer only if it was cancelled),
// `bytes` in all.
struct WindowResult {
  size_t taken = 0;
  size_t pushed = 0;
  int64_t bytes = 0;
};

// Under the GIL (released while waiting for room): takes values[0],
// values[1], ... while they match `spec` as they are, and pushes
// them in order; `recording` (if given) keeps each batch taken.
// `origins`, None or a list as long as `values`: each batch's Origin as
// None or a (unit, index, size) tuple.
WindowResult PushWindow(Channel& channel, const pybind11::list& values,
                        const SpecTemplate& spec, Recording* recording = nullptr,
                        pybind11::handle origins = pybind11::none());

// Under the GIL: `origin`, None or a (unit, index, size) tuple, as an Origin.
Origin ToOrigin(pybind11::handle origin);

}  // namespace tfray

#endif  // TFRAY_CSRC_WINDOW_H_
