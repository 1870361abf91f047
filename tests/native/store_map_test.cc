// Unit test for csrc/store_map.h: store files are told from everything else
// by address, with the kernel's query and with the maps file, and neither
// answers from a mapping that is gone. Plain C++17, like channel_test.cc.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "store_map.h"

namespace tfray {
namespace {

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                 \
      std::_Exit(1);                                                       \
    }                                                                      \
  } while (0)

constexpr size_t kSize = 1 << 20;

// A shared mapping of a new, unlinked file named `prefix`XXXXXX, as Ray's
// store makes its segments; `shared` false: a private one.
char* MapFile(const char* prefix, bool shared, void* at = nullptr) {
  std::string path = std::string("/tmp/") + prefix + "XXXXXX";
  int fd = mkstemp(&path[0]);
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, kSize) == 0);
  unlink(path.c_str());
  void* p = mmap(at, kSize, PROT_READ | PROT_WRITE,
                 (shared ? MAP_SHARED : MAP_PRIVATE) | (at ? MAP_FIXED : 0), fd,
                 0);
  close(fd);
  CHECK(p != MAP_FAILED);
  return static_cast<char*>(p);
}

bool InStore(StoreLookup::Method method, const void* p, size_t n) {
  StoreLookup lookup(method);  // A new one per question, as per push.
  return lookup.Contains(p, n);
}

int Run(StoreLookup::Method method) {
  char* store = MapFile("plasma", true);
  CHECK(InStore(method, store, kSize));
  CHECK(InStore(method, store + 4096, 100));
  CHECK(!InStore(method, store + kSize - 10, 20));  // Runs past its end.

  std::vector<char> heap(kSize);
  CHECK(!InStore(method, heap.data(), heap.size()));
  char* other = MapFile("other", true);
  CHECK(!InStore(method, other, 64));
  char* private_copy = MapFile("plasma", false);
  CHECK(!InStore(method, private_copy, 64));

  // Gone, and private memory where it was: not the store any more.
  CHECK(munmap(store, kSize) == 0);
  void* anon = mmap(store, kSize, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  CHECK(anon == store);
  CHECK(!InStore(method, store, 64));
  // A store file mapped where anonymous memory just was: the store, at
  // once for the kernel; the maps file may take up to its second to see it
  // (it errs towards "copied", never the other way).
  CHECK(MapFile("plasma", true, anon) == store);
  if (method == StoreLookup::Method::kMapsFile) sleep(2);
  CHECK(InStore(method, store, kSize));
  // A new store file where nothing was mapped: seen at once by both.
  char* fresh = MapFile("plasma", true);
  CHECK(InStore(method, fresh + 64, 64));
  munmap(fresh, kSize);

  munmap(store, kSize);
  munmap(other, kSize);
  munmap(private_copy, kSize);
  return 0;
}

}  // namespace
}  // namespace tfray

int main() {
  using tfray::StoreLookup;
  tfray::Run(StoreLookup::Method::kMapsFile);
  if (StoreLookup::KernelQueryAvailable()) {
    tfray::Run(StoreLookup::Method::kAuto);
    std::printf("kernel query and maps file: passed\n");
  } else {
    std::printf("maps file (no kernel query here): passed\n");
  }
  return 0;
}
