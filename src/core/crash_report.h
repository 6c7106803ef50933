// tessera/core/crash_report.h — what a crash leaves behind: on SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT the
// process writes "tessera: fatal signal N (NAME)" and the call stack (glibc's backtrace: "binary(symbol+0xoffset)
// [address]", addr2line -f -C -e <binary> <offset> names the function of an unstripped binary) to standard error,
// then dies of the same signal (the exit status and a core dump are the signal's, as without the handler).
// The handler uses only async-signal-safe calls (write, backtrace_symbols_fd; backtrace is loaded before, at install).
#pragma once

namespace tessera {

// Installs the handler (once; later calls do nothing). The CLI installs it at start.
void install_crash_report();
// False in sanitizer builds, where install_crash_report leaves the signals to the sanitizer's own report.
bool crash_report_available();

}  // namespace tessera
