// Opening a file to append to, refusing one another user planted (owned_file.h).
#include "base/owned_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

namespace safepoint::internal {

namespace {
std::string Octal(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}
}  // namespace

Result<UniqueFd> OpenOwnedForAppend(const std::string& path, mode_t create_mode,
                                    std::string_view what) {
  const std::string w(what);
  UniqueFd fd(::open(path.c_str(),
                     O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY,
                     create_mode));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP) {
      return InvalidArgument(w + " " + path +
                             ": is a symlink; refusing to write through it (remove it, or "
                             "name the file itself)");
    }
    if (err == ENXIO) {  // a FIFO without a reader (O_NONBLOCK)
      return InvalidArgument(w + " " + path + ": not a regular file; refusing to write to it");
    }
    return ErrnoStatus("open " + w, path, err);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat " + w, path, errno);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument(w + " " + path + ": not a regular file; refusing to write to it");
  }
  if (st.st_uid != ::geteuid()) {
    return InvalidArgument(w + " " + path + ": owned by uid " + std::to_string(st.st_uid) +
                           ", not by this process's uid " + std::to_string(::geteuid()) +
                           "; refusing to write to it (another user may have planted it: "
                           "remove it, or name a file in a directory only you can write)");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return InvalidArgument(w + " " + path + ": writable by group or others (mode " +
                           Octal(st.st_mode) + "); refusing to write to it (chmod go-w " + path +
                           ", or remove it)");
  }
  if (st.st_nlink != 1) {
    return InvalidArgument(w + " " + path + ": has " + std::to_string(st.st_nlink) +
                           " hard links; refusing to write to it (remove it)");
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoStatus("fcntl " + w, path, errno);
  }
  return fd;
}

}  // namespace safepoint::internal
