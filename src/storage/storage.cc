// Object-name validation and the storage URI registry.
//
// ValidateObjectName() is the single check that keeps object names inside a storage root; every
// backend calls it before touching a name. The registry maps URI schemes to factories: "file"
// (and plain paths) open POSIX storage, "mem" opens in-memory storage, "rados" a Ceph pool,
// "s3" an S3 bucket.
// The built-in schemes are registered lazily, under the registry's mutex, on first use, so that
// nothing depends on the order in which static initialisers of a static library run (or whether
// they run at all).
#include "safepoint/storage.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "storage/counted_storage.h"
#include "storage/rados/rados_storage.h"
#include "storage/s3/s3_storage.h"

namespace safepoint {

namespace {

// Longest accepted object name, in bytes (PATH_MAX on Linux).
constexpr size_t kMaxObjectNameBytes = 4096;

std::string Quoted(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '\0') {
      out += "\\0";
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

Status BadName(std::string_view name, std::string_view why) {
  std::string m = "invalid object name ";
  m += Quoted(name);
  m += ": ";
  m += why;
  return InvalidArgument(std::move(m));
}

class SchemeRegistry {
 public:
  static SchemeRegistry& Get() {
    static SchemeRegistry* registry = new SchemeRegistry();  // never destroyed: usable at exit
    return *registry;
  }

  void Register(std::string scheme, StorageFactory factory) {
    std::lock_guard<std::mutex> lock(mu_);
    RegisterBuiltinsLocked();
    factories_[Lower(scheme)] = std::move(factory);
  }

  // Returns the factory for `scheme`, or null with the list of known schemes in `known`.
  StorageFactory Find(std::string_view scheme, std::string* known) {
    std::lock_guard<std::mutex> lock(mu_);
    RegisterBuiltinsLocked();
    auto it = factories_.find(Lower(scheme));
    if (it != factories_.end()) return it->second;
    for (const auto& [name, factory] : factories_) {
      if (!known->empty()) *known += ", ";
      *known += name;
    }
    return nullptr;
  }

 private:
  static std::string Lower(std::string_view s) {
    std::string out(s);
    std::transform(out.begin(), out.end(), out.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return out;
  }

  void RegisterBuiltinsLocked() {
    if (builtins_registered_) return;
    builtins_registered_ = true;
    // "file:///abs/path": `rest` is what follows "file://", i.e. "/abs/path" (an empty host) or
    // "localhost/abs/path". Percent-escapes are not decoded: the path is taken literally.
    factories_["file"] = [](std::string_view uri,
                            std::string_view rest) -> Result<std::unique_ptr<Storage>> {
      if (rest.starts_with("localhost/")) rest.remove_prefix(std::string_view("localhost").size());
      if (!rest.starts_with('/')) {
        return InvalidArgument("storage URI \"" + std::string(uri) +
                               "\": a file URI needs an absolute path (file:///abs/path)");
      }
      return NewPosixStorage(std::string(rest));
    };
    factories_["mem"] = [](std::string_view uri,
                           std::string_view rest) -> Result<std::unique_ptr<Storage>> {
      return NewMemoryStorage(std::string(rest));
    };
    // "rados://POOL/PREFIX[?timeout=S&retries=N&chunk_size=B]" (src/storage/rados).
    factories_["rados"] = internal::OpenRadosStorage;
    factories_["s3"] = OpenS3Storage;  // "s3://BUCKET/PREFIX?OPTIONS"
  }

  std::mutex mu_;
  bool builtins_registered_ = false;
  std::map<std::string, StorageFactory> factories_;
};

// RFC 3986: scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ).
bool IsScheme(std::string_view s) {
  if (s.empty() || !std::isalpha(static_cast<unsigned char>(s[0]))) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.';
  });
}

// The error for a URI with user information, naming it without that (as
// "scheme://<credentials removed>@rest") and where the scheme's credentials come from instead.
Status CredentialsInUri(std::string_view scheme, std::string_view after_at) {
  std::string lower(scheme);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  constexpr std::string_view kS3 =
      "pass them in the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
      "AWS_SESSION_TOKEN), or AWS_PROFILE with ~/.aws/credentials (docs/operations.md)";
  constexpr std::string_view kRados =
      "librados takes them from the Ceph configuration and keyring: $CEPH_CONF, and "
      "CEPH_ARGS='--id NAME' for the client (docs/operations.md)";
  const std::string how(lower == "s3"      ? kS3
                        : lower == "rados" ? kRados
                                           : std::string_view("this scheme takes none"));
  return InvalidArgument("storage URI \"" + std::string(scheme) + "://<credentials removed>@" +
                         std::string(after_at) +
                         "\": credentials in a storage URI are refused (they would be shown in "
                         "errors, the status and the logs); " +
                         how);
}

}  // namespace

Status ValidateObjectName(std::string_view name) {
  if (name.empty()) return BadName(name, "empty");
  if (name.size() > kMaxObjectNameBytes) {
    return BadName(name.substr(0, 64), "longer than 4096 bytes");
  }
  if (name.find('\0') != std::string_view::npos) return BadName(name, "contains a NUL byte");
  if (name.find('\\') != std::string_view::npos) return BadName(name, "contains a backslash");
  if (name.front() == '/') return BadName(name, "absolute (starts with '/')");
  if (name.find(".tmp.") != std::string_view::npos) {
    return BadName(name, "contains \".tmp.\", which is reserved for temporary objects");
  }
  size_t start = 0;
  while (true) {
    size_t end = name.find('/', start);
    std::string_view component =
        name.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (component.empty()) return BadName(name, "empty path component");
    if (component == ".") return BadName(name, "\".\" path component");
    if (component == "..") return BadName(name, "\"..\" path component");
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return Status::OK();
}

Status ValidateObjectPrefix(std::string_view prefix) {
  if (prefix.empty()) return Status::OK();
  if (prefix.size() > kMaxObjectNameBytes) {
    return InvalidArgument("invalid object prefix " + Quoted(prefix.substr(0, 64)) +
                           ": longer than 4096 bytes");
  }
  size_t slash = prefix.rfind('/');
  if (slash != std::string_view::npos) {
    Status s = ValidateObjectName(prefix.substr(0, slash));
    if (!s.ok()) {
      return InvalidArgument("invalid object prefix " + Quoted(prefix) + ": " + s.message());
    }
  }
  std::string_view last = slash == std::string_view::npos ? prefix : prefix.substr(slash + 1);
  if (last.find('\0') != std::string_view::npos) {
    return InvalidArgument("invalid object prefix " + Quoted(prefix) + ": contains a NUL byte");
  }
  if (last.find('\\') != std::string_view::npos) {
    return InvalidArgument("invalid object prefix " + Quoted(prefix) + ": contains a backslash");
  }
  return Status::OK();
}

void RegisterStorageScheme(std::string scheme, StorageFactory factory) {
  SchemeRegistry::Get().Register(std::move(scheme), std::move(factory));
}

Result<std::unique_ptr<Storage>> OpenStorage(std::string_view uri) {
  if (uri.empty()) return InvalidArgument("empty storage URI");
  size_t sep = uri.find("://");
  if (sep == std::string_view::npos || !IsScheme(uri.substr(0, sep))) {
    // A plain path, absolute or relative to the current directory.
    SP_ASSIGN_OR_RETURN(std::unique_ptr<Storage> posix, NewPosixStorage(std::string(uri)));
    return internal::CountRequests(std::move(posix), "file");
  }
  std::string_view scheme = uri.substr(0, sep);
  std::string_view rest = uri.substr(sep + 3);
  // RFC 3986 user information ("s3://KEY:SECRET@bucket/run1"): credentials typed into a URI
  // would be shown wherever the URI is (errors, `safepoint status`, job.json, agent.log, the
  // event log). Refused, for every scheme, with an error that leaves them out.
  if (const std::string_view authority = rest.substr(0, rest.find_first_of("/?#"));
      authority.find('@') != std::string_view::npos) {
    return CredentialsInUri(scheme, rest.substr(authority.rfind('@') + 1));
  }
  std::string known;
  StorageFactory factory = SchemeRegistry::Get().Find(scheme, &known);
  if (!factory) {
    return InvalidArgument("storage URI \"" + std::string(uri) + "\": unknown scheme \"" +
                           std::string(scheme) + "\" (known schemes: " + known + ")");
  }
  SP_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, factory(uri, rest));
  return internal::CountRequests(std::move(storage), scheme);
}

}  // namespace safepoint
