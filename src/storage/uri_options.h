// Options of storage URIs: the query string of "rados://POOL/PREFIX?timeout=30&chunk_size=8M" or
// "s3://BUCKET/PREFIX?retries=2&part_size=64M". The object-store backends parse their own keys
// with these helpers, so that the keys they share (timeout, retries) and byte sizes read the same
// everywhere (docs/operations.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::internal {

// The most retries a URI may ask for (`retries=N`, 0..kMaxUriRetries).
constexpr int kMaxUriRetries = 100;

// One "key=value" item of a query string.
struct UriOption {
  std::string_view key;
  std::string_view value;  // empty when the item has no '='
};

// The items of `query` (the text after '?'), in order: split at '&', each item at its first
// '='; empty items ("a=1&&b=2") are skipped. No percent-decoding. The views point into `query`.
std::vector<UriOption> SplitUriQuery(std::string_view query);

// A number of bytes: decimal digits, optionally followed by K, M or G (powers of 1024, either
// case) and then optionally "B", "i" or "iB" ("64K", "16M", "16MiB", "1g"), or by "B" alone.
// nullopt when malformed or above UINT64_MAX.
std::optional<uint64_t> ParseByteSize(std::string_view s);

// A positive number of seconds in plain decimals ("30", "2.5"); nullopt otherwise.
std::optional<double> ParseSeconds(std::string_view s);

// A whole decimal number (digits only, no sign) in [lo, hi]; nullopt otherwise.
std::optional<int64_t> ParseWholeNumber(std::string_view s, int64_t lo, int64_t hi);

// The default bound of each request: $SAFEPOINT_STORAGE_TIMEOUT when set and not empty, else
// `fallback`. InvalidArgument when the variable is not a positive number of seconds.
Result<double> StorageTimeoutFromEnv(double fallback = 60);

// InvalidArgument("storage URI \"<uri>\": <why>"): the error of a malformed URI or option.
Status BadStorageUri(std::string_view uri, std::string_view why);

}  // namespace safepoint::internal
