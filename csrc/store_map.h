// Whether memory lies in Ray's object store, decided by its address.
//
// tfray's "zero-copy" means a tensor's bytes are the store's own bytes, so
// it is decided where the bytes are, not by what tfray did or did not copy:
// a copy Ray or Arrow made upstream (an inline task result, a block whose
// chunks Ray concatenated) lies in private memory and is a copy.
//
// Ray's plasma store creates every segment it allocates from (its
// shared-memory pool, and the fallback files it makes on disk when the pool
// is full) as a file named `plasmaXXXXXX`, unlinks it, and hands the file
// descriptor to each client, which maps it shared. So a store object's bytes
// lie in a shared mapping of a file whose name starts with `plasma`, in
// every process that reads it: the driver of a local Ray and of a cluster
// started with `ray start` alike (the name is the store's, whoever started
// it). Private memory (heap, anonymous mappings, a copy) never does.
//
// Plain C++17 and Linux's /proc: no TensorFlow, no Python.
#ifndef TFRAY_CSRC_STORE_MAP_H_
#define TFRAY_CSRC_STORE_MAP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tfray {

// Answers for one push (a window of batches); make a new one per push.
// Mappings come and go (Ray unmaps a fallback file once its objects are
// freed, and a heap copy may land where it was), so each answer is about
// the mappings as they are now; the batch asked about is pinned, so its own
// mapping stays.
class StoreLookup {
 public:
  enum class Method {
    kAuto,       // The kernel's PROCMAP_QUERY (Linux 6.11+), else kMapsFile.
    kMapsFile,   // A copy of /proc/self/maps (store_map.cc says when
                 // it is read again).
  };

  explicit StoreLookup(Method method = Method::kAuto);

  // Whether [data, data + nbytes) lies in shared mappings of the store.
  bool Contains(const void* data, size_t nbytes);

  // Whether kAuto queries the kernel here (else it reads the maps file).
  static bool KernelQueryAvailable();

 private:
  bool ContainsByQuery(uintptr_t begin, uintptr_t end);
  bool ContainsByMaps(uintptr_t begin, uintptr_t end);

  struct Mapping {
    uintptr_t low = 0, high = 0;
    bool store = false;
  };

  Method method_;
  // Mappings the kernel described to this lookup, so that the batches of one
  // push that lie in one mapping (the store's pool, mostly) cost one query.
  // A store mapping stays while the push runs (it holds a pinned batch of
  // it); were part of another replaced meanwhile, the answer would err
  // toward "copied", never toward "zero-copy".
  std::vector<Mapping> known_;
  bool refreshed_ = false;  // This lookup read /proc/self/maps again.
};

}  // namespace tfray

#endif  // TFRAY_CSRC_STORE_MAP_H_
