// S3Storage: the Storage interface over an S3 bucket ("s3://BUCKET/PREFIX"), for AWS S3, Ceph's
// RADOS Gateway and MinIO. Private to the library; reached through OpenStorage("s3://...").
//
// Layout: object NAME is the S3 object PREFIX/NAME, byte for byte (one S3 object per storage
// object, as a file per object under file://).
//
// Writing: a WritableObject buffers what is written in parts of `part_size` bytes (16 MiB by
// default, grown so that size_hint needs at most 10000 parts). An object that ends within the
// first part is sent in one PUT at Publish. Otherwise a multipart upload is started when the
// first part is completely written, every completely written part is uploaded in the background
// at once (at most `connections` parts buffered for upload per object: WriteAt waits for room),
// the rest at Publish, and CompleteMultipartUpload publishes the object atomically. A WriteAt
// that covers a whole part by itself (a persist's part-sized, part-aligned requests) uploads it
// from the caller's bytes before it returns: no copy and no part buffer. Abort, a
// failed write and the destructor of an unpublished object send AbortMultipartUpload; the upload
// ids this process is writing are kept in a process-wide set that RemoveLeftovers skips, so it
// aborts only uploads of crashed writers (ListMultipartUploads under the prefix).
//
// PublishIfAbsent: HEAD first (AlreadyExists when present), then the PUT (or the Complete)
// carries `If-None-Match: *`, and HTTP 412 is AlreadyExists. Where a server ignores the header
// (radosgw 16.2 on CompleteMultipartUpload: it answers 200 and replaces; some S3-compatible
// stores on PUT too), only the HEAD guards, and two exclusive publishers racing within one
// round trip could both succeed. COMMIT records are small: always one PUT.
//
// Reading: Open sends HEAD (size, ETag); ReadAt sends ranged GETs with If-Match on the ETag (an
// object replaced after Open reads as an IOError, never as a mix of two versions), copying the
// body straight into the caller's buffer; a read larger than a part is split into part-sized
// ranges fetched in parallel on the storage's `connections` threads.
//
// URI options (a query string): timeout=SECONDS (each request's bound; default
// $SAFEPOINT_STORAGE_TIMEOUT, else 60), retries=N (4), part_size=BYTES (16M; 5M..5G; K/M/G
// suffixes), connections=N (8 parallel requests per object read or write).
#pragma once

#include <memory>
#include <string_view>

#include "safepoint/storage.h"

namespace safepoint {

// Opens `uri` ("s3://BUCKET/PREFIX?OPTIONS"); `rest` is what follows "s3://".
Result<std::unique_ptr<Storage>> OpenS3Storage(std::string_view uri, std::string_view rest);

}  // namespace safepoint
