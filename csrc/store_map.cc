#include "store_map.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

namespace tfray {
namespace {

// The kernel's PROCMAP_QUERY (include/uapi/linux/fs.h, Linux 6.11), spelled
// out here: the build machine's headers may predate it, and the ioctl's
// layout is a stable ABI (the kernel reads `size` to know which it got).
struct ProcmapQuery {
  uint64_t size;
  uint64_t query_flags;
  uint64_t query_addr;
  uint64_t vma_start;
  uint64_t vma_end;
  uint64_t vma_flags;
  uint64_t vma_page_size;
  uint64_t vma_offset;
  uint64_t inode;
  uint32_t dev_major;
  uint32_t dev_minor;
  uint32_t vma_name_size;
  uint32_t build_id_size;
  uint64_t vma_name_addr;
  uint64_t build_id_addr;
};
constexpr unsigned long kProcmapQuery = _IOWR('f', 17, ProcmapQuery);
constexpr uint64_t kVmaShared = 0x08;

// A store segment's file name: `plasmaXXXXXX` (see the header).
bool IsStoreFile(const char* path) {
  const char* slash = std::strrchr(path, '/');
  const char* base = slash == nullptr ? path : slash + 1;
  return std::strncmp(base, "plasma", 6) == 0;
}

// /proc/self/maps, open for queries. A descriptor names the process that
// opened it, so a forked child opens its own.
class MapsFile {
 public:
  // The descriptor for this process, or -1.
  int fd() {
    std::lock_guard<std::mutex> lock(mu_);
    if (pid_ != getpid()) {
      fd_ = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
      pid_ = getpid();
    }
    return fd_;
  }

 private:
  std::mutex mu_;
  int fd_ = -1;     // Guarded by mu_; a fork's parent's is left to it.
  pid_t pid_ = -1;  // Guarded by mu_.
};

MapsFile& Maps() {
  static auto* maps = new MapsFile;  // Leaked: used until the process exits.
  return *maps;
}

// Asks the kernel for the mapping that covers `address`: false if none does
// (or the kernel cannot say); `*low` and `*high` its bounds, `*store`
// whether it is the store's.
bool Query(uintptr_t address, uintptr_t* low, uintptr_t* high, bool* store) {
  const int fd = Maps().fd();
  if (fd < 0) return false;
  char name[4096];
  ProcmapQuery q;
  std::memset(&q, 0, sizeof(q));
  q.size = sizeof(q);
  q.query_addr = address;
  q.vma_name_addr = reinterpret_cast<uint64_t>(name);
  q.vma_name_size = sizeof(name);
  if (ioctl(fd, kProcmapQuery, &q) != 0) return false;
  *low = static_cast<uintptr_t>(q.vma_start);
  *high = static_cast<uintptr_t>(q.vma_end);
  *store = (q.vma_flags & kVmaShared) && q.vma_name_size > 0 &&
           IsStoreFile(name);
  return true;
}

// /proc/self/maps costs milliseconds to read in a TensorFlow process (the
// kernel prints a line for each of its thousand-odd mappings), too much for
// every push, so kernels without PROCMAP_QUERY answer from a process-wide
// copy. It may be stale only in ways that make a zero-copy byte look copied,
// never the reverse: an address in no mapping it knows (a new store file)
// reads the file again; a store mapping it knows is confirmed to be mapped
// still, by that exact range's /proc/self/map_files link, before it answers
// yes; and it is read again once it is a second old.
class Mappings {
 public:
  // `*refreshed`: whether this lookup has read the file already.
  bool Contains(uintptr_t begin, uintptr_t end, bool* refreshed) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (!*refreshed && (pid_ != getpid() || now - read_at_ > kMaxAge)) {
      ReadLocked();
      *refreshed = true;
    }
    for (;;) {
      const Mapping* m = FindLocked(begin);
      if (m != nullptr && end <= m->high) {
        if (!m->store) return false;
        if (StillStore(*m)) return true;
      }
      if (*refreshed) return false;
      ReadLocked();  // A mapping made or gone since the last read.
      *refreshed = true;
    }
  }

 private:
  static constexpr std::chrono::seconds kMaxAge{1};
  struct Mapping {
    uintptr_t low, high;
    bool store;
  };

  void ReadLocked() {
    mappings_.clear();
    // Lines read "low-high perms offset dev inode path".
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
      unsigned long low, high;
      char perms[8] = {};
      int path_at = -1;
      if (std::sscanf(line.c_str(), "%lx-%lx %7s %*s %*s %*s %n", &low, &high,
                      perms, &path_at) < 3) {
        continue;
      }
      const bool store = path_at >= 0 && perms[3] == 's' &&
                         IsStoreFile(line.c_str() + path_at);
      mappings_.push_back({low, high, store});
    }
    pid_ = getpid();
    read_at_ = std::chrono::steady_clock::now();
  }

  const Mapping* FindLocked(uintptr_t address) const {
    auto it = std::upper_bound(
        mappings_.begin(), mappings_.end(), address,
        [](uintptr_t a, const Mapping& m) { return a < m.low; });
    if (it == mappings_.begin()) return nullptr;
    --it;
    return address < it->high ? &*it : nullptr;
  }

  // Whether exactly this range is still mapped from a store file.
  static bool StillStore(const Mapping& m) {
    char link[64];
    std::snprintf(link, sizeof(link), "/proc/self/map_files/%lx-%lx",
                  static_cast<unsigned long>(m.low),
                  static_cast<unsigned long>(m.high));
    char path[4096];
    const ssize_t n = readlink(link, path, sizeof(path) - 1);
    if (n <= 0) return false;
    path[n] = '\0';
    return IsStoreFile(path);
  }

  std::mutex mu_;
  std::vector<Mapping> mappings_;  // Guarded by mu_; sorted by low.
  pid_t pid_ = -1;                 // Guarded by mu_.
  std::chrono::steady_clock::time_point read_at_;  // Guarded by mu_.
};

Mappings& MappingsCache() {
  static auto* mappings = new Mappings;  // Leaked: used until exit.
  return *mappings;
}

}  // namespace

bool StoreLookup::KernelQueryAvailable() {
  static const bool available = [] {
    static const int probe = 0;
    uintptr_t low, high;
    bool store;
    return Query(reinterpret_cast<uintptr_t>(&probe), &low, &high, &store);
  }();
  return available;
}

StoreLookup::StoreLookup(Method method)
    : method_(method == Method::kAuto && !KernelQueryAvailable()
                  ? Method::kMapsFile
                  : method) {}

bool StoreLookup::Contains(const void* data, size_t nbytes) {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + std::max<size_t>(nbytes, 1);
  return method_ == Method::kMapsFile ? ContainsByMaps(begin, end)
                                      : ContainsByQuery(begin, end);
}

bool StoreLookup::ContainsByQuery(uintptr_t begin, uintptr_t end) {
  // Usually one mapping holds it all; walk on in case it spans neighbours.
  for (uintptr_t at = begin; at < end;) {
    const Mapping* known = nullptr;
    for (const Mapping& m : known_) {
      if (m.low <= at && at < m.high) known = &m;
    }
    if (known == nullptr) {
      Mapping m;
      if (!Query(at, &m.low, &m.high, &m.store)) return false;
      known_.push_back(m);
      known = &known_.back();
    }
    if (!known->store) return false;
    at = known->high;
  }
  return true;
}

bool StoreLookup::ContainsByMaps(uintptr_t begin, uintptr_t end) {
  return MappingsCache().Contains(begin, end, &refreshed_);
}

}  // namespace tfray
