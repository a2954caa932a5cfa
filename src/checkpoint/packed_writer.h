// Writing a packed image (pack_manifest.h): the image's chunks, content-addressed and encoded
// in parallel, then its manifest, under the chunk store's protocol with its garbage collector
// (packed_writer.cc, chunk_gc.cc). A component of CheckpointStore's writes, which choose the
// layout (checkpoint_store.cc) and of tier copies (tier_copy.cc); it knows only the storage.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/image.h"
#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint {

// Where a packed write takes the image's bytes from.
struct PackSource {
  std::string manifest_name;
  bool exclusive = false;  // publish the manifest only where the name is free (AlreadyExists)
  ImageMeta meta;
  ImageLayout layout;
  std::vector<TensorEntry> tensors;  // for each chunk's element size (compression)
  // Fills image chunk `chunk` (its whole length) into `dst`, or returns a view of it (an image
  // already in memory) and leaves `dst` alone.
  std::function<Result<std::span<const std::byte>>(uint64_t chunk, std::span<std::byte> dst)> chunk;
  // The checksum section for the chunks' CRCs, to store in the manifest.
  std::function<Result<std::vector<std::byte>>(std::span<const uint32_t> crcs)> checksums;
  // Tensor bytes in memory (up to 4 MiB of the largest tensor) of `sample_element_size`-byte
  // values, for compression="auto" to probe the encoder on before it chooses the layout
  // (CompressionPolicy::WantPacked); empty where there are none.
  std::span<const std::byte> sample;
  int sample_element_size = 1;
};

// The source of `image`, the image of a save whose generation is `generation` (the builder must
// outlive the source).
PackSource PackSourceOf(const ImageBuilder& image, uint64_t generation);
// The source of an image complete in memory (`image` must outlive it), its manifest named by
// `generation`: InvalidArgument when its header does not name (step, rank) and its size.
Result<PackSource> PackSourceOf(std::span<const std::byte> image, uint64_t step, uint32_t rank,
                                uint64_t generation = 0);

// Writes the packed image of `source` to `storage` with the compression `options` asks for.
// Unavailable when the chunk store's GC still runs after a short wait (nothing relied on; the
// caller writes the plain image instead).
Result<WriteStats> WritePackedImage(Storage& storage, const PackSource& source,
                                    const PackOptions& options);

}  // namespace safepoint
