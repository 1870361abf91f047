#include "window.h"

#include <algorithm>
#include <memory>
#include <utility>

namespace py = pybind11;

namespace tfray {

NativePins& NativePins::Global() {
  // Leaked on purpose, like the release queue: batches may be released
  // during interpreter and static teardown.
  static auto* pins = new NativePins;
  return *pins;
}

uint64_t NativePins::Pin(py::handle obj) {
  obj.inc_ref();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = kNativeBit | next_++;
  pinned_.emplace(id, obj.ptr());
  return id;
}

std::vector<uint64_t> NativePins::Unpin(const std::vector<uint64_t>& ids) {
  std::vector<uint64_t> others;
  std::vector<PyObject*> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t id : ids) {
      if (!(id & kNativeBit)) {
        others.push_back(id);
        continue;
      }
      auto it = pinned_.find(id);
      if (it != pinned_.end()) {
        dropped.push_back(it->second);
        pinned_.erase(it);
      }
    }
  }
  // Outside the lock: freeing a batch may run arbitrary Python (Ray's
  // release of its object), which may pin or unpin too.
  for (PyObject* obj : dropped) Py_DECREF(obj);
  return others;
}

size_t NativePins::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_.size();
}

SpecTemplate::SpecTemplate(py::handle structure, const py::list& leaves,
                           size_t alignment)
    : root_(Parse(structure)), alignment_(alignment) {
  for (const auto& item : leaves) {
    auto t = py::reinterpret_borrow<py::tuple>(item);
    Leaf leaf;
    leaf.dtype = py::dtype::from_args(t[0]);
    if (!t[1].is_none()) {
      auto dims = t[1].cast<py::tuple>();
      leaf.rank = static_cast<int>(dims.size());
      for (const auto& d : dims) {
        leaf.shape.push_back(d.is_none() ? -1 : d.cast<int64_t>());
      }
    }
    tf_dtypes_.push_back(t[2].cast<int>());
    leaves_.push_back(std::move(leaf));
  }
}

SpecTemplate::Node SpecTemplate::Parse(py::handle structure) {
  Node node;
  if (py::isinstance<py::int_>(structure)) {
    node.leaf = structure.cast<int>();
  } else if (py::isinstance<py::dict>(structure)) {
    node.is_dict = true;
    for (const auto& item : py::reinterpret_borrow<py::dict>(structure)) {
      node.keys.push_back(py::reinterpret_borrow<py::object>(item.first));
      node.children.push_back(Parse(item.second));
    }
  } else {
    for (const auto& child : py::reinterpret_borrow<py::tuple>(structure)) {
      node.children.push_back(Parse(child));
    }
  }
  return node;
}

bool SpecTemplate::Match(py::handle value,
                         std::vector<py::array>* arrays) const {
  arrays->assign(leaves_.size(), py::array());
  return Walk(value, root_, arrays);
}

bool SpecTemplate::Walk(py::handle value, const Node& node,
                        std::vector<py::array>* arrays) const {
  PyObject* v = value.ptr();
  if (node.leaf >= 0) {
    const auto& api = py::detail::npy_api::get();
    if (!api.PyArray_Check_(v)) return false;
    auto array = py::reinterpret_borrow<py::array>(value);
    const Leaf& leaf = leaves_[node.leaf];
    if (!api.PyArray_EquivTypes_(py::detail::array_proxy(v)->descr,
                                 leaf.dtype.ptr())) {
      return false;
    }
    if (leaf.rank >= 0) {
      if (array.ndim() != leaf.rank) return false;
      for (int d = 0; d < leaf.rank; ++d) {
        if (leaf.shape[d] >= 0 && leaf.shape[d] != array.shape(d)) {
          return false;
        }
      }
    }
    if (!(array.flags() & py::array::c_style)) return false;
    if (!IsAligned(array.data(), alignment_)) return false;
    (*arrays)[node.leaf] = std::move(array);
    return true;
  }
  if (node.is_dict) {
    if (!PyDict_Check(v) ||
        static_cast<size_t>(PyDict_Size(v)) != node.keys.size()) {
      return false;
    }
    for (size_t i = 0; i < node.keys.size(); ++i) {
      PyObject* child = PyDict_GetItemWithError(v, node.keys[i].ptr());
      if (child == nullptr) {
        PyErr_Clear();  // A missing or unhashable key: not this spec.
        return false;
      }
      if (!Walk(child, node.children[i], arrays)) return false;
    }
    return true;
  }
  if (!PyTuple_Check(v) && !PyList_Check(v)) return false;
  if (static_cast<size_t>(PySequence_Fast_GET_SIZE(v)) !=
      node.children.size()) {
    return false;
  }
  for (size_t i = 0; i < node.children.size(); ++i) {
    if (!Walk(PySequence_Fast_GET_ITEM(v, i), node.children[i], arrays)) {
      return false;
    }
  }
  return true;
}

Batch MakeBatch(const std::vector<py::array>& arrays,
                const std::vector<int>& tf_dtypes, uint64_t id,
                StoreLookup* store) {
  if (arrays.size() != tf_dtypes.size()) {
    throw py::value_error("arrays and dtypes differ in length");
  }
  Batch batch;
  batch.token = std::make_shared<ReleaseToken>(ReleaseQueue::Global(), id);
  batch.arrays.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    const py::array& a = arrays[i];
    ArrayRef ref;
    ref.data = a.data();
    ref.nbytes = static_cast<size_t>(a.nbytes());
    ref.dtype = tf_dtypes[i];
    ref.shape.assign(a.shape(), a.shape() + a.ndim());
    ref.in_store = store->Contains(ref.data, ref.nbytes);
    batch.arrays.push_back(std::move(ref));
  }
  return batch;
}

Origin ToOrigin(py::handle origin) {
  Origin out;
  if (origin.is_none()) return out;
  auto t = py::reinterpret_borrow<py::tuple>(origin);
  out.unit = t[0].cast<int64_t>();
  out.index = t[1].cast<int64_t>();
  out.size = t[2].cast<int64_t>();
  return out;
}

WindowResult PushWindow(Channel& channel, const py::list& values,
                        const SpecTemplate& spec, Recording* recording,
                        py::handle origins) {
  const bool has_origins = !origins.is_none();
  if (has_origins && py::len(origins) != values.size()) {
    throw py::value_error("origins and values differ in length");
  }
  WindowResult result;
  std::vector<Batch> batches;
  std::vector<py::array> arrays;
  StoreLookup store;
  for (size_t i = 0; i < values.size(); ++i) {
    py::handle value = PyList_GET_ITEM(values.ptr(), i);
    if (!spec.Match(value, &arrays)) break;
    batches.push_back(MakeBatch(arrays, spec.tf_dtypes(),
                                NativePins::Global().Pin(value), &store));
    if (has_origins) {
      batches.back().origin = ToOrigin(PyList_GET_ITEM(origins.ptr(), i));
    }
    for (const ArrayRef& a : batches.back().arrays) result.bytes += a.nbytes;
    if (recording != nullptr) recording->Add(batches.back());
  }
  arrays.clear();  // Its references are dropped here, under the GIL.
  result.taken = batches.size();
  // What the channel has room for goes in with the GIL held: once given up,
  // the GIL takes up to a switch interval (5 ms) to get back while another
  // Python thread is busy, so it is given up only to wait for room.
  const size_t room = channel.room();
  auto push = [&](size_t end) {
    for (; result.pushed < end; ++result.pushed) {
      if (channel.Push(std::move(batches[result.pushed]), /*timeout_s=*/-1) !=
          Channel::PushResult::kOk) {
        return false;
      }
    }
    return true;
  };
  if (push(std::min(room, batches.size())) &&
      result.pushed < batches.size()) {
    py::gil_scoped_release release;
    push(batches.size());
  }
  // Batches not pushed (the consumer cancelled) post their tokens as they
  // are dropped, GIL-free; the release thread unpins them.
  return result;
}

}  // namespace tfray
