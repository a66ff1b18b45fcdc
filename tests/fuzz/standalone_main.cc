// Fallback fuzz driver for machines where clang cannot link libFuzzer (scripts/fuzz.sh picks it): runs
// LLVMFuzzerTestOneInput on randomly mutated seed files under ASan/UBSan for a bounded time. No coverage
// feedback, so it is much weaker than libFuzzer; it still catches shallow out-of-bounds reads.
// Usage: <target> [-max_total_time=S] [-artifact_prefix=P] [-seed=N] seed_dir_or_file...
#include <fcntl.h>
#include <sanitizer/common_interface_defs.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// The input being run, written out if the process dies (sanitizer report or abort).
std::vector<uint8_t> g_current;
std::string g_crash_path;

void dump_current() {
  int fd = ::open(g_crash_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  ssize_t ignored = ::write(fd, g_current.data(), g_current.size());
  (void)ignored;
  ::close(fd);
  static const char kMsg[] = "standalone fuzz driver: crashing input written\n";
  ignored = ::write(2, kMsg, sizeof(kMsg) - 1);
}

void on_signal(int sig) {
  dump_current();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

std::vector<uint8_t> read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void mutate(std::vector<uint8_t>& b, const std::vector<std::vector<uint8_t>>& seeds, std::mt19937_64& rng) {
  static const char kTokens[] = "{}[]\",:0123456789-.e ";
  const int edits = 1 + static_cast<int>(rng() % 8);
  for (int e = 0; e < edits; ++e) {
    const size_t n = b.size();
    switch (rng() % 8) {
      case 0:
        if (n) b[rng() % n] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        if (n) b[rng() % n] = static_cast<uint8_t>(rng());
        break;
      case 2:
        b.insert(b.begin() + static_cast<long>(rng() % (n + 1)), kTokens[rng() % (sizeof(kTokens) - 1)]);
        break;
      case 3:
        if (n) b.erase(b.begin() + static_cast<long>(rng() % n));
        break;
      case 4:
        b.resize(rng() % (n + 1));
        break;
      case 5:
        if (n >= 8) b[rng() % 8] = static_cast<uint8_t>(rng());
        break;   // the header length
      case 6: {  // splice a piece of another seed
        const auto& o = seeds[rng() % seeds.size()];
        if (o.empty()) break;
        size_t from = rng() % o.size(), len = 1 + rng() % std::min<size_t>(o.size() - from, 64);
        b.insert(b.begin() + static_cast<long>(rng() % (n + 1)), o.begin() + static_cast<long>(from),
                 o.begin() + static_cast<long>(from + len));
        break;
      }
      case 7:
        if (n) {  // replace a digit run's digit with a big one
          size_t i = rng() % n;
          if (b[i] >= '0' && b[i] <= '9') b[i] = '9';
        }
        break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  double max_seconds = 60;
  std::string prefix = "./";
  uint64_t seed = std::random_device{}();
  std::vector<std::vector<uint8_t>> seeds;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("-max_total_time=", 0) == 0) {
      max_seconds = std::stod(a.substr(16));
    } else if (a.rfind("-artifact_prefix=", 0) == 0) {
      prefix = a.substr(17);
    } else if (a.rfind("-seed=", 0) == 0) {
      seed = std::stoull(a.substr(6));
    } else if (std::filesystem::is_directory(a)) {
      for (const auto& de : std::filesystem::directory_iterator(a))
        if (de.is_regular_file()) seeds.push_back(read_file(de.path()));
    } else {
      seeds.push_back(read_file(a));
    }
  }
  if (seeds.empty()) seeds.emplace_back();
  g_crash_path = prefix + "crash-standalone";
  __sanitizer_set_death_callback(dump_current);
  std::signal(SIGABRT, on_signal);
  std::signal(SIGSEGV, on_signal);

  std::fprintf(stderr, "standalone fuzz driver: %zu seeds, %.0f s, seed %llu\n", seeds.size(), max_seconds,
               static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  uint64_t runs = 0;
  for (const auto& s : seeds) {
    g_current = s;
    LLVMFuzzerTestOneInput(g_current.data(), g_current.size());
  }
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < max_seconds) {
    for (int k = 0; k < 256; ++k, ++runs) {
      g_current = seeds[rng() % seeds.size()];
      mutate(g_current, seeds, rng);
      LLVMFuzzerTestOneInput(g_current.data(), g_current.size());
    }
  }
  std::fprintf(stderr, "standalone fuzz driver: %llu runs, no crash\n",
               static_cast<unsigned long long>(runs));
  return 0;
}
