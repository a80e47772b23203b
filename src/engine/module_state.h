// The hooks around a unit's forward (FSDP2's FSDPState hooks): deciding a tree's root on first use
// (its RootState, root_state.h), and the input and output hooks that drive the tree's iteration.
//
// Note [one training iteration]
// An iteration starts at the first forward with grad mode on: every unit moves its sharded gradients
// aside (param_group.h). Each unit all-gathers at its forward. Its floating inputs that require grad
// pass through an identity autograd function whose backward runs once the unit's whole backward for
// that input is done (FSDP2's RegisterPostBackwardFunction): when all of them have reported, the
// unit reduces its gradients and reshards. This trigger depends on the graph's structure only, not
// on which parameters happened to get gradients, so every rank reduces in the same order. Hooks on
// the unit's outputs all-gather it again before its backward and queue, once, a callback on the
// autograd engine; when backward finishes it reduces the units still pending (those whose inputs did
// not require grad, and units nobody forwarded) in reverse forward order and then in reverse creation
// order, reshards everything and puts the sharded gradients back. A forward without grad mode frees
// every unit of the tree, root included, when the root's forward returns.
// Ranks that take different branches inside a unit therefore still issue the same collectives in
// the same order (tested). An earlier design reduced a unit when every parameter's AccumulateGrad
// hook had fired; that let one rank reduce a unit mid-backward while another deferred it, and it
// freed gathered weights that a frozen parameter's backward still needed.
//
// Note [prefetch]
// On CUDA, FSDP2 overlaps the next unit's all-gather with the current unit's compute because the CPU
// runs ahead of the GPU streams ("implicit prefetch"). On CPU nothing runs ahead, so the overlap is
// made explicit: a unit issues its own all-gather, then the next unit's (forward: the one that ran
// after it in the previous forward; backward: FSDP2's default, the unit before it in post-forward
// order), and only then waits for its own. Collectives must be issued in the same order on every
// rank; both choices depend only on the sequence of units run, which every rank shares anyway. A
// mistargeted prefetch costs one all-gather and is resharded at the end of the iteration.
// FSDP1's options change two things: BACKWARD_POST issues the backward target from the unit's
// post-backward (after its gradients, once it is resharded, before its reduce-scatter) rather than
// before its gradients, and max_all_gathers_in_flight (limit_all_gathers) drops a target that would
// exceed the limit, so that unit is gathered when it runs.
#pragma once

#include <memory>

#include "engine/param_group.h"
#include "engine/root_state.h"

namespace fsdp::detail {

/// The tree state of `group`, deciding the root on first use (FSDP2's lazy init).
std::shared_ptr<RootState> ensure_root_state(ParamGroup& group);

}  // namespace fsdp::detail
