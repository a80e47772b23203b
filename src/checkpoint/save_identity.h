// Which save a checkpoint file belongs to, and which rank wrote it (Note [save identity]).
//
// Note [save identity]
// ~~~~~~~~~~~~~~~~~~~~
// A checkpoint is many files written by many ranks. A rank file copied from another save with the
// same shapes, or two rank files swapped, would load without complaint and give other numbers, so
// every file fsdp.cpp writes into a SHARDED (DCP) directory says which save and which rank it
// belongs to, and loading checks that all of them agree with `.metadata` and with the marker:
//   - each save has a fresh id (new_save_id), chosen by rank 0 and sent to every rank;
//   - `.metadata` records it as StorageMeta.save_id, where PyTorch records its own;
//   - each `__<rank>_0.distcp` ends with a footer: the JSON {"save_id", "rank", "world_size"}, its
//     length (8 bytes, little-endian) and the magic "fsdp.id1". DCP locates every item by offset and
//     length, so PyTorch's readers never look at the bytes after the last item;
//   - `checkpoint_complete.json` records the id.
// A DCP directory written by PyTorch has no footers; nothing can tell its files apart, and it is
// read as PyTorch reads it. One file with a footer makes every file of the directory need one.
#pragma once

#include <fsdp/process_group.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::detail {

/// A new save's identity: 128 random bits as a UUID-like text (kSaveIdLength characters).
std::string new_save_id();
constexpr int64_t kSaveIdLength = 36;

/// Collective, one broadcast of kSaveIdLength bytes on the control channel: rank 0's new_save_id()
/// on every rank.
std::string share_save_id(const DistributedContext& context);

struct FileIdentity {
  std::string save_id;
  int64_t rank = -1;
  int64_t world_size = 0;
};

/// The footer recording `identity`, to append to a rank file after its last item.
std::string identity_footer(const FileIdentity& identity);

/// The identity in the footer of `file`, and the footer's length; nullopt when the file has no
/// footer. A footer that is there but damaged is an error naming the file.
struct FoundIdentity {
  FileIdentity identity;
  int64_t footer_bytes = 0;
};
class ReadOnlyFile;
std::optional<FoundIdentity> read_identity_footer(const ReadOnlyFile& file);

}  // namespace fsdp::detail
