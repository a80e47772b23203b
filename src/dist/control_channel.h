// Private: messages between ranks that are not training data, on the control channel.
//
// Note [the control channel]
// Agreement checks, the node-layout exchange at rendezvous and rank 0's status broadcasts ("could
// not read the file") are small host-side messages. They travel on DistributedContext::control(), a
// group of every rank kept apart from the data groups (world, intra_node, cross_node) that carry
// parameters and gradients, for two reasons: on GPUs the data groups are NCCL, which carries only
// device tensors, while these messages are CPU bytes; and a control message must never take a slot
// in the data groups' sequence of collectives, whose byte counters then measure the engine alone.
// Both channels are Gloo on this CPU build; the control channel stays Gloo on every build.
#pragma once

#include <fsdp/process_group.h>

#include <string>
#include <vector>

namespace fsdp::detail {

/// Every rank's string, in rank order (lengths, then padded bytes, over two all-gathers). Collective
/// on the control channel.
std::vector<std::string> all_gather_strings(const DistributedContext& context, const std::string& text);

/// Whether every rank holds the same `text`: one all-reduce of a fixed-size digest (two 62-bit
/// hashes and the length, each with its negation, reduced by max: equal on every rank exactly when
/// max == min), so its bytes grow with neither the text nor the number of ranks. Two different texts
/// pass for equal only if both hashes and the length collide. Collective on the control channel.
bool same_on_every_rank(const DistributedContext& context, const std::string& text);

/// `root`'s string on every rank (its length, then its bytes when there are any: one broadcast for
/// an empty string). `text` matters on `root` only. Collective on the control channel.
std::string broadcast_string(const DistributedContext& context, const std::string& text, int64_t root = 0);

}  // namespace fsdp::detail
