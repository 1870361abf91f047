// Python end of the channel and registry: thin glue over channel.h. Every
// call that can wait releases the GIL first.
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "channel.h"
#include "tf_compat.h"
#include "window.h"

namespace py = pybind11;

namespace tfray {
namespace {

// One batch's arrays as MakeBatch takes them (under the GIL). The arrays
// stay alive through the Python pin that `token` names, not through this.
Batch ToBatch(const py::list& arrays, const std::vector<int>& dtypes,
              uint64_t token, StoreLookup* store) {
  std::vector<py::array> checked;
  checked.reserve(arrays.size());
  for (const auto& item : arrays) {
    auto a = py::reinterpret_borrow<py::array>(item);
    if (!(a.flags() & py::array::c_style)) {
      throw py::value_error("array is not C-contiguous");
    }
    checked.push_back(std::move(a));
  }
  return MakeBatch(checked, dtypes, token, store);
}

py::dict StatsDict(const ChannelStats& s) {
  py::dict d;
  d["batches_pushed"] = s.batches_pushed;
  d["bytes_pushed"] = s.bytes_pushed;
  d["batches_delivered"] = s.batches_delivered;
  d["bytes_delivered"] = s.bytes_delivered;
  d["arrays_delivered"] = s.arrays_delivered;
  d["bytes_in_store"] = s.bytes_in_store;
  d["arrays_in_store"] = s.arrays_in_store;
  d["bytes_copied"] = s.bytes_copied;
  d["arrays_copied"] = s.arrays_copied;
  d["get_next_calls"] = s.get_next_calls;
  d["consumer_wait_s"] = s.consumer_wait_ns * 1e-9;
  d["producer_wait_s"] = s.producer_wait_ns * 1e-9;
  d["queued"] = s.queued;
  d["bytes_held"] = s.bytes_held;
  d["active_s"] = s.active_ns * 1e-9;
  d["closed"] = s.closed;
  d["cancelled"] = s.cancelled;
  return d;
}

}  // namespace
}  // namespace tfray

PYBIND11_MODULE(_native, m) {
  using tfray::Channel;
  m.doc() = "tfray's native channel, registry and release queue.";

  // The one definition of the status codes (channel.h); Python uses this.
  py::enum_<tfray::Code>(m, "Code", py::arithmetic(),
                         "Status codes, numbered as absl::StatusCode.")
      .value("OK", tfray::Code::kOk)
      .value("CANCELLED", tfray::Code::kCancelled)
      .value("UNKNOWN", tfray::Code::kUnknown)
      .value("INVALID_ARGUMENT", tfray::Code::kInvalidArgument)
      .value("NOT_FOUND", tfray::Code::kNotFound)
      .value("FAILED_PRECONDITION", tfray::Code::kFailedPrecondition)
      .value("INTERNAL", tfray::Code::kInternal)
      .value("UNAVAILABLE", tfray::Code::kUnavailable)
      .value("DATA_LOSS", tfray::Code::kDataLoss);

  using Request = tfray::SourceRegistry::Request;
  py::class_<Request>(m, "EpochRequest",
                      "A TF iterator's request for its epoch (channel.h).")
      .def_readonly("key", &Request::key)
      .def_readonly("channel", &Request::channel)
      .def_readonly("deterministic", &Request::deterministic)
      .def_readonly("skip", &Request::skip)
      .def_readonly("progress", &Request::progress)
      .def_readonly("resume_info", &Request::resume_info)
      .def_readonly("offered", &Request::offered)
      .def_readonly("replayed", &Request::replayed)
      .def_readonly("ended", &Request::ended);

  py::class_<tfray::Recording, std::shared_ptr<tfray::Recording>>(
      m, "Recording",
      "The batches of an epoch as push_window pushed them (channel.h).")
      .def(py::init<>())
      .def_property_readonly("size", &tfray::Recording::size)
      .def_property_readonly("bytes", &tfray::Recording::bytes);

  py::class_<Channel, std::shared_ptr<Channel>>(m, "Channel")
      .def(py::init<size_t>(), py::arg("capacity"))
      .def(
          "push",
          [](Channel& self, const py::list& batches,
             const std::vector<int>& dtypes) {
            // Each entry is a feeder.Entry, a NamedTuple: (arrays, token,
            // bytes_copied, arrays_copied, origin), read by position.
            struct Pending {
              tfray::Batch batch;
              int64_t bytes_copied, arrays_copied;
            };
            std::vector<Pending> pending;
            pending.reserve(batches.size());
            tfray::StoreLookup store;
            for (const auto& entry : batches) {
              auto t = py::reinterpret_borrow<py::tuple>(entry);
              pending.push_back(
                  {tfray::ToBatch(t[0].cast<py::list>(), dtypes,
                                  t[1].cast<uint64_t>(), &store),
                   t[2].cast<int64_t>(), t[3].cast<int64_t>()});
              pending.back().batch.origin = tfray::ToOrigin(t[4]);
            }
            py::gil_scoped_release release;
            size_t pushed = 0;
            for (auto& p : pending) {
              if (self.Push(std::move(p.batch), /*timeout_s=*/-1,
                            p.bytes_copied,
                            p.arrays_copied) != Channel::PushResult::kOk) {
                break;
              }
              ++pushed;
            }
            // Only a cancel stops early; batches not pushed release their
            // tokens here, GIL-free, and are never pushed again.
            pending.clear();
            return pushed;
          },
          py::arg("batches"), py::arg("dtypes"),
          "Pushes feeder.Entry tuples (arrays, token, bytes_copied, arrays_copied, origin) in "
          "order, waiting for room; returns how many went in before the "
          "consumer cancelled.")
      .def(
          "push_error",
          [](Channel& self, int code, std::string message) {
            py::gil_scoped_release release;
            return self.PushError(static_cast<tfray::Code>(code),
                                  std::move(message),
                                  /*timeout_s=*/-1) == Channel::PushResult::kOk;
          },
          py::arg("code"), py::arg("message"),
          "Queues an error after the batches; False if the consumer is gone.")
      .def("close", &Channel::Close)
      .def("cancel", &Channel::Cancel)
      .def(
          "push_window",
          [](Channel& self, const py::list& values,
             const tfray::SpecTemplate& spec, tfray::Recording* recording,
             py::handle origins) {
            auto r = tfray::PushWindow(self, values, spec, recording, origins);
            return py::make_tuple(r.taken, r.pushed, r.bytes);
          },
          py::arg("values"), py::arg("spec"), py::arg("recording") = nullptr,
          py::arg("origins") = py::none(),
          "Pushes values[0], values[1], ... while they match `spec` as they are, in "
          "one call (window.h); returns (taken, pushed, bytes). "
          "`recording`, if given, keeps the batches taken; `origins`, if given, "
          "says each batch's (unit, index, size) in its epoch, or None.")
      .def_property_readonly("cancelled", &Channel::cancelled)
      .def_property_readonly(
          "consumer_wait_s",
          [](Channel& self) { return self.Stats().consumer_wait_ns * 1e-9; },
          "stats()['consumer_wait_s'] alone: the feeder reads it every turn.")
      .def_property_readonly(
          "bytes_held", &Channel::bytes_held,
          "stats()['bytes_held'] alone, without the channel's lock.")
      .def_property_readonly("items_taken", &Channel::items_taken,
                             "Batches and errors TF has taken, in push order.")
      .def_property("resume_info", &Channel::resume_info,
                    &Channel::SetResumeInfo,
                    "What a restore must know of how this epoch was made.")
      .def_property_readonly("claimed", &Channel::claimed,
                             "An iterator took this offered channel.")
      .def_property("capacity", &Channel::capacity, &Channel::SetCapacity)
      .def("stats", [](const Channel& self) {
        return tfray::StatsDict(self.Stats());
      });

  m.def(
      "register_source",
      [](int64_t key, int64_t cardinality, size_t capacity) {
        tfray::SourceRegistry::Global().Register(
            key, tfray::SourceRegistry::SourceInfo{cardinality, capacity});
      },
      py::arg("key"), py::arg("cardinality"), py::arg("capacity"));
  m.def("unregister_source", [](int64_t key) {
    tfray::SourceRegistry::Global().Unregister(key);
  });
  m.def(
      "wait_requests",
      [](double timeout) {
        py::gil_scoped_release release;
        return tfray::SourceRegistry::Global().WaitRequests(timeout);
      },
      py::arg("timeout"),
      "Waits for new-epoch requests from TF iterators: a list of "
      "EpochRequest; offered: the iterator took the channel offered for it "
      "(its feeder runs already); ended: a feeder's notice that its epoch "
      "ended (post_ended).");
  m.def(
      "post_ended",
      [](int64_t key, std::shared_ptr<Channel> channel) {
        tfray::SourceRegistry::Global().PostEnded(key, std::move(channel));
      },
      py::arg("key"), py::arg("channel"),
      "Tells the dispatcher that every batch of an epoch of source `key` is "
      "in `channel`.");
  m.def(
      "offer_epoch",
      [](int64_t key, std::shared_ptr<Channel> channel) {
        return tfray::SourceRegistry::Global().OfferEpoch(key,
                                                          std::move(channel));
      },
      py::arg("key"), py::arg("channel"),
      "Offers a channel a feeder fills with the next epoch of source `key` "
      "to its next iterator. False if the source is gone or has an offer.");
  m.def(
      "set_replay",
      [](int64_t key, tfray::Recording& recording) {
        return tfray::SourceRegistry::Global().SetReplay(key,
                                                         recording.Take());
      },
      py::arg("key"), py::arg("recording"),
      "Serves every later epoch of source `key` natively from `recording` "
      "(a whole epoch; emptied). False if the source is gone.");
  m.def(
      "has_replay",
      [](int64_t key) { return tfray::SourceRegistry::Global().HasReplay(key); },
      py::arg("key"));
  m.def(
      "replayed_batches",
      [] { return tfray::SourceRegistry::Global().ReplayedBatches(); },
      "The batches replays keep pinned, in all.");
  m.def(
      "watch_ray_session",
      [](const std::string& raylet_path) {
        // Ray's core worker says whether it is up: a static function its
        // extension exports, callable from any thread without the GIL.
        void* raylet = dlopen(raylet_path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
        if (raylet == nullptr) return false;
        auto alive = reinterpret_cast<bool (*)()>(
            dlsym(raylet, "_ZN3ray4core17CoreWorkerProcess13IsInitializedEv"));
        if (alive == nullptr) return false;
        tfray::SourceRegistry::Global().SetSessionProbe(alive);
        return true;
      },
      py::arg("raylet_path"),
      "Lets replays ask Ray's core worker (in the extension at raylet_path, "
      "loaded already) whether the session is up; False if it cannot be "
      "found, and then no replay serves.");
  m.def(
      "end_session", [] { tfray::SourceRegistry::Global().EndSession(); },
      "Ray shut down: drops every replay and offer.");
  py::class_<tfray::SpecTemplate>(m, "SpecTemplate",
                                  "An element spec as push_window matches it.")
      .def(py::init<py::handle, const py::list&, size_t>(),
           py::arg("structure"), py::arg("leaves"), py::arg("alignment"));

  m.def(
      "wait_released",
      [](double timeout) {
        py::gil_scoped_release release;
        auto& queue = *tfray::ReleaseQueue::Global();
        std::vector<uint64_t> ids = queue.Drain(timeout);
        if (!ids.empty()) {
          // Batches are freed one by one as TF moves on: gather a
          // millisecond's worth, so the GIL is taken per window of
          // releases rather than per batch.
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          for (uint64_t id : queue.Drain(0)) ids.push_back(id);
        }
        return ids;
      },
      py::arg("timeout"),
      "Waits (without the GIL) up to `timeout` s for released token ids.");
  m.def(
      "unpin_native",
      [](const std::vector<uint64_t>& ids) {
        return tfray::NativePins::Global().Unpin(ids);
      },
      py::arg("ids"),
      "Drops the native pins (push_window's) among `ids`; returns the others.");
  m.def(
      "native_pins", [] { return tfray::NativePins::Global().size(); },
      "How many batches push_window pinned that are not yet released.");
  m.def(
      "in_object_store",
      [](uintptr_t address, size_t nbytes, bool maps_file) {
        tfray::StoreLookup store(maps_file
                                     ? tfray::StoreLookup::Method::kMapsFile
                                     : tfray::StoreLookup::Method::kAuto);
        return store.Contains(reinterpret_cast<const void*>(address), nbytes);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("maps_file") = false,
      "Whether [address, address + nbytes) lies in Ray's object store, as "
      "the stats decide it (store_map.h); maps_file: by /proc/self/maps.");
  m.def("kernel_store_query", &tfray::StoreLookup::KernelQueryAvailable,
        "Whether the kernel answers store lookups (PROCMAP_QUERY), rather "
        "than /proc/self/maps read once per push.");
  m.def("built_tf_version", [] { return std::string(TFRAY_BUILT_TF_VERSION); });
  m.attr("TENSOR_ALIGNMENT") = TFRAY_TENSOR_ALIGNMENT;
}
