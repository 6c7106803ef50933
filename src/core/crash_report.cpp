#include "core/crash_report.h"

#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

namespace tessera {

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    default: return "?";
  }
}

void write_str(const char* s) {
  const ssize_t r = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)r;
}

// The signal number in decimal without snprintf (not async-signal-safe).
void write_int(int v) {
  char buf[16];
  int n = 0;
  do {
    buf[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0 && n < 15);
  char out[16];
  for (int i = 0; i < n; ++i) out[i] = buf[n - 1 - i];
  out[n] = '\0';
  write_str(out);
}

void on_fatal_signal(int sig) {
  static std::atomic<bool> entered{false};
  if (!entered.exchange(true)) {  // one report even when threads crash together
    write_str("tessera: fatal signal ");
    write_int(sig);
    write_str(" (");
    write_str(signal_name(sig));
    write_str("); call stack:\n");
    void* frames[64];
    const int n = ::backtrace(frames, 64);
    ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
    write_str("tessera: please report this with the command line and the stack above\n");
  }
  std::signal(sig, SIG_DFL);  // die of the same signal
  std::raise(sig);
}

}  // namespace

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TESSERA_SANITIZER_OWNS_SIGNALS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define TESSERA_SANITIZER_OWNS_SIGNALS 1
#endif
#endif

bool crash_report_available() {
#ifdef TESSERA_SANITIZER_OWNS_SIGNALS
  return false;
#else
  return true;
#endif
}

void install_crash_report() {
#ifdef TESSERA_SANITIZER_OWNS_SIGNALS
  return;  // the sanitizer's own report is better
#endif
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  // An alternate stack for this thread, so that a stack overflow is reported too.
  static char alt_stack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  sigaltstack(&ss, nullptr);
  void* warm[1];
  (void)::backtrace(warm, 1);  // loads libgcc's unwinder now: backtrace may allocate on its first call
  for (int sig : kSignals) {
    struct sigaction sa {};
    sa.sa_handler = on_fatal_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND | SA_NODEFER | SA_ONSTACK;
    sigaction(sig, &sa, nullptr);
  }
}

}  // namespace tessera
