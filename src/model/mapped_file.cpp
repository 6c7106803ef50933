#include "model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace tessera::model {

namespace {

[[noreturn]] void fail(const std::string& path, const char* what, int err) {
  throw Error(path + ": " + what + ": " + std::strerror(err));
}

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path) {
  const int fd =
      ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // NONBLOCK: a FIFO must not hang us
  if (fd < 0) fail(path, "cannot open", errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, "cannot stat", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      fail(path, "cannot map", err);
    }
    file->data_ = static_cast<const uint8_t*>(p);
    file->mapped_ = true;
  }
  ::close(fd);  // the mapping keeps the file alive
  return file;
}

std::shared_ptr<const MappedFile> MappedFile::from_bytes(std::string path, const void* bytes, size_t size) {
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = std::move(path);
  file->copy_ = Buffer(size);
  if (size > 0) std::memcpy(file->copy_.data(), bytes, size);
  file->data_ = static_cast<const uint8_t*>(file->copy_.data());
  file->size_ = size;
  return file;
}

MappedFile::~MappedFile() {
  if (mapped_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace tessera::model
