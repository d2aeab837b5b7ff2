// POSIX shared-memory segments with clean-up on exit and on fatal signals.
//
// hp_kernels unlinks a segment's name as soon as every rank has mapped it, so a rank killed
// later (even by SIGKILL) leaves nothing in /dev/shm: the memory lives while a mapping does.
// Names still pending (created, not yet unlinked) are unlinked at exit and on SIGTERM, SIGHUP,
// SIGABRT, SIGSEGV, SIGBUS, SIGQUIT before the previous handler runs.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "common.h"

namespace hpk {
namespace {

constexpr int kMaxNames = 256;
constexpr int kNameLen = 248;
// A fixed table readable from a signal handler (no allocation there).
char g_names[kMaxNames][kNameLen];
std::atomic<bool> g_used[kMaxNames];
std::mutex g_mu;

int remember(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kMaxNames; ++i) {
    if (!g_used[i].load()) {
      std::strncpy(g_names[i], name.c_str(), kNameLen - 1);
      g_names[i][kNameLen - 1] = '\0';
      g_used[i].store(true);
      return i;
    }
  }
  return -1;  // table full: the name is still unlinked by its owner after the rendezvous
}

void forget(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kMaxNames; ++i) {
    if (g_used[i].load() && name == g_names[i]) g_used[i].store(false);
  }
}

void unlink_all() {
  for (int i = 0; i < kMaxNames; ++i) {
    if (g_used[i].exchange(false)) ::shm_unlink(g_names[i]);
  }
}

const int kSignals[] = {SIGTERM, SIGHUP, SIGABRT, SIGSEGV, SIGBUS, SIGQUIT};
struct sigaction g_previous[sizeof(kSignals) / sizeof(kSignals[0])];
std::atomic<bool> g_installed{false};

void on_signal(int sig, siginfo_t* info, void* ctx) {
  unlink_all();
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    if (kSignals[i] != sig) continue;
    const struct sigaction& prev = g_previous[i];
    if (prev.sa_flags & SA_SIGINFO) {
      if (prev.sa_sigaction) prev.sa_sigaction(sig, info, ctx);
      return;
    }
    if (prev.sa_handler == SIG_IGN) return;
    if (prev.sa_handler != SIG_DFL && prev.sa_handler != nullptr) {
      prev.sa_handler(sig);
      return;
    }
    // Default action: restore it and deliver the signal again.
    ::sigaction(sig, &prev, nullptr);
    ::raise(sig);
    return;
  }
}

}  // namespace

void install_cleanup_handlers() {
  if (g_installed.exchange(true)) return;
  std::atexit(unlink_all);
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    struct sigaction prev;
    ::sigaction(kSignals[i], nullptr, &prev);
    g_previous[i] = prev;
    if (!(prev.sa_flags & SA_SIGINFO) && prev.sa_handler == SIG_IGN) continue;  // left ignored
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | (prev.sa_flags & SA_ONSTACK);  // keep faulthandler's alt stack
    sigemptyset(&sa.sa_mask);
    ::sigaction(kSignals[i], &sa, nullptr);
  }
}

std::vector<std::string> pending_names() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::string> out;
  for (int i = 0; i < kMaxNames; ++i)
    if (g_used[i].load()) out.emplace_back(g_names[i]);
  return out;
}

static uintptr_t map_fd(int fd, size_t nbytes, const std::string& name) {
  void* p = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    throw std::runtime_error("mmap of shared memory '" + name + "' (" + std::to_string(nbytes) +
                             " bytes) failed: " + std::strerror(err));
  return reinterpret_cast<uintptr_t>(p);
}

uintptr_t shm_create(const std::string& name, size_t nbytes) {
  install_cleanup_handlers();
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    throw std::runtime_error("shm_open(create) of '" + name + "' failed: " + std::strerror(errno));
  remember(name);
  // ftruncate alone leaves a sparse file: a full /dev/shm would then surface as SIGBUS on the
  // first write. posix_fallocate reserves the pages now, so it fails here, with a message.
  int rc = ::ftruncate(fd, static_cast<off_t>(nbytes)) != 0 ? errno : 0;
  if (rc == 0) rc = ::posix_fallocate(fd, 0, static_cast<off_t>(nbytes));
  if (rc != 0) {
    int err = rc;
    ::close(fd);
    shm_unlink_name(name);
    throw std::runtime_error("could not size shared memory '" + name + "' to " +
                             std::to_string(nbytes) + " bytes: " + std::strerror(err) +
                             " (is /dev/shm large enough?)");
  }
  return map_fd(fd, nbytes, name);
}

uintptr_t shm_attach(const std::string& name, size_t nbytes) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    throw std::runtime_error("shm_open of '" + name + "' failed: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < nbytes) {
    ::close(fd);
    throw std::runtime_error("shared memory '" + name + "' is smaller than expected");
  }
  return map_fd(fd, nbytes, name);
}

bool shm_unlink_name(const std::string& name) {
  forget(name);
  return ::shm_unlink(name.c_str()) == 0;
}

void shm_unmap(uintptr_t addr, size_t nbytes) {
  if (addr) ::munmap(reinterpret_cast<void*>(addr), nbytes);
}

}  // namespace hpk
