// Throwing syscall failures into JavaScript as errors that carry the errno
// name (e.g. "ENOENT") in `code`, the number in `errno` and the call in `syscall`.
#pragma once
#include <napi.h>
#include <cerrno>
#include <cstring>
#include <string>

namespace forkling {

inline const char* ErrnoName(int e) {
  switch (e) {
#define X(n) case n: return #n;
    X(EPERM) X(ENOENT) X(ESRCH) X(EINTR) X(EIO) X(ENXIO) X(E2BIG) X(ENOEXEC) X(EBADF) X(ECHILD)
    X(EAGAIN) X(ENOMEM) X(EACCES) X(EFAULT) X(EBUSY) X(EEXIST) X(EXDEV) X(ENODEV) X(ENOTDIR)
    X(EISDIR) X(EINVAL) X(ENFILE) X(EMFILE) X(ENOTTY) X(EFBIG) X(ENOSPC) X(ESPIPE) X(EROFS)
    X(EMLINK) X(EPIPE) X(ERANGE) X(ENOSYS) X(EOPNOTSUPP) X(ETIMEDOUT) X(ECONNREFUSED)
    X(ECONNRESET) X(EADDRINUSE) X(ENOTCONN) X(EOVERFLOW) X(ELOOP) X(ENOTSOCK)
#undef X
    default: return "EUNKNOWN";
  }
}

inline Napi::Error ErrnoError(Napi::Env env, const std::string& call, int err) {
  std::string msg = call + " failed: " + ErrnoName(err) + " (" + std::strerror(err) + ")";
  Napi::Error e = Napi::Error::New(env, msg);
  e.Set("code", Napi::String::New(env, ErrnoName(err)));
  e.Set("errno", Napi::Number::New(env, err));
  e.Set("syscall", Napi::String::New(env, call));
  return e;
}

}  // namespace forkling
