// Keeps the prebuilt fuzzers runnable on older glibc (2.34, e.g. Ubuntu 22.04) than the Debian 12 machine that
// builds them (2.36).
//
// The fuzzers link libstdc++ statically so that the machine that runs them needs no clang or GCC 12 runtime.
// GCC 12's static std::random_device (which libFuzzer uses for its seed) calls arc4random, new in glibc 2.36:
// defining it here binds that call to this definition instead of the versioned libc symbol. getrandom(2) is what
// glibc's own arc4random reads from.
#include <sys/random.h>

#include <cstddef>
#include <cstdint>

extern "C" uint32_t arc4random(void) {
  uint32_t v = 0;
  size_t got = 0;
  while (got < sizeof(v)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(&v) + got, sizeof(v) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return v;
}
