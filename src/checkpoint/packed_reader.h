// Reading a packed image (pack_manifest.h): the image a manifest describes, as one object that
// holds exactly the plain image's bytes, so that every reader of CheckpointStore (whole images,
// range reads, tier copies, verify, inspect) reads packed and plain images alike.
#pragma once

#include <memory>
#include <string>

#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint {

// The image the manifest `manifest_name` describes, as an object of the image's size. Reads of
// the header, index, extras and checksum section come from the manifest; other reads fetch and
// decode the chunks they cover, each checked against the image's chunk CRC. A missing chunk
// object is Corruption naming the step, the chunk and the object.
Result<std::unique_ptr<ReadableObject>> OpenPackedImage(std::shared_ptr<Storage> storage,
                                                        const std::string& manifest_name);

}  // namespace safepoint
