#include "parallel/launch.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "core/error.h"

namespace tessera::parallel {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int32_t env_int(const char* name, int32_t fallback) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < 0 || x > 1 << 20)
    throw Error(std::string(name) + "=" + v + " is not a rank count or index");
  return static_cast<int32_t>(x);
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Connects to addr:port; -1 on failure.
int connect_to(const std::string& addr, int32_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  return fd;
}

// Moves all n bytes through `io` (read or write), which may move fewer at a time; false when it fails or stops.
template <class Byte, class Io>
bool all_bytes(int fd, Byte* p, size_t n, Io io) {
  while (n > 0) {
    const ssize_t done = io(fd, p, n);
    if (done <= 0) return false;
    p += done;
    n -= static_cast<size_t>(done);
  }
  return true;
}

bool write_all(int fd, const uint8_t* p, size_t n) { return all_bytes(fd, p, n, ::write); }
bool read_all(int fd, uint8_t* p, size_t n) { return all_bytes(fd, p, n, ::read); }

std::vector<uint8_t> exchange_file(const RankEnv& e, const std::vector<uint8_t>& blob, double timeout_s) {
  namespace fs = std::filesystem;
  const fs::path path = e.rendezvous_file;
  if (e.rank == 0) {
    const fs::path tmp = path.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(reinterpret_cast<const char*>(blob.data()), static_cast<std::streamsize>(blob.size()));
      check(static_cast<bool>(f), "rank 0: cannot write the rendezvous file " + tmp.string());
    }
    fs::rename(tmp, path);
    return blob;
  }
  const auto t0 = Clock::now();
  while (!fs::exists(path)) {
    if (seconds_since(t0) > timeout_s)
      throw Error("rank " + std::to_string(e.rank) + ": no rendezvous file " + path.string() +
                  " from rank 0 within " + std::to_string(static_cast<int>(timeout_s)) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return out;
}

std::vector<uint8_t> exchange_tcp(const RankEnv& e, const std::vector<uint8_t>& blob, double timeout_s) {
  const std::string where = e.master_addr + ":" + std::to_string(e.master_port);
  if (e.rank == 0) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    check(fd >= 0, "rank 0: cannot open a socket for the rendezvous");
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(e.master_port));
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd, 64) != 0) {
      close(fd);
      throw Error("rank 0: cannot listen on port " + std::to_string(e.master_port) + " for the rendezvous (" +
                  std::strerror(errno) + "); set MASTER_PORT to a free port");
    }
    const uint32_t size = static_cast<uint32_t>(blob.size());
    for (int32_t i = 1; i < e.world; ++i) {
      const int c = accept(fd, nullptr, nullptr);
      if (c < 0) {
        close(fd);
        throw Error("rank 0: accept failed during the rendezvous");
      }
      const bool ok = write_all(c, reinterpret_cast<const uint8_t*>(&size), sizeof size) &&
                      write_all(c, blob.data(), blob.size());
      close(c);
      if (!ok) {
        close(fd);
        throw Error("rank 0: could not send the rendezvous blob");
      }
    }
    close(fd);
    return blob;
  }
  const auto t0 = Clock::now();
  int fd = -1;
  while ((fd = connect_to(e.master_addr, e.master_port)) < 0) {
    if (seconds_since(t0) > timeout_s)
      throw Error("rank " + std::to_string(e.rank) + ": no rendezvous from rank 0 at " + where + " within " +
                  std::to_string(static_cast<int>(timeout_s)) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  uint32_t size = 0;
  std::vector<uint8_t> out;
  bool ok = read_all(fd, reinterpret_cast<uint8_t*>(&size), sizeof size) && size <= (1u << 20);
  if (ok) {
    out.resize(size);
    ok = read_all(fd, out.data(), size);
  }
  close(fd);
  check(ok, "rank " + std::to_string(e.rank) + ": short read from rank 0 at " + where);
  return out;
}

}  // namespace

RankEnv rank_env_from_environment() {
  RankEnv e;
  const bool mpi = env("OMPI_COMM_WORLD_RANK") != nullptr;
  e.rank = env_int(mpi ? "OMPI_COMM_WORLD_RANK" : "RANK", 0);
  e.world = env_int(mpi ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE", 1);
  e.local_rank = env_int(mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "LOCAL_RANK", e.world == 1 ? 0 : e.rank);
  if (const char* a = env("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", e.master_port);
  if (const char* f = env("TESSERA_RENDEZVOUS_FILE")) e.rendezvous_file = f;
  check(e.world >= 1, "WORLD_SIZE must be at least 1");
  check(e.rank < e.world,
        "RANK=" + std::to_string(e.rank) + " is outside [0, WORLD_SIZE=" + std::to_string(e.world) + ")");
  return e;
}

std::vector<uint8_t> exchange_root_blob(const RankEnv& e, const std::vector<uint8_t>& blob,
                                        double timeout_s) {
  if (e.world == 1) return blob;
  return e.rendezvous_file.empty() ? exchange_tcp(e, blob, timeout_s) : exchange_file(e, blob, timeout_s);
}

namespace {

// SIGTERM / SIGINT sent to the launcher (`kill <pid>` of `tessera serve --gpus N`) go on to every rank, so that rank 0
// shuts down as a single-process server would and the others follow it; without this they would outlive it.
volatile sig_atomic_t g_forward_signal = 0;
extern "C" void on_launcher_signal(int sig) { g_forward_signal = sig; }

}  // namespace

int launch_local_ranks(int32_t world, const std::string& rendezvous_file,
                       const std::function<int(const RankEnv&)>& body) {
  check(world >= 1, "--gpus must be at least 1");
  std::error_code ec;
  std::filesystem::remove(rendezvous_file, ec);
  std::cout.flush();
  std::cerr.flush();
  std::vector<pid_t> pids;
  for (int32_t r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      for (pid_t p : pids) kill(p, SIGKILL);
      throw Error("cannot fork rank " + std::to_string(r));
    }
    if (pid == 0) {
      RankEnv e;
      e.rank = r;
      e.world = world;
      e.local_rank = r;
      e.rendezvous_file = rendezvous_file;
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("TESSERA_RENDEZVOUS_FILE", rendezvous_file.c_str(), 1);
      int code = 1;
      try {
        code = body(e);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "rank %d: %s\n", r, ex.what());
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  struct sigaction forward = {}, old_term = {}, old_int = {};
  forward.sa_handler = on_launcher_signal;
  sigemptyset(&forward.sa_mask);
  forward.sa_flags = 0;  // no SA_RESTART: waitpid returns EINTR, and the signal is passed on
  g_forward_signal = 0;
  sigaction(SIGTERM, &forward, &old_term);
  sigaction(SIGINT, &forward, &old_int);
  auto pass_on = [&] {
    const int sig = g_forward_signal;
    if (sig == 0) return;
    g_forward_signal = 0;
    for (pid_t p : pids)
      if (p > 0) kill(p, sig);
  };
  int result = 0;
  size_t left = pids.size();
  while (left > 0) {
    pass_on();
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    size_t r = 0;
    while (r < pids.size() && pids[r] != pid) ++r;
    if (r == pids.size()) continue;  // not one of ours
    pids[r] = -1;
    --left;
    const int code =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (code != 0 && result == 0) {
      result = code;
      std::fprintf(stderr, "rank %zu failed (status %d); stopping the other ranks\n", r, code);
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
    }
  }
  sigaction(SIGTERM, &old_term, nullptr);
  sigaction(SIGINT, &old_int, nullptr);
  std::filesystem::remove(rendezvous_file, ec);
  return result;
}

}  // namespace tessera::parallel

namespace tessera::parallel {

bool launched_externally() {
  return std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
}

int32_t world_for_gpus(int32_t gpus) {
  if (!launched_externally()) return gpus;
  const int32_t world = rank_env_from_environment().world;
  check(world == gpus, "--gpus " + std::to_string(gpus) + " but the environment says WORLD_SIZE=" +
                           std::to_string(world));
  return world;
}

int run_ranks(int32_t gpus, const std::function<int(const RankEnv&)>& body) {
  const int32_t world = world_for_gpus(gpus);
  std::fflush(stdout);
  if (launched_externally()) return body(rank_env_from_environment());
  const std::string rv =
      (std::filesystem::temp_directory_path() / ("tessera-rendezvous-" + std::to_string(::getpid()))).string();
  return launch_local_ranks(world, rv, body);
}

}  // namespace tessera::parallel
